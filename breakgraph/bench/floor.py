"""The physical floor of a prefill: the least time the work can take on this machine.

A forward runs three kinds of work one after another, each bounded by its own resource, so
the floor is the sum over the three of ``max(bytes ÷ bandwidth, FLOPs ÷ rate)``:

1. **GEMMs** (dense linears, MoE experts, LM head): every weight read once from HBM (the
   experts the tokens can reach) at the measured copy bandwidth, against their FLOPs — at the
   FP8 rate for FP8 weights, the bf16 rate otherwise.
2. **Latent attention**: the latent rows gathered for the tokens past ``index_topk``
   (``index_topk`` rows per token and layer, each as wide as the cache stores it: 1152 bytes
   in bf16, 656 in the FP8 latent cache, for GLM-5; below it attention is dense-causal and its keys are
   shared by neighbouring tokens) at the measured gather bandwidth for a cache of the prompt's
   size, against the score and value FLOPs in latent space over ``min(index_topk, pos + 1)``
   keys plus the absorbed ``w_kc``/``w_vc`` products (bf16).
3. **DSA indexer**: the causal score FLOPs of the tokens past ``index_topk`` (bf16, or FP8
   when the FP8 indexer is on).

Rates come from :mod:`breakgraph.bench.peaks` (measured by the bench, never typed in).
"""

from __future__ import annotations

from dataclasses import dataclass

from breakgraph.bench.peaks import Peaks


@dataclass(frozen=True)
class Floor:
    gemm_s: float
    attention_s: float
    indexer_s: float

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.attention_s + self.indexer_s


def prefill_floor(engine, input_len: int, batch_size: int, peaks: Peaks, gather_Bps: float, fp8_indexer: bool) -> Floor:
    """:class:`Floor` of one prefill of ``batch_size`` fresh prompts of ``input_len`` tokens."""
    cfg, model = engine.config, engine.model
    tokens = input_len * batch_size
    weight_bytes = 0
    flops_bf16 = flops_fp8 = 0.0
    params = dict(model.named_parameters())
    tied = not any(name.endswith("lm_head.weight") for name in params)
    for name, p in params.items():
        if "kv_b_proj" in name or (name.endswith("embed_tokens.weight") and not tied):
            continue  # absorbed into the attention (counted there); a lookup unless it is also the LM head
        if name.endswith("embed_tokens.weight"):
            name = "lm_head.weight"  # tied: read once as the LM head
        nbytes = p.numel() * p.element_size()
        fp8 = p.element_size() == 1
        gemm = 0.0
        if ".experts." in name and p.dim() == 3:
            experts_hit = min(cfg.n_routed_experts, tokens * cfg.num_experts_per_tok)
            nbytes = nbytes * experts_hit // cfg.n_routed_experts
            if "scale" not in name:
                gemm = 2 * tokens * cfg.num_experts_per_tok * p[0].numel()
        elif p.dim() == 2 and "scale" not in name and not name.endswith("norm.weight"):
            gemm = 2 * (batch_size if name == "lm_head.weight" else tokens) * p.numel()
        weight_bytes += nbytes
        if fp8:
            flops_fp8 += gemm
        else:
            flops_bf16 += gemm
    gemm_s = max(weight_bytes / peaks.copy_Bps, flops_bf16 / peaks.bf16_flops + flops_fp8 / peaks.fp8_flops)

    heads, r, dr = model.model.layers[0].self_attn.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    keys = batch_size * sum(min(cfg.index_topk, t + 1) for t in range(input_len))
    sparse_keys = batch_size * max(0, input_len - cfg.index_topk) * cfg.index_topk
    row_bytes = engine.kv_cache.latent_row_bytes_for(cfg, engine.kv_cache.latent_dtype)  # 1152 bf16, 656 FP8
    layers = cfg.num_hidden_layers
    absorbed = 2 * tokens * heads * r * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # q·w_kc and o·w_vc
    attn_flops = layers * (2 * keys * heads * (r + dr + r) + absorbed)
    attention_s = max(layers * sparse_keys * row_bytes / gather_Bps, attn_flops / peaks.bf16_flops)

    # Scores only for tokens past index_topk (below it the selection is every causal key).
    scored_keys = batch_size * sum(t + 1 for t in range(cfg.index_topk, input_len))
    indexer_layers = sum(1 for i in range(layers) if cfg.has_indexer(i))
    idx_flops = indexer_layers * 2 * scored_keys * cfg.index_n_heads * cfg.index_head_dim
    indexer_s = idx_flops / (peaks.fp8_flops if fp8_indexer else peaks.bf16_flops)
    return Floor(gemm_s, attention_s, indexer_s)
