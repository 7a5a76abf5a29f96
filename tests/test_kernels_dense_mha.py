"""Dense-causal MLA in MHA form: the Triton kernel against its twin, the twin against plain
causal attention, and the choice of form.

CPU: the kernel runs under Triton's interpreter (``check_*``, in a subprocess) on ragged packed
batches — token blocks that straddle requests, cached prefixes (``key_rows``), ``dn`` that is not
a power of two (GLM-5's 192 = 128 + 64), ``dv`` that is not one either, and keys cut into chunks
across programs (``CHUNK``: partials and their merge); fp32 inputs within
1e-5 of the twin, bf16 within 2× the error of rounding the fp32 result to bf16.
GPU (``-m cuda``): GLM-5 shapes (H = 8, dn = 192, dr = 64, dv = 256) up to 2048 tokens, and a
CUDA-graph replay.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from breakgraph.kernels.dense_mha import dense_causal_mha_ref, mha_form_pays

SCALE = 0.1


def _layout(prefix_lens: list[int], extend_lens: list[int], device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(positions [T], key_rows [T], keys)`` of a packed batch whose key buffer holds each
    request's ``prefix + extend`` rows in position order."""
    pos, rows, base = [], [], 0
    for p, e in zip(prefix_lens, extend_lens):
        pos += range(p, p + e)
        rows += range(base + p, base + p + e)
        base += p + e
    as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    return as_t(pos), as_t(rows), base


def _inputs(t: int, keys: int, heads: int, dn: int, dr: int, dv: int, dtype: torch.dtype, device: str = "cpu"):
    """Random queries and keys; ``q_nope``/``q_pe`` are strided views of one ``[T, H, dn + dr]``
    tensor and ``k_pe`` of a ``[Tk, 8 + dr]`` one, as the engine passes them."""
    q = torch.randn(t, heads, dn + dr, device=device).to(dtype)
    kpe_rows = torch.randn(keys, 8 + dr, device=device).to(dtype)
    k_nope = torch.randn(keys, heads, dn, device=device).to(dtype)
    v = torch.randn(keys, heads, dv, device=device).to(dtype)
    return q[..., :dn], q[..., dn:], k_nope, kpe_rows[:, 8:], v


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


_CASES = [  # (prefix_lens, extend_lens, dn, dr, dv, heads)
    ([0, 0, 0], [7, 70, 3], 192, 64, 256, 2),  # blocks straddle requests; dn = 128 + 64
    ([5, 0, 40], [9, 33, 20], 192, 64, 256, 2),  # cached prefixes: key_rows
    ([0], [130], 32, 16, 48, 3),  # one request, dv padded to 64
    ([3, 0], [1, 66], 24, 8, 16, 1),  # dn = 16 + 8 (the 8, and dr, padded to 16-wide dots), a one-token request
]


_FIXED: list[bool] = []


def _check_cases(dtype: torch.dtype, bound) -> None:
    from breakgraph.kernels.triton_dense_mha import dense_causal_mha_triton

    if not _FIXED:  # bf16 dots and rounding as on the GPU (once per interpreter process)
        from test_kernels_attention import _install_interpreter_fixes

        _install_interpreter_fixes()
        _FIXED.append(True)

    for prefix, extend, dn, dr, dv, heads in _CASES:
        positions, key_rows, keys = _layout(prefix, extend)
        t = positions.shape[0]
        qn, qp, kn, kp, v = _inputs(t, keys, heads, dn, dr, dv, dtype)
        rows = None if not any(prefix) else key_rows
        ref = torch.empty(t, heads, dv)
        dense_causal_mha_ref(qn.float(), qp.float(), kn.float(), kp.float(), v.float(), positions, rows, SCALE, ref)
        for cfg in ({"BLOCK_M": 16, "BLOCK_N": 16}, {"BLOCK_M": 64, "BLOCK_N": 32}, {"BLOCK_M": 16, "BLOCK_N": 16, "CHUNK": 32}):
            out = torch.full((t, heads, dv), float("nan"), dtype=dtype)
            dense_causal_mha_triton(qn, qp, kn, kp, v, positions, rows, SCALE, out, config=cfg)
            err = _rel(out, ref)
            assert err <= bound(ref), (prefix, extend, dn, dv, cfg, err)


def check_mha_kernel_matches_twin_in_fp32():
    _check_cases(torch.float32, lambda ref: 1e-5)


def check_mha_kernel_bf16_within_output_rounding():
    _check_cases(torch.bfloat16, lambda ref: 2 * _rel(ref.bfloat16(), ref))


