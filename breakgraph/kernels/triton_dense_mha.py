"""Dense-causal MLA in MHA form (Triton; twin: :func:`~breakgraph.kernels.dense_mha.dense_causal_mha_ref`).

A flash-attention forward over packed, ragged requests. One program takes ``BLOCK_M``
consecutive query tokens of one head (and one chunk of their keys, below); grid
``(cdiv(T, BLOCK_M), H, chunks)``, the blocks with the most keys (the last) first. Row ``t`` sees the key rows ``key_rows[t] − pos[t] … key_rows[t]``
(:mod:`breakgraph.kernels.dense_mha`), so a block walks the union of its rows' ranges: where
all its rows share their first key (one request), the keys every row sees go through an
unmasked loop and only the diagonal is masked; a block that straddles requests masks every key
block. ``s = q_nope·k_nopeᵀ + q_pe·k_peᵀ`` with ``dn`` split into two power-of-two dots where it
is not one (GLM-5: 192 = 128 + 64), fp32 accumulate, online softmax in base 2, ``acc += p·v``
with ``p`` in ``v``'s dtype. Where the blocks are too few to fill the GPU, ``CHUNK`` cuts each
block's keys across programs (grid axis 2): a block whose keys fit one chunk is written
directly, the others leave per-chunk partials (normalised output, base-2 log-sum-exp; fp32)
that ``_dense_mha_merge_kernel`` combines. No host sync, grids from shapes: graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from breakgraph.kernels.triton_dense_mla import merge_partial

_LOG2E = 1.4426950408889634
#: The most a call's key-chunk partials may take (fp32); a larger split is not made.
_MAX_WORKSPACE_BYTES = 256 << 20


def _dot_width(d: int) -> int:
    """A dot's inner width for ``d`` columns: the next power of two, at least 16 (the tensor
    cores' least ``k``); the masks zero the padding."""
    return max(16, triton.next_power_of_2(d))


def _split_pow2(d: int) -> tuple[int, int]:
    """``d`` columns as two dot widths (:func:`_dot_width`): a power of two and the remainder
    (0: none), e.g. 192 → (128, 64), 24 → (16, 16), 12 → (16, 0)."""
    hi = 1 << (d.bit_length() - 1)
    if hi == d or d <= 16:
        return _dot_width(d), 0
    return hi, _dot_width(d - hi)


