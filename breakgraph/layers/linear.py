"""Linear layers, bf16/fp32 or FP8 block-scaled, written for tensor parallelism.

``ColumnParallelLinear`` splits the output dim across ranks, ``RowParallelLinear`` the input
dim (and all-reduces), ``ReplicatedLinear`` keeps the whole weight. With ``tp_size == 1``
(the only size today) all three are plain linears. Checkpoint tensors enter through
:meth:`LinearBase.load`, the single place that checks shapes and slices shards.

FP8: ``weight`` float8_e4m3fn ``[N, K]`` + ``weight_scale_inv`` fp32 ``[ceil(N/bn), ceil(K/bk)]``.
A merged linear (gate‖up) stays FP8 only when every part's rows are a whole number of
blocks; otherwise its parts are dequantised on load (tiny test models).
"""

from __future__ import annotations

import torch
from torch import nn

from breakgraph.distributed import get_parallel_state
from breakgraph.kernels.fp8 import FP8_DTYPE
from breakgraph.kernels.linear import linear
from breakgraph.models.config import Fp8Config


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape the model expects."""


def check_shape(name: str, expected: tuple[int, ...], found: tuple[int, ...]) -> None:
    if tuple(expected) != tuple(found):
        raise WeightShapeError(f"tensor {name!r} has shape {tuple(found)}, expected {tuple(expected)}")


class LinearBase(nn.Module):
    """``y = x @ W.T (+ b)``. ``output_sizes`` lists the parts of a merged linear
    (e.g. ``[I, I]`` for gate‖up); ``load(name, tensor, part)`` fills part ``part``."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        *,
        bias: bool = False,
        fp8: Fp8Config | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.block = fp8.block if fp8 is not None else None
        merged_ok = fp8 is None or len(output_sizes) == 1 or all(s % fp8.block[0] == 0 for s in output_sizes)
        self.quantized = fp8 is not None and merged_ok
        wdtype = FP8_DTYPE if self.quantized else dtype
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=wdtype), requires_grad=False)
        if self.quantized:
            bn, bk = fp8.block
            self.weight_scale_inv = nn.Parameter(
                torch.empty(-(-self.out_features // bn), -(-in_features // bk), dtype=torch.float32),
                requires_grad=False,
            )
        else:
            self.weight_scale_inv = None
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.weight_scale_inv, self.block, self.bias)

    def load(self, name: str, tensor: torch.Tensor, kind: str = "weight", part: int = 0) -> None:
        """Copy checkpoint ``tensor`` (``kind`` in weight/weight_scale_inv/bias) into part ``part``."""
        param = getattr(self, kind)
        if param is None:
            raise WeightShapeError(f"tensor {name!r}: this layer has no {kind}")
        if len(self.output_sizes) == 1:
            target = param.data
        else:
            start, size = sum(self.output_sizes[:part]), self.output_sizes[part]
            if kind == "weight_scale_inv":
                start, size = start // self.block[0], size // self.block[0]
            target = param.data.narrow(0, start, size)
        check_shape(name, tuple(target.shape), tuple(tensor.shape))
        target.copy_(tensor.to(target.dtype) if tensor.dtype != target.dtype else tensor)

    def extra_repr(self) -> str:
        q = f", fp8 block={self.block}" if self.quantized else ""
        return f"in={self.in_features}, out={self.out_features}{q}"


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (MLA down-projections, the DSA indexer)."""

    def __init__(self, in_features: int, out_features: int, **kw) -> None:
        super().__init__(in_features, [out_features], **kw)


class ColumnParallelLinear(LinearBase):
    """Output features split across tensor-parallel ranks (``output_sizes`` are per rank)."""

    def __init__(self, in_features: int, output_sizes: list[int] | int, **kw) -> None:
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        tp = get_parallel_state().tp_size
        for s in sizes:
            if s % tp:
                raise ValueError(f"output size {s} is not divisible by tp_size {tp}")
        super().__init__(in_features, [s // tp for s in sizes], **kw)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced (no-op at tp_size 1)."""

    def __init__(self, in_features: int, out_features: int, **kw) -> None:
        tp = get_parallel_state().tp_size
        if in_features % tp:
            raise ValueError(f"input size {in_features} is not divisible by tp_size {tp}")
        super().__init__(in_features // tp, [out_features], **kw)
