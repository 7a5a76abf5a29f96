"""Linear layers, bf16/fp32 or FP8 block-scaled, written for tensor parallelism.

``ColumnParallelLinear`` splits the output dim across ranks, ``RowParallelLinear`` the input
dim (and all-reduces), ``ReplicatedLinear`` keeps the whole weight; ``VocabParallelEmbedding``
and ``ParallelLMHead`` split the vocabulary. With ``tp_size == 1`` all of them are the plain
single-process layers. Checkpoint tensors enter through :meth:`LinearBase.load`; the loader
reads only this rank's piece of each tensor (:meth:`LinearBase.shard`) before copying it.

FP8: ``weight`` float8_e4m3fn ``[N, K]`` + ``weight_scale_inv`` fp32 ``[ceil(N/bn), ceil(K/bk)]``.
A merged linear (gate‖up) stays FP8 only when every part's rows are a whole number of
blocks; otherwise its parts are dequantised on load (tiny test models). Under tensor
parallelism an FP8 weight's shards must start on block boundaries (each rank's rows or
columns a whole number of blocks): :func:`check_fp8_shards` names the tensor otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from breakgraph.distributed import (
    ParallelState,
    Shard,
    ShardingError,
    get_parallel_state,
    tp_all_reduce,
    tp_gather_last_dim,
)
from breakgraph.kernels.fp8 import FP8_DTYPE
from breakgraph.kernels.linear import fp8_input_read, linear
from breakgraph.models.config import Fp8Config


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape the model expects."""


def check_shape(name: str, expected: tuple[int, ...], found: tuple[int, ...]) -> None:
    if tuple(expected) != tuple(found):
        raise WeightShapeError(f"tensor {name!r} has shape {tuple(found)}, expected {tuple(expected)}")