def test_mha_kernel_interpreted(interp_results):
    for name in ("check_mha_kernel_matches_twin_in_fp32", "check_mha_kernel_bf16_within_output_rounding"):
        assert interp_results.get(name) == "ok", f"{name}:\n{interp_results.get(name)}"


def test_mha_launcher_refuses_a_chunk_that_is_not_a_multiple_of_the_key_block():
    pytest.importorskip("triton")
    from breakgraph.kernels.triton_dense_mha import dense_causal_mha_triton

    positions, _, keys = _layout([0], [20])
    args = (*_inputs(20, keys, 1, 16, 16, 16, torch.float32), positions, None, SCALE, torch.empty(20, 1, 16))
    for chunk in (-16, 24):
        with pytest.raises(ValueError, match="CHUNK"):
            dense_causal_mha_triton(*args, config={"BLOCK_N": 16, "CHUNK": chunk})


def test_twin_is_causal_attention_per_request():
    """The twin against ``scaled_dot_product_attention`` run request by request on the keys
    ``[k_nope ‖ k_pe]`` (a cached prefix: the queries are the last rows of the causal square)."""
    prefix, extend, heads, dn, dr, dv = [0, 6, 0], [5, 4, 9], 3, 12, 4, 10
    positions, key_rows, keys = _layout(prefix, extend)
    qn, qp, kn, kp, v = _inputs(positions.shape[0], keys, heads, dn, dr, dv, torch.float64)
    out = torch.empty(positions.shape[0], heads, dv, dtype=torch.float64)
    dense_causal_mha_ref(qn, qp, kn, kp, v, positions, key_rows, SCALE, out)
    t0 = k0 = 0
    for p, e in zip(prefix, extend):
        q = torch.cat([qn[t0 : t0 + e], qp[t0 : t0 + e]], -1).transpose(0, 1)  # [H, e, dn + dr]
        k = torch.cat([kn[k0 : k0 + p + e], kp[k0 : k0 + p + e, None].expand(-1, heads, -1)], -1).transpose(0, 1)
        mask = torch.ones(e, p + e, dtype=torch.bool).tril(p)
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k, v[k0 : k0 + p + e].transpose(0, 1), attn_mask=mask, scale=SCALE
        )
        torch.testing.assert_close(out[t0 : t0 + e], want.transpose(0, 1), rtol=1e-5, atol=1e-6)  # fp32 scores
        t0, k0 = t0 + e, k0 + p + e


