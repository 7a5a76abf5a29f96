"""MoE routing and expert computation (plain-PyTorch twins, graph-safe: no host syncs).

Routing (DeepSeek-V3 / GLM-5): sigmoid scores; ``e_score_correction_bias`` is added for
*selection only*; optional group-limited selection (best ``topk_group`` of ``n_group``
groups by the sum of each group's two best biased scores); the weights are the unbiased
scores of the chosen experts, normalised to sum 1 (``norm_topk_prob``), × ``routed_scaling``.

Experts: tokens are sorted by expert and run through grouped GEMMs
(``torch._grouped_mm``) with static shapes ``[T·top_k, ...]``. The shared expert
(:class:`SharedExpert`, laid out like one routed expert) and the residual add can join the
routed experts' call (:func:`fused_moe`'s ``shared`` / ``residual``): decode batches then run
all of it in two kernels (:func:`takes_decode_path`), larger batches on FP8 or Triton experts
in the grouped GEMMs' launches, the shared expert as one more expert every token routes to
(:func:`folds_shared_expert`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from breakgraph.graphs import opaque_op
from breakgraph.kernels.dispatch import use_triton
from breakgraph.kernels.fp8 import FP8_DTYPE, block_dequant, fp8_block_linear_ref
from breakgraph.kernels.linear import linear


class SharedExpert(NamedTuple):
    """The always-on shared expert, laid out like one routed expert: ``w13 [2I, D]`` (gate rows,
    then up rows), ``w2 [D, I]``, and for FP8 their ``[·/128, ·/128]`` block scales."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None


