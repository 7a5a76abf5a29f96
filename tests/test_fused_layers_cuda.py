"""The decoder layer's fused kernels inside the model, on the GPU (``cuda`` marker): a 4-layer
``glm5-tp8-rank`` (FP8 block weights, dummy weights, 3 dense layers and one MoE layer) with its
fusions must be as close to the plain-PyTorch twins as the same model with every fusion undone
(:func:`unfused`: the separate Triton kernels — norm, then the linears' own activation
quantisation; RoPE, norm and ``cat``; the split-K sum kernel; ``bmm`` then a copy; SiLU then the
product — which the kernel tests check the fused ones against), for prompts of 700, 37 and 1
tokens (the one-token prompt takes the row-count paths of a bs-1 decode step: W8A8 Triton GEMMs
with split K, W8A16 where the start-up timing picks it).

Neither Triton path matches the twins closely at this size: the twins' FP8 linears keep bf16
activations, the kernels quantise them to e4m3 (≈ 2.5% per GEMM; the router's top-8 of 256
changes with it), ≈ 10–15% of the logits of random weights. And the two Triton paths differ from
each other by about as much as either differs from the twins' rounding: the fused norm quantises
its fp32 result where the unfused path quantises the bf16-rounded one, and one e4m3 step is 6% of
a value. So the check is relative: the fused path may be at most 10% (+ 0.01) further from the
twins than the unfused path is; a wrong fused kernel lands at ≈ 100%."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from breakgraph.bench.presets import PRESETS

pytestmark = pytest.mark.cuda


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Undo every fusion of the decoder layer (what the layer ran before them, kernel by kernel)."""
    from breakgraph.kernels import norm, rope, triton_fp8, triton_moe
    from breakgraph.layers import attention, dsa
    from breakgraph.layers import norm as norm_layer

    def rms_norm_fp8(x, weight, eps, residual=None):
        if residual is None:
            return norm.rms_norm(x, weight, eps), None, None
        return (*norm.fused_add_rms_norm(x, residual, weight, eps), None)

    def mla_rope_kv(q, kv_a, cos, sin, weight, eps, store=None):
        r = weight.shape[0]
        dr = kv_a.shape[-1] - r
        q_full = q.new_empty(q.shape[0], q.shape[1], r + dr)
        q_full[..., r:] = rope.rope(q[..., q.shape[-1] - dr :], cos, sin, True)
        kv = torch.cat([norm.rms_norm(kv_a[:, :r], weight, eps), rope.rope(kv_a[:, r:], cos, sin, True)], dim=-1)
        rope._store_rows(store, kv)  # a decode step's cache store, as the split op writes it
        return q_full, kv

    def indexer_rope_qk(q, k, cos, sin, weight, bias, eps, interleaved, rope_dim, store=None):
        k = F.layer_norm(k, (k.shape[-1],), weight, bias, eps)
        k = rope.rope(k, cos, sin, interleaved, rope_dim)
        rope._store_rows(store, k)
        return (rope.rope(q, cos, sin, interleaved, rope_dim) if q is not None else None), k

    def bmm_into(a, b, out):
        out.copy_(torch.bmm(a, b))

    def silu_mul(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    monkeypatch.setattr(norm_layer, "rms_norm_fp8", rms_norm_fp8)
    monkeypatch.setattr(attention, "mla_rope_kv", mla_rope_kv)
    monkeypatch.setattr(attention, "indexer_rope_qk", indexer_rope_qk)
    monkeypatch.setattr(attention, "bmm_into", bmm_into)
    monkeypatch.setattr(dsa, "bmm_into", bmm_into)
    monkeypatch.setattr(triton_fp8, "_split_k_locks", lambda device: None)
    monkeypatch.setattr(triton_moe, "silu_mul", silu_mul)


def test_fp8_model_with_fused_kernels_is_as_close_to_the_twins_as_unfused(tmp_path, monkeypatch):
    from breakgraph import Engine
    from breakgraph.kernels import dispatch

    (tmp_path / "config.json").write_text(json.dumps(dict(PRESETS["glm5-tp8-rank"], num_hidden_layers=4)))
    eng = Engine(tmp_path, device="cuda", load_format="dummy", page_size=64, num_pages=80, context_length=2048,
                 cuda_graph_backend_prefill="disabled", cuda_graph_backend_decode="disabled")  # fmt: skip
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(0, eng.config.vocab_size, (n,), generator=g).tolist() for n in (700, 37, 1)]
    with monkeypatch.context() as m:
        m.setenv("BREAKGRAPH_NORM_FP8", "1")  # the quantising norm too (the default)
        fused = eng.prompt_logits(batch)
    with monkeypatch.context() as m:
        unfused(m)
        separate = eng.prompt_logits(batch)
    monkeypatch.setattr(dispatch, "TRITON_ENABLED", False)
    twins = eng.prompt_logits(batch)
    fused_err = [_rel(a, b) for a, b in zip(fused, twins)]
    unfused_err = [_rel(a, b) for a, b in zip(separate, twins)]
    print(f"relative logit error per prompt: fused vs twins {[f'{e:.2e}' for e in fused_err]}, "
          f"unfused vs twins {[f'{e:.2e}' for e in unfused_err]}, "
          f"fused vs unfused {[f'{_rel(a, b):.2e}' for a, b in zip(fused, separate)]}")  # fmt: skip
    assert all(f <= 1.1 * u + 0.01 for f, u in zip(fused_err, unfused_err)), (fused_err, unfused_err)
    assert all(u < 0.3 for u in unfused_err), unfused_err  # the reference path itself is sane