class LinearBase(nn.Module):
    """``y = x @ W.T (+ b)``. ``output_sizes`` lists the parts of a merged linear
    (e.g. ``[I, I]`` for gate‖up) as held by this rank; ``load(name, tensor, part)`` fills
    part ``part``. ``fp8_parts``: the parts' full (unsharded) sizes, which decide whether a
    merged FP8 linear stays FP8 (default: ``output_sizes``).

    ``shard_dim`` (class attribute): the weight dimension split across ranks (0 = output
    rows, 1 = input columns, None = replicated)."""

    shard_dim: int | None = None

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        *,
        bias: bool = False,
        fp8: Fp8Config | None = None,
        dtype: torch.dtype = torch.bfloat16,
        fp8_parts: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.tp = get_parallel_state()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.block = fp8.block if fp8 is not None else None
        parts = fp8_parts or self.output_sizes
        merged_ok = fp8 is None or len(parts) == 1 or all(s % fp8.block[0] == 0 for s in parts)
        self.quantized = fp8 is not None and merged_ok
        wdtype = FP8_DTYPE if self.quantized else dtype
        self.weight = nn.Parameter(
            torch.empty(self.out_features, in_features, dtype=wdtype), requires_grad=False
        )
        if self.quantized:
            bn, bk = fp8.block
            self.weight_scale_inv = nn.Parameter(
                torch.empty(-(-self.out_features // bn), -(-in_features // bk), dtype=torch.float32),
                requires_grad=False,
            )
        else:
            self.weight_scale_inv = None
        self.bias = (
            nn.Parameter(torch.empty(self.out_features, dtype=dtype), requires_grad=False) if bias else None
        )

    #: Leading parts of a merged linear that a caller computes on their own (:meth:`forward_first`),
    #: e.g. ``(1,)``: the first part alone. Their shapes are timed for the FP8 GEMM choice too.
    partial_parts: tuple[int, ...] = ()

    def forward(self, x: torch.Tensor, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``x @ W.T (+ b)``; ``x_fp8``: ``x`` already quantised by its producer (see
        :func:`~breakgraph.kernels.linear.linear`)."""
        return linear(x, self.weight, self.weight_scale_inv, self.block, self.bias, x_fp8)

    def forward_first(
        self, x: torch.Tensor, parts: int, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The first ``parts`` outputs of a merged linear, ``[..., sum(output_sizes[:parts])]``:
        :meth:`forward`'s columns of them, from their weight rows only (the other parts' rows are
        not read). Every part but the last ends on an FP8 block (:func:`merge_linears`), so the
        leading rows keep whole scale rows."""
        return linear(x, *self._first_rows(parts), x_fp8=x_fp8)

    def _first_rows(self, parts: int) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int] | None, torch.Tensor | None]:
        """``(weight, weight_scale_inv, block, bias)`` of the first ``parts`` parts (views)."""
        rows = sum(self.output_sizes[:parts])
        if not 0 < parts <= len(self.output_sizes):
            raise ValueError(f"a linear of {len(self.output_sizes)} parts has no first {parts}")
        scale = self.weight_scale_inv[: -(-rows // self.block[0])] if self.quantized else None
        bias = self.bias[:rows] if self.bias is not None else None
        return self.weight[:rows], scale, self.block, bias

    def takes_fp8_input(self, x: torch.Tensor, parts: int | None = None) -> bool:
        """Whether :meth:`forward` of ``x`` (:meth:`forward_first` with ``parts``) reads ``x_fp8``
        (FP8, and a path for ``x``'s row count that quantises its input: see
        :func:`~breakgraph.kernels.linear.fp8_input_read`), so that a producer of ``x`` should
        quantise it."""
        if not self.quantized:
            return False
        weight, scale, block, _ = self._first_rows(parts) if parts else (self.weight, self.weight_scale_inv, self.block, None)
        return fp8_input_read(x, weight, scale, block)

    def partial_shapes(self) -> set[tuple[int, int]]:
        """``(K, N)`` of each product :meth:`forward_first` computes (:attr:`partial_parts`)."""
        return {(self.in_features, sum(self.output_sizes[:p])) for p in self.partial_parts}

    def keep_high_precision(self, dtype: torch.dtype) -> None:
        """Hold this layer in ``dtype`` instead of FP8 (a module the checkpoint's FP8 exclusion
        list names). Called right after construction, before any weight is loaded."""
        if not self.quantized:
            return
        self.quantized = False
        self.weight = nn.Parameter(torch.empty_like(self.weight, dtype=dtype), requires_grad=False)
        self.weight_scale_inv = None

    def shard(self, kind: str) -> Shard | None:
        """Which piece of checkpoint tensor ``kind`` (weight/weight_scale_inv/bias) this rank holds."""
        if self.tp.tp_size == 1 or self.shard_dim is None or (kind == "bias" and self.shard_dim != 0):
            return None
        return Shard(self.shard_dim, self.tp.tp_rank, self.tp.tp_size)

    def load(self, name: str, tensor: torch.Tensor, kind: str = "weight", part: int = 0) -> None:
        """Copy checkpoint ``tensor`` (``kind`` in weight/weight_scale_inv/bias; already this
        rank's shard) into part ``part``."""
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
        t = (
            f", tp={self.tp.tp_rank}/{self.tp.tp_size}"
            if self.tp.tp_size > 1 and self.shard_dim is not None
            else ""
        )
        return f"in={self.in_features}, out={self.out_features}{q}{t}"


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (MLA down-projections, the DSA indexer)."""

    def __init__(self, in_features: int, out_features: int, **kw) -> None:
        super().__init__(in_features, [out_features], **kw)


class ColumnParallelLinear(LinearBase):
    """Output features split across tensor-parallel ranks (``output_sizes`` are the full sizes;
    each rank holds ``size / tp_size`` rows of every part)."""

    shard_dim = 0

    def __init__(self, in_features: int, output_sizes: list[int] | int, **kw) -> None:
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        tp = get_parallel_state()
        local = [tp.split(s, "output size") for s in sizes]
        super().__init__(in_features, local, fp8_parts=sizes, **kw)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced, then the bias added.
    ``reduce_results=False`` leaves the sum to the caller (the MoE sums routed and shared
    experts first and all-reduces once)."""

    shard_dim = 1

    def __init__(self, in_features: int, out_features: int, *, reduce_results: bool = True, **kw) -> None:
        tp = get_parallel_state()
        super().__init__(tp.split(in_features, "input size"), [out_features], **kw)
        if self.bias is not None and not reduce_results and tp.tp_size > 1:
            raise ValueError(
                "a row-parallel linear with a bias must reduce its results (the bias is added once)"
            )
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if self.tp.tp_size == 1:
            return linear(x, self.weight, self.weight_scale_inv, self.block, self.bias, x_fp8)
        y = linear(x, self.weight, self.weight_scale_inv, self.block, x_fp8=x_fp8)
        if self.reduce_results:
            y = tp_all_reduce(y.contiguous())
        return y + self.bias if self.bias is not None else y


def merge_linears(parts: list[LinearBase]) -> LinearBase | None:
    """One linear computing ``parts`` side by side (outputs concatenated in order), for linears
    of the same input: one GEMM (and one activation quantisation) instead of ``len(parts)``.

    Call after loading: the merged weight, scales and bias are new tensors, and each part's
    own parameters become views into them (no second copy; the parts still compute what they
    did). The merged linear is this rank's: replicated parts and column-parallel ones (this
    rank's output rows, which need no reduction) can be merged. Returns None when the parts
    cannot be merged: any is row-parallel (its partial sums need an all-reduce), their inputs,
    dtypes or FP8 blocks differ, or an FP8 part other than the last does not end on a block
    boundary (its scale rows would straddle two parts)."""
    first = parts[0]
    same = all(
        p.shard_dim in (None, 0) and p.in_features == first.in_features and p.quantized == first.quantized
        and p.weight.dtype == first.weight.dtype and p.block == first.block and len(p.output_sizes) == 1
        for p in parts
    )  # fmt: skip
    if not same or (first.quantized and any(p.out_features % first.block[0] for p in parts[:-1])):
        return None
    with torch.device("meta"):  # the tensors below replace what the constructor would allocate
        merged = LinearBase(first.in_features, [p.out_features for p in parts], dtype=first.weight.dtype)
    merged.block = first.block
    merged.quantized = first.quantized
    merged.weight = nn.Parameter(torch.cat([p.weight.data for p in parts]), requires_grad=False)
    merged.weight_scale_inv = (
        nn.Parameter(torch.cat([p.weight_scale_inv.data for p in parts]), requires_grad=False)
        if first.quantized
        else None
    )
    bias = None
    with_bias = [p.bias for p in parts if p.bias is not None]
    if with_bias:
        like = with_bias[0]
        bias = torch.cat([p.bias.data if p.bias is not None else like.new_zeros(p.out_features) for p in parts])
    merged.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
    row, scale_row = 0, 0
    for p in parts:
        p.weight.data = merged.weight.data.narrow(0, row, p.out_features)
        if p.quantized:
            rows = p.weight_scale_inv.shape[0]
            p.weight_scale_inv.data = merged.weight_scale_inv.data.narrow(0, scale_row, rows)
            scale_row += rows
        if p.bias is not None:
            p.bias.data = merged.bias.data.narrow(0, row, p.out_features)
        row += p.out_features
    return merged


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks: rank ``r`` holds rows
    ``[r·V/tp, (r+1)·V/tp)``; a token of another rank's range looks up zeros here, and the
    all-reduce sums the one real row in. ``weight`` keeps the checkpoint name."""

    shard_dim = 0

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = get_parallel_state()
        self.num_embeddings = num_embeddings
        local = self.tp.split(num_embeddings, "vocab_size")
        self.vocab_start = self.tp.tp_rank * local
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return tp_all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0))

    def shard(self, kind: str) -> Shard | None:
        return Shard(0, self.tp.tp_rank, self.tp.tp_size) if self.tp.tp_size > 1 else None

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.weight.shape[1]}, rows {self.vocab_start}+{self.weight.shape[0]}"
        )


class ParallelLMHead(nn.Module):
    """LM head with the vocabulary split like :class:`VocabParallelEmbedding` (so it can share
    its weight). ``forward`` returns fp32 logits ``[N, V]`` on rank 0 (gathered from every
    rank's ``[N, V/tp]``) and None on the other ranks."""

    shard_dim = 0

    def __init__(self, hidden: int, vocab_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = get_parallel_state()
        local = self.tp.split(vocab_size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(local, hidden, dtype=dtype), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.tp.tp_size == 1:
            return F.linear(hidden, self.weight).float()
        logits = tp_gather_last_dim(F.linear(hidden, self.weight))
        return logits.float() if logits is not None else None

    def shard(self, kind: str) -> Shard | None:
        return Shard(0, self.tp.tp_rank, self.tp.tp_size) if self.tp.tp_size > 1 else None


def check_fp8_shards(name: str, module: LinearBase) -> None:
    """Raise :class:`ShardingError` naming ``name``'s weight when this rank's FP8 shard does not
    start and end on block boundaries (its scales could not be split with it)."""
    if not module.quantized or module.shard(kind="weight") is None:
        return
    tp: ParallelState = module.tp
    b = module.block[module.shard_dim]
    if module.shard_dim == 0:
        base = name.rsplit(".", 1)[0] if len(module.output_sizes) == 2 else None
        names = [f"{base}.{p}.weight" for p in ("gate_proj", "up_proj")] if base else [f"{name}.weight"]
        checks = list(zip(names, module.output_sizes))
    else:
        checks = [(f"{name}.weight", module.in_features)]
    for tensor, local in checks:
        if local % b:
            axis = "rows" if module.shard_dim == 0 else "columns"
            raise ShardingError(
                f"FP8 tensor {tensor!r}: --tp-size {tp.tp_size} gives each rank {local} {axis}, not a multiple of "
                f"the {b}-wide FP8 block, so its weight_scale_inv blocks cannot be split with it. Use a TP size "
                f"that splits the {axis} on {b}-{axis[:-1]} block boundaries."
            )
