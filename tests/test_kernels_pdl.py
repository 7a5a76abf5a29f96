"""Programmatic dependent launch (``breakgraph.kernels.pdl``): when it is on, and that the
kernels taking part keep its contract on sm_90a — nothing stored before the wait, the wait
and the release of the next launch compiled in only with ``PDL``."""

from __future__ import annotations

import pytest
import torch

from breakgraph.kernels.pdl import pdl_enabled, pdl_launch

# global memory writes in sm_90 SASS: plain stores, atomics, reductions
_GLOBAL_WRITES = ("STG", "ATOMG", "RED", "ST.", "ATOM.")


def test_pdl_is_off_off_cuda_whatever_the_switch(monkeypatch):
    for value in ("0", "1", "auto"):
        monkeypatch.setenv("BREAKGRAPH_PDL", value)
        assert not pdl_enabled(torch.device("cpu"))
        assert pdl_launch(torch.device("cpu")) == {"PDL": False}


def test_pdl_auto_launches_with_pdl_only_inside_a_scope_that_asks(monkeypatch):
    """``auto``: PDL inside ``pdl_scope(True)`` only — which the engine opens for the decode graphs
    of at most ``PDL_AUTO_MAX_ROWS`` rows; ``1`` and ``0`` ignore the scope."""
    from breakgraph.engine.model_runner import decode_capture_context
    from breakgraph.kernels import pdl
    from breakgraph.kernels.pdl_scope import PDL_AUTO_MAX_ROWS

    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    cuda = torch.device("cuda", 0)
    cases = {"auto": (False, True, False), "1": (True, True, True), "0": (False, False, False)}
    for value, (outside, small, large) in cases.items():
        monkeypatch.setenv("BREAKGRAPH_PDL", value)
        assert pdl_enabled(cuda) == outside, value
        with decode_capture_context(1):
            assert pdl_enabled(cuda) == small, value
            with decode_capture_context(PDL_AUTO_MAX_ROWS + 1):
                assert pdl_enabled(cuda) == large, value
            assert pdl_enabled(cuda) == small, value
        assert pdl_enabled(cuda) == outside, value
    monkeypatch.setenv("BREAKGRAPH_PDL", "auto")
    assert pdl_launch(cuda) == {"PDL": False}
    with decode_capture_context(PDL_AUTO_MAX_ROWS):
        assert pdl_launch(cuda) == {"PDL": True, "launch_pdl": True}


def test_prefill_runs_with_pdl_under_auto_up_to_its_token_bound(monkeypatch):
    """``auto``: a prefill of at most ``PDL_AUTO_MAX_PREFILL_TOKENS`` tokens (its graph bucket's
    capture, its graphs' replays and breaks) launches with PDL, a longer one does not."""
    from breakgraph.engine.model_runner import prefill_pdl_context
    from breakgraph.kernels import pdl
    from breakgraph.kernels.pdl_scope import PDL_AUTO_MAX_PREFILL_TOKENS

    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    monkeypatch.setenv("BREAKGRAPH_PDL", "auto")
    cuda = torch.device("cuda", 0)
    for tokens, expect in ((1, True), (PDL_AUTO_MAX_PREFILL_TOKENS, True), (PDL_AUTO_MAX_PREFILL_TOKENS + 1, False)):
        with prefill_pdl_context(tokens):
            assert pdl_enabled(cuda) == expect, tokens
    assert not pdl_enabled(cuda)


def test_prefill_graph_captures_open_the_pdl_scope_of_their_bucket(hf_checkpoints, monkeypatch):
    """The model runner's capture context (a stand-in batch for a prefill bucket) opens the PDL
    scope of the bucket's token count."""
    from breakgraph import Engine
    from breakgraph.kernels import pdl
    from breakgraph.kernels.pdl_scope import PDL_AUTO_MAX_PREFILL_TOKENS

    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    monkeypatch.setenv("BREAKGRAPH_PDL", "auto")
    cuda = torch.device("cuda", 0)
    runner = Engine(hf_checkpoints["glm_moe_dsa"], device="cpu", dtype="float32", page_size=4).runner
    with runner.capture_context(PDL_AUTO_MAX_PREFILL_TOKENS):
        assert pdl_enabled(cuda)
    with runner.capture_context(PDL_AUTO_MAX_PREFILL_TOKENS + 1):
        assert not pdl_enabled(cuda)