@triton.jit
def _mha_block(
    q1, q2, qp, kn_h, kp, v_h, stride_knt, stride_kpt, stride_vt, offs_n, offs_d1, offs_d2, offs_r, offs_v, n0, hi,
    first, last, m_i, l_i, acc, qk_scale, dn, dr, dv,
    D2: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One key block ``n0 … n0 + BLOCK_N`` of the online softmax (``kn_h``, ``v_h``: the head's
    first key and value; ``kp``: the shared rotary keys). ``MASKED``: keys outside a row's
    ``first … last`` (or past ``hi``) score ``-inf``; else every key is seen by every row."""
    keys = n0 + offs_n
    rows = keys.to(tl.int64)[:, None]
    kn_rows, kp_rows, v_rows = kn_h + rows * stride_knt, kp + rows * stride_kpt, v_h + rows * stride_vt
    live = keys < hi if MASKED else keys >= 0
    k1 = tl.load(kn_rows + offs_d1[None, :], mask=live[:, None] & (offs_d1 < dn)[None, :], other=0.0)
    s = tl.dot(q1, tl.trans(k1))
    if D2 > 0:
        k2 = tl.load(kn_rows + offs_d2[None, :], mask=live[:, None] & (offs_d2 < dn)[None, :], other=0.0)
        s = tl.dot(q2, tl.trans(k2), s)
    kp = tl.load(kp_rows + offs_r[None, :], mask=live[:, None] & (offs_r < dr)[None, :], other=0.0)
    s = tl.dot(qp, tl.trans(kp), s) * qk_scale
    if MASKED:
        seen = (keys[None, :] >= first[:, None]) & (keys[None, :] <= last[:, None])
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # every key masked so far: p = 0
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    vv = tl.load(v_rows + offs_v[None, :], mask=live[:, None] & (offs_v < dv)[None, :], other=0.0)
    acc = tl.dot(p.to(vv.dtype), vv, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _block_keys(POSITIONS, KEY_ROWS, offs_m, real, HAS_KEY_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key rows of a query block: each row's ``first … last``, the block's union ``lo … hi``
    (``hi`` exclusive) and ``full_end``: the keys ``lo … full_end`` are seen by every row (a
    block of one request: below its first row's own key, in whole key blocks; else none)."""
    pos = tl.load(POSITIONS + offs_m, mask=real, other=0).to(tl.int32)
    if HAS_KEY_ROWS:
        last = tl.load(KEY_ROWS + offs_m, mask=real, other=0).to(tl.int32)
    else:
        last = offs_m
    first = last - pos
    # padding rows (never stored) see the keys of the block's last real row: finite scores, and
    # they do not shorten the unmasked loop
    first = tl.where(real, first, tl.max(tl.where(real, first, -1), 0))
    last = tl.where(real, last, tl.max(tl.where(real, last, -1), 0))
    lo = tl.min(first, 0)
    hi = tl.max(last, 0) + 1
    shared = tl.min(first, 0) == tl.max(first, 0)
    full_end = tl.where(shared, lo + ((tl.min(last, 0) + 1 - lo) // BLOCK_N) * BLOCK_N, lo)
    return first, last, lo, hi, full_end


@triton.jit
def _dense_mha_fwd_kernel(
    QN, QP, KN, KP, V, OUT, POSITIONS, KEY_ROWS, WS_O, WS_LSE,
    stride_qnt, stride_qnh, stride_qpt, stride_qph,
    stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh, stride_ot, stride_oh,
    num_tokens, dn, dr, dv, qk_scale, chunk_keys,
    D1: tl.constexpr, D2: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
    HAS_KEY_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    block = tl.num_programs(0) - 1 - tl.program_id(0)  # the most keys first
    h = tl.program_id(1)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    real = offs_m < num_tokens
    first, last, lo, hi, full_end = _block_keys(POSITIONS, KEY_ROWS, offs_m, real, HAS_KEY_ROWS, BLOCK_N)
    chunks = 1
    start, end = lo, hi
    if SPLIT:  # grid axis 2: this program's chunk of ``chunk_keys`` keys (a multiple of BLOCK_N)
        chunks = (hi - lo + chunk_keys - 1) // chunk_keys
        start = lo + tl.program_id(2) * chunk_keys
        end = tl.minimum(start + chunk_keys, hi)
    if start < end:
        offs_d1 = tl.arange(0, D1)
        offs_d2 = D1 + tl.arange(0, D2 if D2 > 0 else 1)
        offs_r = tl.arange(0, DR)
        offs_v = tl.arange(0, DV)
        offs_n = tl.arange(0, BLOCK_N)
        qn_rows = QN + offs_m.to(tl.int64)[:, None] * stride_qnt + h * stride_qnh
        q1 = tl.load(qn_rows + offs_d1[None, :], mask=real[:, None] & (offs_d1 < dn)[None, :], other=0.0)
        q2 = q1
        if D2 > 0:
            q2 = tl.load(qn_rows + offs_d2[None, :], mask=real[:, None] & (offs_d2 < dn)[None, :], other=0.0)
        qp = tl.load(QP + offs_m.to(tl.int64)[:, None] * stride_qpt + h * stride_qph + offs_r[None, :],
                     mask=real[:, None] & (offs_r < dr)[None, :], other=0.0)  # fmt: skip

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DV], tl.float32)
        kn_h, v_h = KN + h * stride_knh, V + h * stride_vh
        ptrs = (kn_h, KP, v_h, stride_knt, stride_kpt, stride_vt, offs_n, offs_d1, offs_d2, offs_r, offs_v)
        for n0 in range(start, tl.minimum(end, full_end), BLOCK_N):  # keys every row sees: unmasked
            m_i, l_i, acc = _mha_block(q1, q2, qp, *ptrs, n0, hi, first, last, m_i, l_i, acc, qk_scale, dn, dr, dv, D2, False)
        for n0 in range(tl.maximum(start, full_end), end, BLOCK_N):  # the diagonal, and rows of other requests
            m_i, l_i, acc = _mha_block(q1, q2, qp, *ptrs, n0, hi, first, last, m_i, l_i, acc, qk_scale, dn, dr, dv, D2, True)
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc * (1.0 / l_safe)[:, None]
        if chunks == 1:
            o_rows = OUT + offs_m.to(tl.int64)[:, None] * stride_ot + h * stride_oh
            tl.store(o_rows + offs_v[None, :], o.to(OUT.dtype.element_ty), mask=real[:, None] & (offs_v < dv)[None, :])
        else:  # a partial (normalised output, base-2 log-sum-exp) for _dense_mha_merge_kernel
            item = ((block * tl.num_programs(1) + h) * tl.num_programs(2) + tl.program_id(2)).to(tl.int64)
            lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(WS_LSE + item * BLOCK_M + tl.arange(0, BLOCK_M), lse)
            ws_rows = WS_O + (item * BLOCK_M + tl.arange(0, BLOCK_M))[:, None] * DV
            tl.store(ws_rows + offs_v[None, :], o)


@triton.jit
def _dense_mha_merge_kernel(
    OUT, POSITIONS, KEY_ROWS, WS_O, WS_LSE, stride_ot, stride_oh, num_tokens, dv, chunk_keys, max_chunks,
    DV: tl.constexpr, HAS_KEY_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Combines the partials of the query blocks whose keys were cut into several chunks
    (weights ``2^(lse_c − max lse)``); the others were written by the forward kernel."""
    block = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    real = offs_m < num_tokens
    _, _, lo, hi, _ = _block_keys(POSITIONS, KEY_ROWS, offs_m, real, HAS_KEY_ROWS, BLOCK_N)
    chunks = (hi - lo + chunk_keys - 1) // chunk_keys
    if chunks > 1:
        offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
        for c in range(0, chunks):
            rows = ((block * tl.num_programs(1) + h) * max_chunks + c).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
            lse = tl.load(WS_LSE + rows)
            o = tl.load(WS_O + rows[:, None] * DV + offs_c[None, :])
            m_i, l_i, acc = merge_partial(lse, o, m_i, l_i, acc)
        o = acc * (1.0 / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
        o_rows = OUT + offs_m.to(tl.int64)[:, None] * stride_ot + h * stride_oh
        tl.store(o_rows + offs_c[None, :], o.to(OUT.dtype.element_ty), mask=real[:, None] & (offs_c < dv)[None, :])


def supports(q_nope, q_pe, k_nope, k_pe, v, positions, key_rows, softmax_scale, out) -> bool:
    """Whether the kernel takes these tensors: CUDA, bf16/fp16 alike, unit last strides."""
    tensors = (q_nope, q_pe, k_nope, k_pe, v, out)
    return (
        all(x.is_cuda and x.dtype == q_nope.dtype and x.stride(-1) == 1 for x in tensors)
        and q_nope.dtype in (torch.bfloat16, torch.float16)
        and positions.is_cuda
        and (key_rows is None or key_rows.is_cuda)
    )


def default_config(tokens: int, heads: int, sms: int = 132) -> dict[str, int]:
    """Tiles by the work's size (H100 sweep at GLM-5 TP8 dims, `scripts/bench_dense_mha.py
    --sweep`): 128 query rows and 8 warps where those blocks alone fill about the GPU
    (``tokens·heads ≥ 16384``: 78.7 against 105.0 µs at 2048 tokens × 8 heads), else 64 rows
    and 4 warps (29.9 against 38.5 µs at 1024); 64-key blocks, 2 stages. ``CHUNK``: keys per
    program where a block's keys are cut across programs (0: not cut), not yet by default."""
    if tokens * heads >= 16384:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "CHUNK": 0}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "CHUNK": 0}


def dense_causal_mha_triton(
    q_nope, q_pe, k_nope, k_pe, v, positions, key_rows, softmax_scale, out, *, config: dict[str, int] | None = None
) -> None:  # fmt: skip
    """The kernel behind :func:`~breakgraph.kernels.dense_mha.dense_causal_mha` (same contract).
    ``config``: tiles and launch options (``BLOCK_M``, ``BLOCK_N``, ``num_warps``,
    ``num_stages``, ``CHUNK``; default :func:`default_config`), for the benchmark's sweep. With
    ``CHUNK`` each query block's keys are cut into chunks of that many keys, one program each,
    whose partials (fp32, in a workspace of this call) a merge kernel combines; the chunks' grid
    axis is sized by all the key rows (a block spans at most them), its surplus programs exit.
    A split whose workspace would pass :data:`_MAX_WORKSPACE_BYTES` is not made."""
    from breakgraph.kernels.dispatch import num_sms

    t, heads, dn = q_nope.shape
    dr, dv = q_pe.shape[-1], v.shape[-1]
    if t == 0:
        return
    cfg = dict(default_config(t, heads, num_sms(q_nope.device)), **(config or {}))
    bm, bn, chunk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["CHUNK"]
    if chunk < 0 or chunk % bn:
        raise ValueError(f"CHUNK ({chunk}) must be 0 or a positive multiple of BLOCK_N ({bn})")
    d1, d2 = _split_pow2(dn)
    dvp = _dot_width(dv)
    blocks = triton.cdiv(t, bm)
    chunks = triton.cdiv(k_nope.shape[0], chunk) if chunk else 1
    if blocks * heads * chunks * bm * dvp * 4 > _MAX_WORKSPACE_BYTES:
        chunks = 1  # the partials would take too much memory: each block walks all its keys
    split = chunks > 1
    ws_o = ws_lse = out  # unread without a split
    if split:
        ws_o = torch.empty(blocks * heads * chunks * bm * dvp, dtype=torch.float32, device=out.device)
        ws_lse = torch.empty(blocks * heads * chunks * bm, dtype=torch.float32, device=out.device)
    rows = positions if key_rows is None else key_rows
    _dense_mha_fwd_kernel[(blocks, heads, chunks)](
        q_nope, q_pe, k_nope, k_pe, v, out, positions, rows, ws_o, ws_lse,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        k_nope.stride(0), k_nope.stride(1), k_pe.stride(0), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        t, dn, dr, dv, softmax_scale * _LOG2E, max(chunk, 1),
        D1=d1, D2=d2, DR=_dot_width(dr), DV=dvp, HAS_KEY_ROWS=key_rows is not None, BLOCK_M=bm, BLOCK_N=bn,
        SPLIT=split, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if split:
        cols = min(dvp, 128)
        _dense_mha_merge_kernel[(blocks, heads, dvp // cols)](
            out, positions, rows, ws_o, ws_lse, out.stride(0), out.stride(1), t, dv, chunk, chunks,
            DV=dvp, HAS_KEY_ROWS=key_rows is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_C=cols, num_warps=4,
        )  # fmt: skip
