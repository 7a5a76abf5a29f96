"""Dense linear dispatch: plain ``F.linear`` or the FP8 block-scaled GEMM; fp32 products of
bf16 activations (router and indexer head weights) on the tensor cores."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from breakgraph import env
from breakgraph.graphs import opaque_op
from breakgraph.kernels.dispatch import use_triton, use_triton_inference
from breakgraph.kernels.fp8 import FP8_DTYPE, fp8_block_linear_ref


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x [..., K] @ W.T``; ``W`` is dequantised per block when ``scale`` is given.

    FP8 on CUDA: activations quantised per (token, 128 columns) to e4m3, then
    ``torch._scaled_mm``'s blockwise recipe when this torch accepts it (probed once), else a
    Triton block-scaled GEMM (:func:`breakgraph.kernels.triton_fp8.fp8_linear`). The weight
    and its ``weight_scale_inv`` are used as loaded; no preparation step. ``x_fp8``: ``x``
    quantised by its producer (``(codes, scales)``, see
    :func:`~breakgraph.kernels.triton_fp8.fp8_linear`), which the FP8 GEMMs that quantise their
    input take instead; ignored elsewhere.
    """
    if scale is None:
        return F.linear(x, weight, bias)
    if use_triton(x) and weight.dtype == FP8_DTYPE and block is not None:
        q, s = x_fp8 if x_fp8 is not None else (None, None)
        return _fp8_linear_cuda(x, weight, scale, list(block), bias, q, s)
    return fp8_block_linear_ref(x, weight, scale, block, bias)


def fp8_input_read(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None) -> bool:
    """Whether :func:`linear` of ``x [..., K]`` reads ``x_fp8`` (``x`` quantised by its producer):
    an FP8 weight whose path for ``x``'s row count quantises its input (see
    :func:`~breakgraph.kernels.triton_fp8.reads_quantized_input`). True wherever that is not
    decided by a concrete row count on CUDA (CPU tensors, a symbolic count while torch.compile
    traces): there a producer that can quantise keeps doing so. A producer may skip the
    quantisation where this is False (decode rows on the GEMV): the linear then reads ``x``
    only, so its result does not change."""
    if scale is None or weight.dtype != FP8_DTYPE or block is None:
        return False
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if not use_triton(x) or torch.compiler.is_compiling() or not isinstance(rows, int) or tuple(block) != (128, 128):
        return True
    from breakgraph.kernels.triton_fp8 import reads_quantized_input

    return reads_quantized_input(rows, x.shape[-1], weight.shape[0], x.dtype, x.device)


