"""Split-K reduction shared by the FP8 GEMM and the GEMV: the per-device arrival counters with
which the last program of a tile sums its partials, and the sum kernel used where they cannot be."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _split_k_sum_kernel(
    ws_ptr, bias_ptr, c_ptr, MN, N,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``c = Σ_s ws[s] (+ bias)``, slices added in order (deterministic), fp32 then cast."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    slice_ptrs = ws_ptr + offs
    acc = tl.load(slice_ptrs, mask=ok, other=0.0)
    for _ in tl.static_range(1, SPLIT_K):
        slice_ptrs += MN  # step the pointer: MN needs no int64 cast (nor, as a specialised Python int, has one)
        acc += tl.load(slice_ptrs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=ok)


#: Output tiles one split-K GEMM may count arrivals for (a split GEMM has fewer tiles than SMs).
SPLIT_K_LOCK_SLOTS = 1024
_SPLIT_K_LOCKS: dict[str, torch.Tensor] = {}


def _split_k_locks(device: torch.device) -> torch.Tensor | None:
    """The per-device arrival counters of the split-K epilogue (int32 zeros, kept at zero by the
    programs that use them), or None while a CUDA graph is being captured before they exist
    (then the sum kernel reduces). GEMMs on one device run one after another on one stream
    (the engine's), so one set of counters serves them all."""
    key = str(device)
    locks = _SPLIT_K_LOCKS.get(key)
    if locks is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        locks = _SPLIT_K_LOCKS[key] = torch.zeros(SPLIT_K_LOCK_SLOTS, dtype=torch.int32, device=device)
    return locks
