"""MLA (absorbed form) with the DSA lightning indexer.

Per layer and token: ``q_resid = RMSNorm(q_a(x))``, ``q = q_b(q_resid)`` split into
``q_nope [H, dn]`` and ``q_pe [H, dr]``; ``[c ‖ k_pe] = kv_a(x)``, ``c = RMSNorm(c)``.
Absorbed: ``q_latent = q_nope · w_kc`` (``w_kc``/``w_vc`` are the key/value halves of
``kv_b_proj`` viewed ``[H, dn+dv, r]``), so attention is MQA of ``[q_latent ‖ q_pe]``
against the latent cache entry ``[c ‖ k_pe]`` restricted to the indexer's top-k positions;
its latent output is mapped back per head by ``w_vc`` and then ``o_proj``.

The two dynamic steps — the indexer's cache store + causal top-k, and the sparse attention
over the paged cache — are split ops (graph breaks) from :mod:`breakgraph.layers.dsa`: they
read the batch layout from the forward batch at call time and write into buffers the layer
allocates. With a plain cache of the activations' dtype the rotary kernels write the new cache
rows themselves (:func:`~breakgraph.layers.dsa.rotary_cache_store`) and the split ops are told
to skip their stores.
"""

from __future__ import annotations

import torch
from torch import nn

from breakgraph.distributed import get_parallel_state
from breakgraph.kernels.fp8 import block_dequant
from breakgraph.kernels.linear import bmm_into, exact_bf16_weight, fp32_out_operand
from breakgraph.kernels.rope import indexer_rope_qk, mla_rope_kv, rope
from breakgraph.layers.dsa import (
    MlaBmmFusionPlan,
    dsa_indexer_graph_dispatch,
    indexer_rows_are_causal,
    is_graph_dsa_split_op_surface,
    logits_head_gate,
    mla_bmm_then_unified_attention,
    prefill_mla_attention,
    prefill_mla_form,
    rotary_cache_store,
    sparse_mla_attention,
)
from breakgraph.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    ReplicatedLinear,
    RowParallelLinear,
    merge_linears,
)
from breakgraph.layers.norm import LayerNorm, RMSNorm
from breakgraph.models.config import ModelConfig


def _make_mla_bmm_fusion_plan(q_nope: torch.Tensor, q_full: torch.Tensor, rank: int) -> MlaBmmFusionPlan:
    """The plan over ``q_full [T, H, r+dr]``, whose rotary columns already hold ``rope(q_pe)``."""
    t, h, _ = q_nope.shape
    return MlaBmmFusionPlan(
        q_nope_t=q_nope.transpose(0, 1),
        q_nope_out_buf=q_full,
        q_nope_out_view=q_full[..., :rank].transpose(0, 1),
        attn_output_buf=q_nope.new_empty(t, h, rank),
    )


def _can_fuse_bmm_into_attention(w_kc: torch.Tensor) -> bool:
    """Fuse the ``q_nope · w_kc`` BMM into the attention op when a graph backend is capturing
    this body (eager runs gain nothing) and ``w_kc`` is a plain matrix (it is always
    dequantised at load; an FP8 BMM path would need its own kernel call)."""
    return is_graph_dsa_split_op_surface() and w_kc.dtype in (torch.bfloat16, torch.float16, torch.float32)