def _fp8_linear_shape(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: list[int], bias: torch.Tensor | None,
    x_q: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@opaque_op(name="fp8_linear", fake_impl=_fp8_linear_shape)
def _fp8_linear_cuda(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: list[int], bias: torch.Tensor | None,
    x_q: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    from breakgraph.kernels.triton_fp8 import fp8_linear

    x_fp8 = (x_q, x_scale) if x_q is not None and x_scale is not None else None
    return fp8_linear(x, weight, scale, tuple(block), bias, x_fp8=x_fp8)


@functools.cache
def _bf16_mm_fp32_out_available(device: torch.device) -> bool:
    """Whether ``torch.mm(bf16, bf16, out_dtype=torch.float32)`` runs on ``device`` (probed once
    per device, after loading, outside any capture)."""
    a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
    try:
        return bool(torch.mm(a, a, out_dtype=torch.float32).eq(16).all())
    except (RuntimeError, NotImplementedError):
        return False


def exact_bf16_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 copy of the fp32 ``weight [N, K]`` for :func:`linear_fp32_out`'s tensor-core path,
    or None where that path does not apply: off CUDA, values that bf16 cannot hold exactly
    (the copy must be the same numbers), or a torch without the fp32-output bf16 GEMM. The
    caller owns the copy (made once, after loading)."""
    w = weight.detach()
    if not w.is_cuda or not _bf16_mm_fp32_out_available(w.device):
        return None
    w_bf16 = w.to(torch.bfloat16)
    return w_bf16 if torch.equal(w_bf16.to(w.dtype), w) else None


def fp32_out_operand(x: torch.Tensor, weight: torch.Tensor, bf16_copy: torch.Tensor | None) -> torch.Tensor:
    """The weight :func:`linear_fp32_out` should multiply ``x`` with: the exact bf16 copy (from
    :func:`exact_bf16_weight`) where it feeds the tensor-core path (bf16 ``x``), else the fp32
    ``weight`` itself (no per-call upcast of the copy for fp32 activations)."""
    return bf16_copy if bf16_copy is not None and x.dtype == torch.bfloat16 else weight


#: Rows up to which :func:`linear_fp32_out` on CUDA runs one Triton GEMV
#: (:func:`~breakgraph.kernels.triton_fp8_gemv.gemv_fp32_out`) instead of cuBLAS's split-K GEMM,
#: its reduction kernel and, with ``alpha``, the scaling kernel.
FP32_OUT_GEMV_MAX_M = 16  # H200 (scripts/bench_fp8_gemv.py): the GEMV loses to cuBLAS at 64 rows (13.0 vs 6.7 us)


def linear_fp32_out(x: torch.Tensor, weight: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """fp32 ``alpha · (x [..., K] @ weight [N, K]ᵀ)`` → ``[..., N]``. A bf16 ``weight`` with bf16
    CUDA ``x`` runs on the tensor cores with fp32 accumulation and output: the operands are the
    exact values, every bf16 product is exact in fp32, and only the accumulation order differs
    from an fp32 GEMM, by far less than the bf16 rounding of the activations already did:
    cuBLAS, or (``BREAKGRAPH_GEMV_FP32_OUT=1``, the default) one Triton
    kernel up to :data:`FP32_OUT_GEMV_MAX_M` rows outside autograd. Otherwise both are upcast
    and multiplied in fp32 (CPU, fp32 activations). ``alpha`` scales the fp32 product: after it
    on the CPU and in the Triton kernel, in cuBLAS's epilogue above (equal to scaling afterwards
    up to the order of the fp32 sums, as a split-K GEMM may scale its partials)."""
    if weight.dtype == torch.bfloat16 and x.dtype == torch.bfloat16 and x.is_cuda:
        x2 = x.reshape(-1, x.shape[-1])
        if env.read("BREAKGRAPH_GEMV_FP32_OUT") == "1" and use_triton_inference(x2, weight):
            out = _mm_fp32_out_cuda(x2, weight, float(alpha))
        else:
            out = _mm_fp32_out(x2, weight, alpha)
        return out.view(*x.shape[:-1], weight.shape[0])
    out = F.linear(x.float(), weight.float())
    return out * alpha if alpha != 1.0 else out


def _mm_fp32_out(x: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """cuBLAS: ``alpha`` scales the fp32 accumulator in the GEMM's epilogue (``addmm`` with
    ``beta = 0`` ignores its first operand, here the uninitialised output itself), so a scaled
    product is one kernel, not a product and a multiply."""
    if alpha == 1.0:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    out = x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    return torch.addmm(out, x, weight.t(), beta=0.0, alpha=alpha, out_dtype=torch.float32, out=out)


def _mm_fp32_out_shape(x: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


@opaque_op(name="mm_fp32_out", fake_impl=_mm_fp32_out_shape)
def _mm_fp32_out_cuda(x: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """The bf16 CUDA product of :func:`linear_fp32_out`, its kernel chosen by row count inside
    the op (a traced graph does not specialise on it)."""
    if x.shape[0] > FP32_OUT_GEMV_MAX_M:
        return _mm_fp32_out(x, weight, alpha)
    from breakgraph.kernels.triton_fp8_gemv import gemv_fp32_out

    return gemv_fp32_out(x if x.stride(-1) == 1 else x.contiguous(), weight.contiguous(), alpha)


def bmm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b`` (``[B, M, K] × [B, K, N]``) into ``out``, a strided view (a slice of a
    wider buffer, heads-first view of a tokens-first tensor). CUDA outside autograd recording:
    ``torch.bmm(out=)``, which cuBLAS writes in place wherever each matrix of ``out`` has a
    unit column stride (no copy kernel); else the product is copied in (autograd cannot
    record ``out=``; under ``torch.compile`` tracing the compiler places the product itself)."""
    if use_triton_inference(out, a, b) and not torch.compiler.is_compiling():
        torch.bmm(a, b, out=out)
    else:
        out.copy_(torch.bmm(a, b))