def test_pdl_launch_traces_under_torch_compile(monkeypatch):
    """The piecewise backend traces the prefill forward, kernel launches included: the launch
    options must trace in one graph under every setting (``auto``: off there, outside any scope)."""
    from breakgraph.kernels import pdl

    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    cuda = torch.device("cuda", 0)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return x + len(pdl_launch(cuda))

    for value, launch_options in (("auto", 1), ("0", 1), ("1", 2)):
        monkeypatch.setenv("BREAKGRAPH_PDL", value)
        torch._dynamo.reset()
        assert torch.compile(forward, fullgraph=True, backend="eager")(torch.zeros(2)).tolist() == [launch_options] * 2


def test_decode_capture_context_needs_no_triton():
    """A base install has no triton, yet captures CPU decode graphs through the engine's
    ``decode_capture_context``: neither it nor the engine may import triton."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"  # any import of triton now fails
        "from breakgraph.engine.model_runner import decode_capture_context\n"
        "with decode_capture_context(1): pass\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_pdl_switch_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv("BREAKGRAPH_PDL", "yes")
    with pytest.raises(ValueError, match="BREAKGRAPH_PDL"):
        pdl_enabled(torch.device("cuda", 0))


def _kernels():
    """(name, kernel, argument types, constexprs, warps, stages, loads weights before the wait)."""
    import triton

    from breakgraph.kernels import triton_fp8_gemv as g
    from breakgraph.kernels import triton_moe as tm
    from breakgraph.kernels import triton_norm as tn

    cfg = g.gemv_config(1, 2752, 6144, 132)
    gemv_types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "bias_ptr": "*bf16", "c_ptr": "*fp32",
                  "out_ptr": "*bf16", "lock_ptr": "*i32", "K_PER_SPLIT": 1024, "SPLIT_K": "i32", "alpha": "fp32",
                  "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_cm": "i32"}  # fmt: skip
    gemv_consts = {"W_FP8": True, "HAS_BIAS": False, "SPLIT": True, "FIXUP": True, "DOT": True, "ASM": True,
                   "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "INTERP": False, "MAX_SPLIT": 8}  # fmt: skip
    norm_types = {p: "*bf16" for p in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")}
    norm_types |= {"inv_n": "fp32", "eps": "fp32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    norm_consts = {"HAS_RESIDUAL": True, "QUANT": True, "GROUP": 128, "BLOCK": triton.next_power_of_2(6144),
                   "INTERP": False}  # fmt: skip
    route_types = {"scores_ptr": "*fp32", "bias_ptr": "*fp32", "w_out_ptr": "*fp32", "id_out_ptr": "*i64",
                   "scaling": "fp32"}  # fmt: skip
    route_consts = {"TOP_K": 8, "K_P2": 8, "N_GROUP": 1, "G_P2": 1, "TOPK_GROUP": 1, "HAS_BIAS": True, "NORM": True,
                    "BLOCK_T": 8, "E_P2": 256}  # fmt: skip
    return [
        ("gemv", g._fp8_gemv_kernel, gemv_types, gemv_consts, cfg["num_warps"], cfg["num_stages"], True),
        ("rms_norm", tn._rms_norm_kernel, norm_types, norm_consts, 8, 1, True),
        ("route", tm._route_kernel, route_types, route_consts, 4, 1, False),
    ]


@pytest.mark.parametrize("index", range(3))
def test_pdl_kernels_store_nothing_before_the_wait_on_sm90(index):
    pytest.importorskip("triton")
    from breakgraph.kernels import aot

    if not aot.tools_available():
        pytest.skip("this triton has no bundled ptxas/cuobjdump")
    name, kernel, types, consts, warps, stages, prefetches = _kernels()[index]
    on = aot.compile_for_sm90(kernel, types, consts | {"PDL": True}, warps, stages)
    print(name, on["before_gdc_wait"])
    if index == 0:  # the default (PDL=False) compiles neither instruction in
        off = aot.compile_for_sm90(kernel, types, consts, warps, stages)
        assert off["before_gdc_wait"] is None and "PREEXIT" not in off["ops"], f"{name}: PDL instructions without PDL"
        assert on["regs"] <= off["regs"] + 8, (name, on["regs"], off["regs"])
    before = on["before_gdc_wait"]
    assert before is not None and "PREEXIT" in on["ops"], f"{name}: no griddepcontrol wait/launch_dependents"
    writes = {op: n for op, n in before.items() if op.startswith(_GLOBAL_WRITES)}
    assert not writes, f"{name}: global writes before the wait: {writes}"
    # the weights are fetched ahead of the wait where the kernel says so (the GEMV as L2 prefetches)
    early_reads = sum(n for op, n in before.items() if op.startswith(("LDG", "CCTL.E.PF")))
    assert (early_reads > 0) == prefetches, f"{name}: reads before the wait: {before}"
    assert on["stack"] == 0 and on["local_insts"] == 0, on