class Indexer(nn.Module):
    """DSA lightning indexer: ``Hi`` query heads from ``q_resid``, one LayerNorm'd key shared
    by all heads, ReLU-weighted head scores, causal top-k."""

    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = config.index_topk
        self.interleaved = config.indexer_rope_interleaved
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.n_heads * self.head_dim, fp8=config.fp8, dtype=dtype)
        self.wk = ReplicatedLinear(config.hidden_size, self.head_dim, fp8=config.fp8, dtype=dtype)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6, dtype=dtype)
        # Kept in fp32 (the reference keeps this projection out of low precision); its exact
        # bf16 copy, where there is one, feeds the tensor cores (prepare_bf16_gemm).
        self.weights_proj = ReplicatedLinear(config.hidden_size, self.n_heads, dtype=torch.float32)
        self.register_buffer("weights_proj_bf16", None, persistent=False)

    def prepare_bf16_gemm(self) -> bool:
        """After loading (and after any later change of ``weights_proj``): keep its exact bf16
        copy (see :func:`~breakgraph.kernels.linear.exact_bf16_weight`) as a non-persistent
        buffer that moves with the module; returns whether it is kept."""
        self.weights_proj_bf16 = exact_bf16_weight(self.weights_proj.weight)
        return self.weights_proj_bf16 is not None

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The indexer's rotation of ``x`` on its own (the training forward's batched layout)."""
        return rope(x, cos, sin, self.interleaved, self.rope_dim)

    def forward(
        self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        k_proj: torch.Tensor | None = None, q_resid_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
        q_proj: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x [T, D]``, ``q_resid [T, q_lora]`` → top-k positions ``[T, index_topk]`` int32 (not
        written where :func:`~breakgraph.layers.dsa.indexer_rows_are_causal`: the rows are then
        every causal key, which the attention makes from the positions).
        ``k_proj [T, Di]``, ``q_proj [T, Hi·Di]``: ``wk(x)`` and ``wq_b(q_resid)`` where the caller
        computed them (merged projections; then ``wk``/``wq_b`` are None; rows may be strided);
        ``q_proj`` is not read where :func:`~breakgraph.layers.dsa.indexer_rows_are_causal` (the
        caller may pass None there). ``q_resid_fp8``: ``q_resid`` quantised by its norm, for ``wq_b``."""
        t = x.shape[0]
        # a batch whose sequences are at most K tokens long selects every causal key: no queries
        # or head weights are needed, only the keys for the cache
        causal = indexer_rows_are_causal(self.topk)
        q = None
        if not causal:
            q = self.wq_b(q_resid, q_resid_fp8) if q_proj is None else q_proj
            q = q.view(t, self.n_heads, self.head_dim)
        k = self.wk(x) if k_proj is None else k_proj
        # rope(q) and rope(k_norm(k)): one kernel on CUDA
        n = self.k_norm
        store = rotary_cache_store("indexer_k", self.layer_id, k.dtype)
        q, k = indexer_rope_qk(q, k, cos, sin, n.weight, n.bias, n.eps, self.interleaved, self.rope_dim, store)
        weights = None
        if not causal:
            w_proj = fp32_out_operand(x, self.weights_proj.weight, self.weights_proj_bf16)
            weights = logits_head_gate(x, w_proj, self.n_heads**-0.5)
        topk = torch.empty(t, self.topk, dtype=torch.int32, device=x.device)
        if causal and store is not None:
            # nothing to score, write or store (the rotary kernel stored the keys): no break, and
            # the attention makes the rows from the positions without reading ``topk``
            return topk
        dsa_indexer_graph_dispatch(q, k, weights, topk, self.layer_id, self.head_dim**-0.5, store is not None)
        return topk