def route_ref(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` fp32 → ``(topk_weights [T, k] fp32, topk_ids [T, k] int64)``."""
    scores = router_logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    num_tokens, num_experts = choice.shape
    if topk_group < n_group:
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1, sorted=False).indices
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows ``x [M, K]`` sorted by group; group ``g`` owns rows ``offsets[g-1]:offsets[g]`` and
    multiplies by ``weight[g].T`` (``weight [G, N, K]``). Returns ``[M, N]``."""
    if x.dtype == torch.bfloat16:
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    # _grouped_mm takes bf16 only (its CPU kernel accepts fp32, its shape function does not).
    # Few groups: every group's product of every row, each row keeping its own group's — G× the
    # FLOPs at matmul speed (and a [G, M, N] temporary), where copying each row's weight [N, K]
    # is memory-bound and ~16× slower at 8 groups. No host read of offsets and no shape-dependent
    # control flow: CPU-graph and torch.compile safe.
    rows = torch.arange(x.shape[0], device=x.device)
    group = torch.searchsorted(offsets, rows, right=True).clamp(max=weight.shape[0] - 1)
    if weight.shape[0] <= _EVERY_GROUP_MAX:
        return torch.matmul(x, weight.transpose(-2, -1))[group, rows]
    return torch.bmm(weight[group], x.unsqueeze(-1)).squeeze(-1)


# grouped_linear off bf16: up to this many groups, the every-group product.
_EVERY_GROUP_MAX = 32


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """Routed experts: ``Σ_k w[t,k] · W2[e] (silu(G[e] x) ⊙ U[e] x)`` for ``e = ids[t,k]``.

    Args:
        x: ``[T, D]``; w13: ``[E, 2I, D]`` (gate rows then up rows); w2: ``[E, D, I]``.
        topk_weights ``[T, k]`` fp32, topk_ids ``[T, k]`` int64.
        w13_scale / w2_scale: FP8 block scales when the weights are float8_e4m3fn.
    Returns ``[T, D]`` in ``x.dtype``.
    """
    if w13_scale is not None:
        w13 = block_dequant(w13, w13_scale, block, x.dtype)
    if w2_scale is not None:
        w2 = block_dequant(w2, w2_scale, block, x.dtype)
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    flat_ids = topk_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)
    src_token = order // top_k
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    offsets = counts.cumsum(0, dtype=torch.int32)
    gate_up = grouped_linear(x[src_token], w13, offsets)
    gate, up = gate_up.chunk(2, dim=-1)
    down = grouped_linear(F.silu(gate) * up, w2, offsets)
    down = down * topk_weights.reshape(-1)[order, None].to(down.dtype)
    out = torch.zeros_like(x)
    out.index_add_(0, src_token, down)
    return out


def shared_expert_ref(x: torch.Tensor, shared: SharedExpert, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """``W2_s (silu(G_s x) ⊙ U_s x)`` in ``x.dtype`` (FP8 weights dequantised per block), the
    twin of the shared expert's dense MLP."""
    gate_up = _linear_ref(x, shared.w13, shared.w13_scale, block)
    gate, up = gate_up.chunk(2, dim=-1)
    return _linear_ref(F.silu(gate) * up, shared.w2, shared.w2_scale, block)


def _linear_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int]) -> torch.Tensor:
    return F.linear(x, w) if scale is None else fp8_block_linear_ref(x, w, scale, block)


def route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch :func:`route_ref`'s contract to the fastest implementation available.

    CUDA fp32 logits with at most 1024 experts: one Triton kernel for the sigmoid (the bits of
    the twin's ``torch.sigmoid``, so the selection is bit-identical), bias, group-limited top-k,
    normalisation and scaling (:func:`breakgraph.kernels.triton_moe.route_select`).
    """
    num_experts = router_logits.shape[-1]
    if (
        use_triton(router_logits)
        and router_logits.dim() == 2
        and router_logits.dtype == torch.float32
        and num_experts <= 1024
        and num_experts % n_group == 0
        and 0 < topk_group <= n_group
        and 0 < top_k <= num_experts
    ):
        from breakgraph.kernels.triton_moe import route_select

        return route_select(
            router_logits, correction_bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
            logits=True,
        )  # fmt: skip
    return route_ref(
        router_logits, correction_bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
    *,
    shared: SharedExpert | None = None,
    residual: torch.Tensor | None = None,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Dispatch :func:`fused_moe_ref`'s contract (``+ shared(x)`` when ``shared`` is given,
    ``+ residual`` when given) to the fastest implementation available. ``x_fp8``: ``x``
    quantised by its producer, which the W8A8 grouped GEMMs read instead of quantising ``x``
    (:func:`grouped_takes_fp8_input`); other paths ignore it.

    CUDA, 16-bit activations: up to ``triton_moe.DECODE_MAX_TOKENS`` tokens
    (:func:`takes_decode_path`), the two decode kernels (gate/up + SiLU by routed pair and shared
    slot, then down + weighted combine + residual by token,
    :func:`breakgraph.kernels.triton_moe.fused_moe_decode`); above, FP8 block-scaled experts take
    the Triton grouped GEMMs (activations quantised to e4m3 per 128 columns, or with
    ``BREAKGRAPH_MOE_W8A8=0`` bf16 activations × fp8 weight tiles; see
    ``triton_moe.moe_fp8_activations``) and bf16 experts ``torch._grouped_mm`` on sm90/sm100, else
    the Triton grouped GEMMs (:mod:`breakgraph.kernels.triton_moe`), which take the shared expert
    and the residual into their launches where :func:`folds_shared_expert` says so (else they are
    added after). Everything else takes the twins.
    """
    if takes_decode_path(x, w13, w2, topk_ids, w13_scale, w2_scale, block, shared):
        sh = shared if shared is not None else SharedExpert(None, None)
        return _fused_moe_decode_cuda(
            x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, sh.w13, sh.w2, sh.w13_scale, sh.w2_scale,
            residual, list(block),
        )  # fmt: skip
    if use_triton(x) and _triton_moe_supported(x, w13, w2, topk_ids, w13_scale, w2_scale, block):
        xq, xs = x_fp8 if x_fp8 is not None else (None, None)
        if shared is None or folds_shared_expert(x, w13, w2, topk_ids, w13_scale, w2_scale, block, shared):
            sh = shared if shared is not None else SharedExpert(None, None)
            return _fused_moe_cuda(
                x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, sh.w13, sh.w2, sh.w13_scale, sh.w2_scale,
                residual, xq, xs, list(block),
            )  # fmt: skip
        out = _fused_moe_cuda(
            x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, None, None, None, None, None, xq, xs, list(block)
        )
        gate, up = linear(x, shared.w13, shared.w13_scale, block).chunk(2, dim=-1)
        out = out + linear(F.silu(gate) * up, shared.w2, shared.w2_scale, block)
    else:
        out = fused_moe_ref(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block)
        if shared is not None:
            out = out + shared_expert_ref(x, shared, block)
    return out if residual is None else residual + out


def decode_sized(x: torch.Tensor) -> bool:
    """Whether ``x [T, D]`` is a batch the decode kernels take by its size: CUDA, 1 to
    ``triton_moe.DECODE_MAX_TOKENS`` tokens (a static shape, so a captured graph keeps one
    choice). Never while torch.compile traces: a token-count test would specialise a trace with a
    symbolic count."""
    if torch.compiler.is_compiling() or not use_triton(x):
        return False
    from breakgraph.kernels import triton_moe

    return 0 < x.shape[0] <= triton_moe.DECODE_MAX_TOKENS


def takes_decode_path(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor | None,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    block: tuple[int, int],
    shared: SharedExpert | None = None,
) -> bool:
    """Whether :func:`fused_moe` runs these operands through the decode kernels: a batch of
    :func:`decode_sized` and the layouts both paths take (and ``shared``'s, when given)."""
    if not (decode_sized(x) and _triton_moe_supported(x, w13, w2, topk_ids, w13_scale, w2_scale, block)):
        return False
    from breakgraph.kernels import triton_moe

    return triton_moe.decode_supported(x, w13, w2, w13_scale, w2_scale, shared)


def folds_shared_expert(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor | None,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    block: tuple[int, int],
    shared: SharedExpert | None,
) -> bool:
    """Whether :func:`fused_moe` runs ``shared`` inside the routed experts' launches and adds
    ``residual`` there too: the decode kernels (:func:`takes_decode_path`), or the Triton grouped
    GEMMs (CUDA, FP8 or 16-bit experts that ``torch._grouped_mm`` does not take) with a shared
    expert laid out like one routed expert. False without a shared expert. ``topk_ids`` may be
    None before routing (its shape is then not checked)."""
    if shared is None:
        return False
    if takes_decode_path(x, w13, w2, topk_ids, w13_scale, w2_scale, block, shared):
        return True
    if not (use_triton(x) and _triton_moe_supported(x, w13, w2, topk_ids, w13_scale, w2_scale, block)):
        return False
    from breakgraph.kernels import triton_moe

    if w13_scale is None and triton_moe.grouped_mm_supported(x, w13, w2):
        return False
    return triton_moe.shared_like_routed(w13, w2, w13_scale, w2_scale, shared)


def grouped_takes_fp8_input(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    block: tuple[int, int],
) -> bool:
    """Whether :func:`fused_moe` quantises ``x`` for W8A8 grouped GEMMs (CUDA, FP8 experts,
    ``BREAKGRAPH_MOE_W8A8``, a batch above the decode kernels'): then ``x`` quantised by its
    producer (``x_fp8``) saves that launch."""
    if w13_scale is None or not (use_triton(x) and _triton_moe_supported(x, w13, w2, None, w13_scale, w2_scale, block)):
        return False
    if takes_decode_path(x, w13, w2, None, w13_scale, w2_scale, block):
        return False
    from breakgraph.kernels import triton_moe

    return triton_moe.moe_fp8_activations()


def _fused_moe_decode_shape(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None, sh13: torch.Tensor | None,
    sh2: torch.Tensor | None, sh13_scale: torch.Tensor | None, sh2_scale: torch.Tensor | None,
    residual: torch.Tensor | None, block: list[int],
) -> torch.Tensor:  # fmt: skip
    return torch.empty_like(x)


@opaque_op(name="fused_moe_decode", fake_impl=_fused_moe_decode_shape)
def _fused_moe_decode_cuda(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None, sh13: torch.Tensor | None,
    sh2: torch.Tensor | None, sh13_scale: torch.Tensor | None, sh2_scale: torch.Tensor | None,
    residual: torch.Tensor | None, block: list[int],
) -> torch.Tensor:  # fmt: skip
    from breakgraph.kernels import triton_moe

    shared = SharedExpert(sh13, sh2, sh13_scale, sh2_scale) if sh13 is not None else None
    return triton_moe.fused_moe_decode(
        x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, tuple(block), shared=shared, residual=residual
    )


def _fused_moe_shape(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None, sh13: torch.Tensor | None,
    sh2: torch.Tensor | None, sh13_scale: torch.Tensor | None, sh2_scale: torch.Tensor | None,
    residual: torch.Tensor | None, xq: torch.Tensor | None, xs: torch.Tensor | None, block: list[int],
) -> torch.Tensor:  # fmt: skip
    return torch.empty_like(x)


@opaque_op(name="fused_moe", fake_impl=_fused_moe_shape)
def _fused_moe_cuda(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None, sh13: torch.Tensor | None,
    sh2: torch.Tensor | None, sh13_scale: torch.Tensor | None, sh2_scale: torch.Tensor | None,
    residual: torch.Tensor | None, xq: torch.Tensor | None, xs: torch.Tensor | None, block: list[int],
) -> torch.Tensor:  # fmt: skip
    from breakgraph.kernels import triton_moe

    if sh13 is None and w13_scale is None and triton_moe.grouped_mm_supported(x, w13, w2):
        out = triton_moe.fused_moe_grouped_mm(x, w13, w2, topk_weights, topk_ids)
        return out if residual is None else residual + out
    shared = SharedExpert(sh13, sh2, sh13_scale, sh2_scale) if sh13 is not None else None
    return triton_moe.fused_moe_triton(
        x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, tuple(block), shared=shared, residual=residual,
        x_fp8=(xq, xs) if xq is not None else None,
    )  # fmt: skip


def _triton_moe_supported(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor | None,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    block: tuple[int, int],
) -> bool:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16) or (topk_ids is not None and topk_ids.dim() != 2):
        return False
    num_experts, two_i, d = w13.shape
    inter = two_i // 2
    if w2.shape != (num_experts, d, inter) or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        return False
    if w13_scale is None and w2_scale is None:
        return w13.dtype == x.dtype and w2.dtype == x.dtype
    return (
        w13_scale is not None
        and w2_scale is not None
        and w13.dtype == FP8_DTYPE
        and w2.dtype == FP8_DTYPE
        and tuple(block) == (128, 128)
        and inter % 128 == 0
        and w13_scale.shape == (num_experts, two_i // 128, -(-d // 128))
        and w2_scale.shape == (num_experts, -(-d // 128), inter // 128)
    )
