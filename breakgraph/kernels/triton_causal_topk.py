"""The causal top-k rows of a short batch in one kernel (twin:
:func:`breakgraph.kernels.causal_topk.causal_topk_ref`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from breakgraph.kernels.pdl import pdl_launch, pdl_wait


@triton.jit
def _causal_topk_kernel(pos_ptr, out_ptr, K, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Row ``pid(0)``, columns of block ``pid(1)``: ``j`` where ``j ≤ pos``, else ``-1``."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pos = tl.load(pos_ptr + t)
    vals = tl.where(cols <= pos, cols, -1)
    tl.store(out_ptr + t * stride_out + cols, vals.to(tl.int32), mask=cols < K)


def causal_topk_triton(positions: torch.Tensor, out: torch.Tensor, block: int = 1024) -> None:
    """Write the causal rows into ``out [T, K]`` (int32, unit column stride) for ``positions [T]``."""
    t, k = out.shape
    if t and k:
        _causal_topk_kernel[(t, triton.cdiv(k, block))](positions, out, k, out.stride(0), BLOCK=block, num_warps=4, **pdl_launch(out.device))