def test_mha_form_pays_for_new_keys_not_for_long_prefixes():
    """GLM-5 dims: a fresh prompt takes the MHA form at any length; one new token on
    a long cached prefix keeps the absorbed form (its keys would all need projecting)."""
    dims = dict(rank=512, dn=192, dr=64, dv=256)
    for n in (1, 16, 1024, 2048):
        assert mha_form_pays(n, n, n * (n + 1) // 2, **dims), n
    assert not mha_form_pays(1, 2000, 2000, **dims)
    assert not mha_form_pays(64, 2000, 64 * 1968 + 64 * 65 // 2, **dims)
    assert mha_form_pays(1000, 2000, 1000 * 1000 + 1000 * 1001 // 2, **dims)


def test_mha_kernel_compiles_for_sm90_without_spills():
    """ptxas for sm_90a (no GPU needed) at GLM-5 dims and both default tiles (1024 and 4096
    tokens at 8 heads) and the 8-warp tiles with key chunks, with and without key rows: wgmma, nothing
    spilled inside the key loops (the 255-register 64-row tile keeps 40–72 bytes on the stack
    outside them); the merge kernel spills nothing."""
    pytest.importorskip("triton")
    from test_kernels_fp8 import compile_for_sm90

    from breakgraph.kernels import triton_dense_mha as tdm

    heads, dn, dr, dv = 8, 192, 64, 256
    args = dict(
        QN="*bf16", QP="*bf16", KN="*bf16", KP="*bf16", V="*bf16", OUT="*bf16", POSITIONS="*i64", KEY_ROWS="*i64",
        WS_O="*fp32", WS_LSE="*fp32", stride_qnt=heads * (dn + dr), stride_qnh=dn + dr,
        stride_qpt=heads * (512 + dr), stride_qph=512 + dr, stride_knt=heads * dn, stride_knh=dn, stride_kpt=576,
        stride_vt=heads * dv, stride_vh=dv, stride_ot=heads * dv, stride_oh=dv, num_tokens=1000, dn=dn, dr=dr,
        dv=dv, qk_scale=0.1, chunk_keys=512, max_chunks=2,
    )  # fmt: skip
    assert tdm.default_config(1024, heads) != tdm.default_config(4096, heads)
    tiles = [(tdm.default_config(n, heads), False) for n in (1024, 4096)]  # whole key ranges
    tiles += [(dict(BLOCK_M=m, BLOCK_N=64, num_warps=8, num_stages=2), True) for m in (64, 128)]  # key chunks
    for (cfg, split), has_rows in itertools.product(tiles, (False, True)):
        consts = dict(D1=128, D2=64, DR=dr, DV=dv, HAS_KEY_ROWS=has_rows, BLOCK_M=cfg["BLOCK_M"],
                      BLOCK_N=cfg["BLOCK_N"], SPLIT=split)  # fmt: skip
        info = compile_for_sm90(tdm._dense_mha_fwd_kernel, args, consts, cfg["num_warps"], cfg["num_stages"])
        print(f"MHA kernel, {cfg}, key rows {has_rows}, split {split}: {info['regs']} registers, "
              f"{info['stack']} bytes of stack")  # fmt: skip
        assert info["mma"] == ["HGMMA"], info
        assert info["loop_local_insts"] == 0 and info["stack"] <= 128, info
    consts = dict(DV=dv, HAS_KEY_ROWS=True, BLOCK_M=64, BLOCK_N=64, BLOCK_C=128)
    info = compile_for_sm90(tdm._dense_mha_merge_kernel, args, consts, 4, 2)
    assert info["stack"] == 0 and info["local_insts"] == 0, info


# --------------------------------------------------------------------------------------------
# GPU


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["1k", "2k", "ragged on prefixes"])
def test_mha_kernel_glm5_shapes_on_gpu(layout):
    """GLM-5 TP8 dims in bf16 against the fp32 twin (within 2× the bf16 rounding of the twin's
    result; also with the keys cut into chunks of 256 and 512), then captured in a CUDA graph and replayed on new inputs: equal to an eager call."""
    from cuda_capture import warmed_graph

    from breakgraph.kernels.dense_mha import dense_causal_mha

    prefix, extend = {"1k": ([0], [1024]), "2k": ([0], [2048]), "ragged on prefixes": ([0, 300, 0], [700, 77, 130])}[layout]
    positions, key_rows, keys = _layout(prefix, extend, "cuda")
    rows = key_rows if any(prefix) else None
    heads, dn, dr, dv = 8, 192, 64, 256
    scale = 1 / math.sqrt(dn + dr)
    t = positions.shape[0]
    qn, qp, kn, kp, v = _inputs(t, keys, heads, dn, dr, dv, torch.bfloat16, "cuda")
    out = torch.empty(t, heads, dv, dtype=torch.bfloat16, device="cuda")
    dense_causal_mha(qn, qp, kn, kp, v, positions, rows, scale, out)
    ref = torch.empty(t, heads, dv, device="cuda")
    dense_causal_mha_ref(qn.float(), qp.float(), kn.float(), kp.float(), v.float(), positions, rows, scale, ref)
    floor, err = _rel(ref.bfloat16(), ref), _rel(out, ref)
    assert err <= 2 * floor, f"error {err:.2e} vs bf16 rounding floor {floor:.2e}"
    from breakgraph.kernels.triton_dense_mha import dense_causal_mha_triton

    for chunk in (256, 512):  # keys cut across programs: partials and their merge
        split = torch.full_like(out, float("nan"))
        cfg = dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2, CHUNK=chunk)
        dense_causal_mha_triton(qn, qp, kn, kp, v, positions, rows, scale, split, config=cfg)
        assert _rel(split, ref) <= 2 * floor, (chunk, _rel(split, ref), floor)

    graph = warmed_graph(lambda: dense_causal_mha(qn, qp, kn, kp, v, positions, rows, scale, out))
    for x in (qn, qp, kn, kp, v):
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    got = out.clone()
    dense_causal_mha(qn, qp, kn, kp, v, positions, rows, scale, out)
    assert torch.equal(got, out)


@pytest.mark.cuda
def test_mha_form_is_no_less_accurate_than_the_absorbed_form_on_gpu():
    """From the same bf16 queries, latent rows and ``w_kc``/``w_vc`` at GLM-5 TP8 dims (1024 fresh
    tokens), the whole attention in each form — MHA: the keys' projections rounded to bf16, the
    MHA kernel; absorbed: ``q_nope·w_kc`` rounded to bf16, the dense-causal latent kernel, ``·w_vc``
    — against the same attention in fp32: the MHA form's error is at most the absorbed form's,
    and within 4× the bf16 rounding of the fp32 result."""
    from breakgraph.kernels.dense_mha import dense_causal_mha
    from breakgraph.kernels.linear import bmm_into
    from breakgraph.kernels.sparse_mla import sparse_mla_attention

    t, heads, rank, dn, dr, dv, page, k = 1024, 8, 512, 192, 64, 256, 64, 2048
    scale = (dn + dr) ** -0.5
    g = torch.Generator(device="cuda").manual_seed(3)
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    q = rnd(t, heads, dn + dr).bfloat16()
    kv = rnd(t, rank + dr).bfloat16()
    w_kc, w_vc = (rnd(heads, dn, rank) * rank**-0.5).bfloat16(), (rnd(heads, dv, rank) * rank**-0.5).bfloat16()
    pos = torch.arange(t, device="cuda")
    # fp32: both projections exact, then the attention
    c, kpe = kv[:, :rank].float(), kv[:, rank:].float()
    k_nope32 = torch.einsum("kr,hdr->khd", c, w_kc.float())
    v32 = torch.einsum("kr,hdr->khd", c, w_vc.float())
    ref = torch.empty(t, heads, dv, device="cuda")
    dense_causal_mha_ref(q[..., :dn].float(), q[..., dn:].float(), k_nope32, kpe, v32, pos, None, scale, ref)
    # MHA form
    k_nope = torch.matmul(kv[:, :rank], w_kc.view(heads * dn, rank).t()).view(t, heads, dn)
    v = torch.matmul(kv[:, :rank], w_vc.view(heads * dv, rank).t()).view(t, heads, dv)
    mha = torch.empty(t, heads, dv, dtype=torch.bfloat16, device="cuda")
    dense_causal_mha(q[..., :dn], q[..., dn:], k_nope, kv[:, rank:], v, pos, None, scale, mha)
    # absorbed form over a paged cache holding the same rows
    table = torch.arange(1, t // page + 1, dtype=torch.int32, device="cuda")[None, :]
    cache = torch.zeros((t // page + 1) * page, rank + dr, dtype=torch.bfloat16, device="cuda")
    cache[page:] = kv
    q_full = torch.empty(t, heads, rank + dr, dtype=torch.bfloat16, device="cuda")
    q_full[..., rank:] = q[..., dn:]
    bmm_into(q[..., :dn].transpose(0, 1), w_kc, q_full[..., :rank].transpose(0, 1))
    attn = torch.empty(t, heads, rank, dtype=torch.bfloat16, device="cuda")
    topk = torch.empty(t, k, dtype=torch.int32, device="cuda")
    sparse_mla_attention(q_full, cache, topk, table, torch.zeros_like(pos), page, scale, attn, positions=pos,
                         dense_below=k, request_tokens=[t], packed_rows=True, causal_rows=True)  # fmt: skip
    absorbed = torch.empty(t, heads, dv, dtype=torch.bfloat16, device="cuda")
    bmm_into(attn.transpose(0, 1), w_vc.transpose(1, 2), absorbed.transpose(0, 1))
    floor, e_mha, e_abs = _rel(ref.bfloat16(), ref), _rel(mha, ref), _rel(absorbed, ref)
    print(f"error against fp32: MHA {e_mha:.2e}, absorbed {e_abs:.2e}, bf16 rounding {floor:.2e}")
    assert e_mha <= e_abs and e_mha <= 4 * floor, (e_mha, e_abs, floor)


@pytest.mark.cuda
@pytest.mark.parametrize("chunk", [5, None])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_engine_mha_form_on_prefixes_and_fp8_cache_on_gpu(hf_checkpoints, monkeypatch, kv_cache_dtype, chunk):
    """The tiny GLM-5 model in bf16 on the GPU, prompts prefilled at once and in chunks of 5
    tokens (chunks on cached prefixes: the kernel's key rows, the gathered keys; with the FP8
    cache the keys read back from it), one of them 3× ``index_topk`` long (its tokens below it in
    MHA form, the rest sparse; a chunk crossing ``index_topk``): the MHA form forced (``=1``)
    gives the absorbed form's prompt logits (``=0``) within 2% (relative: two bf16 roundings of
    the same attention through 2 layers)."""
    from tiny_models import INDEX_TOPK

    from breakgraph import Engine

    folder = hf_checkpoints["glm_moe_dsa"]
    kw = dict(device="cuda", dtype="bfloat16", page_size=4, kv_cache_dtype=kv_cache_dtype)
    if chunk:
        kw["chunked_prefill_size"] = chunk
    g = torch.Generator().manual_seed(22)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (3, 7, 8, 3 * INDEX_TOPK)]
    logits = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("BREAKGRAPH_DENSE_MHA", mode)
        logits[mode] = Engine(folder, **kw).prompt_logits(prompts)
    for a, b in zip(logits["1"], logits["0"]):
        assert _rel(a, b) < 2e-2