class MLAttention(nn.Module):
    """Multi-head latent attention, absorbed, sparse over the indexer's top-k."""

    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        tp = get_parallel_state().tp_size
        self.layer_id = layer_id
        self.num_heads = c.num_attention_heads // tp
        self.dn, self.dr, self.dv, self.rank = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        self.scale = c.softmax_scale
        bias = c.attention_bias
        self.q_a_proj = ReplicatedLinear(c.hidden_size, c.q_lora_rank, bias=bias, fp8=c.fp8, dtype=dtype)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, eps=1e-6, dtype=dtype)
        self.q_b_proj = ColumnParallelLinear(c.q_lora_rank, c.num_attention_heads * c.qk_head_dim, fp8=c.fp8, dtype=dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(c.hidden_size, c.latent_dim, bias=bias, fp8=c.fp8, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, eps=1e-6, dtype=dtype)
        self.kv_b_proj = ColumnParallelLinear(
            c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), fp8=c.fp8, dtype=dtype
        )
        self.o_proj = RowParallelLinear(c.num_attention_heads * c.v_head_dim, c.hidden_size, bias=bias, fp8=c.fp8, dtype=dtype)
        self.index_topk = c.index_topk
        self.indexer = Indexer(c, layer_id, dtype) if c.has_indexer(layer_id) else None
        # q_a ‖ indexer wk ‖ kv_a as one linear of x, and q_b ‖ indexer wq_b as one linear of
        # q_resid, made after loading (merge_a_projections, merge_b_projections)
        self.fused_a_proj: LinearBase | None = None
        self.fused_b_proj: LinearBase | None = None
        # the heads' kv_b rows regrouped: every head's key half, then every head's value half
        # (w_kc, w_vc: views), so that the MHA form projects a key's latent to both in one GEMM
        rows = self.num_heads * (self.dn + self.dv)
        self.register_buffer("w_kv", torch.empty(rows, self.rank, dtype=dtype), persistent=False)

    @property
    def w_kc(self) -> torch.Tensor:
        """``[H, dn, r]``: the key halves of the heads' ``kv_b`` rows (a view of ``w_kv``)."""
        return self.w_kv[: self.num_heads * self.dn].view(self.num_heads, self.dn, self.rank)

    @property
    def w_vc(self) -> torch.Tensor:
        """``[H, dv, r]``: the value halves of the heads' ``kv_b`` rows (a view of ``w_kv``)."""
        return self.w_kv[self.num_heads * self.dn :].view(self.num_heads, self.dv, self.rank)

    def absorb_kv_b(self) -> None:
        """Derive ``w_kc [H, dn, r]`` and ``w_vc [H, dv, r]`` (in ``w_kv``) from ``kv_b_proj``
        (after loading)."""
        p = self.kv_b_proj
        w = p.weight if not p.quantized else block_dequant(p.weight, p.weight_scale_inv, p.block, self.w_kv.dtype)
        w = w.to(self.w_kv.dtype).view(self.num_heads, self.dn + self.dv, self.rank)
        self.w_kc.copy_(w[:, : self.dn])
        self.w_vc.copy_(w[:, self.dn :])

    def merge_a_projections(self) -> bool:
        """After loading: replace ``q_a_proj``, the indexer's ``wk`` and ``kv_a_proj_with_mqa`` —
        three linears of the same input — by one (``fused_a_proj``; one GEMM and one activation
        quantisation instead of three). ``kv_a`` goes last, so an FP8 merge needs only ``q_a``
        and ``wk`` to end on block boundaries. The parts are dropped (set to None). Returns
        whether they were merged (see :func:`~breakgraph.layers.linear.merge_linears`)."""
        parts = [self.q_a_proj] + ([self.indexer.wk] if self.indexer is not None else []) + [self.kv_a_proj_with_mqa]
        merged = merge_linears(parts)
        if merged is None:
            return False
        self.fused_a_proj = merged
        self.q_a_proj = self.kv_a_proj_with_mqa = None
        if self.indexer is not None:
            self.indexer.wk = None
        return True

    def merge_b_projections(self) -> bool:
        """After loading: replace ``q_b_proj`` (this rank's heads) and the indexer's ``wq_b`` —
        two linears of ``q_resid`` — by one (``fused_b_proj``; one GEMM or GEMV instead of two,
        the activation quantised once). The parts are dropped (set to None). Returns whether
        they were merged: only a layer with its own indexer has a ``wq_b``, and the layouts must
        allow it (see :func:`~breakgraph.layers.linear.merge_linears`)."""
        if self.indexer is None:
            return False
        merged = merge_linears([self.q_b_proj, self.indexer.wq_b])
        if merged is None:
            return False
        self.fused_b_proj = merged
        merged.partial_parts = (1,)  # q_b alone: batches that need no indexer queries
        self.q_b_proj = self.indexer.wq_b = None
        return True

    def _b_proj_parts(self, indexer_queries: bool) -> tuple[LinearBase, int | None]:
        """The linear of ``q_resid`` and how many of its parts this step computes (None: all)."""
        if self.fused_b_proj is None:
            return self.q_b_proj, None
        return self.fused_b_proj, (None if indexer_queries else 1)

    def b_projections(
        self, q_resid: torch.Tensor, q_resid_fp8: tuple[torch.Tensor, torch.Tensor] | None, indexer_queries: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(q_b(q_resid) [T, H·(dn+dr)], wq_b(q_resid) [T, Hi·Di] or None)``: views of the merged
        linear's output when there is one (rows strided), else ``q_b`` alone (the indexer then
        projects its own queries). ``indexer_queries=False``: the step needs none (see
        :func:`~breakgraph.layers.dsa.indexer_rows_are_causal`), so the merged linear reads
        ``q_b``'s weight rows only and the second item is None."""
        linear, parts = self._b_proj_parts(indexer_queries)
        if linear is self.q_b_proj:
            return linear(q_resid, q_resid_fp8), None
        if parts is not None:
            return linear.forward_first(q_resid, parts, q_resid_fp8), None
        q, q_idx = linear(q_resid, q_resid_fp8).split(linear.output_sizes, dim=-1)
        return q, q_idx

    def takes_fp8_input(self, x: torch.Tensor) -> bool:
        """Whether the projections of the layer's input ``x`` read it quantised (FP8, on a path
        that quantises at ``x``'s row count; the input norm then quantises for them unless
        ``BREAKGRAPH_NORM_FP8=0``)."""
        first = self.fused_a_proj if self.fused_a_proj is not None else self.q_a_proj
        return first.takes_fp8_input(x)

    def a_projections(
        self, x: torch.Tensor, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``(q_a(x), wk(x) or None without an indexer, kv_a(x))`` for ``x [..., D]``, from the
        merged linear when there is one (the three are then views of its output). ``x_fp8``:
        ``x`` quantised by its norm."""
        if self.fused_a_proj is None:
            k_proj = self.indexer.wk(x, x_fp8) if self.indexer is not None else None
            return self.q_a_proj(x, x_fp8), k_proj, self.kv_a_proj_with_mqa(x, x_fp8)
        out = self.fused_a_proj(x, x_fp8).split(self.fused_a_proj.output_sizes, dim=-1)
        return (out[0], out[1], out[2]) if len(out) == 3 else (out[0], None, out[1])

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, prev_topk: torch.Tensor | None,
        x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, D]`` → ``(out [T, D], topk [T, K])``; ``prev_topk`` feeds "shared" layers.
        ``x_fp8``: ``x`` quantised by the input norm, for the FP8 projections of ``x``."""
        t = x.shape[0]
        q_a, k_proj, kv_a = self.a_projections(x, x_fp8)
        # every sequence within index_topk: every causal key is selected, so the indexer needs no
        # queries (indexer_rows_are_causal)
        causal = indexer_rows_are_causal(self.index_topk)
        indexer_queries = self.indexer is not None and not causal
        b_proj, b_parts = self._b_proj_parts(indexer_queries)
        q_resid, _, q_resid_fp8 = self.q_a_layernorm.forward_fp8(q_a, quantize=b_proj.takes_fp8_input(q_a, b_parts))
        q, q_idx = self.b_projections(q_resid, q_resid_fp8, indexer_queries)
        q = q.view(t, self.num_heads, self.dn + self.dr)
        q_nope = q[..., : self.dn]
        # [· ‖ rope(q_pe)] and the latent entry [norm(c) ‖ rope(k_pe)]: one kernel on CUDA
        # (with a plain cache it also writes the cache entry: rotary_cache_store)
        store = rotary_cache_store("latent", self.layer_id, kv_a.dtype)
        q_full, kv = mla_rope_kv(q, kv_a, cos, sin, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, store)
        # prefill: the whole attention in one op, straight to the per-head values; the tokens
        # below index_topk (every causal key selected) in MHA form where it pays (prefill_mla_attention)
        whole = prefill_mla_form()
        # The buffers are made before the indexer break, so the code between the indexer and
        # attention breaks stays empty (no one-kernel segment).
        out = x.new_empty(t, self.num_heads, self.dv)
        fuse = not whole and _can_fuse_bmm_into_attention(self.w_kc)
        plan = _make_mla_bmm_fusion_plan(q_nope, q_full, self.rank) if fuse else None
        topk = self.indexer(x, q_resid, cos, sin, k_proj, q_resid_fp8, q_idx) if self.indexer is not None else prev_topk
        if topk is None:
            raise ValueError(f"layer {self.layer_id} shares the indexer but no earlier layer computed top-k")
        if whole:
            prefill_mla_attention(q, q_full, kv, topk, self.w_kv, out, self.layer_id, self.scale, store is not None)
            return self.o_proj(out.view(t, self.num_heads * self.dv)), topk
        if plan is not None:
            mla_bmm_then_unified_attention(
                plan.q_nope_t, self.w_kc, plan.q_nope_out_buf, kv, topk, plan.attn_output_buf, self.layer_id, self.scale,
                store is not None,
            )  # fmt: skip
            attn = plan.attn_output_buf
        else:
            bmm_into(q_nope.transpose(0, 1), self.w_kc, q_full[..., : self.rank].transpose(0, 1))  # q_latent
            attn = torch.empty(t, self.num_heads, self.rank, dtype=x.dtype, device=x.device)
            sparse_mla_attention(q_full, kv, topk, attn, self.layer_id, self.scale, store is not None)
        bmm_into(attn.transpose(0, 1), self.w_vc.transpose(1, 2), out.transpose(0, 1))
        return self.o_proj(out.view(t, self.num_heads * self.dv)), topk
