"""Train the demo model: a small GLM-5-architecture (``glm_moe_dsa``) model that answers the
generated arithmetic word problems, saved as a Hugging Face checkpoint folder.

The model is breakgraph's own :class:`~breakgraph.models.glm5.DsaForCausalLM`. Its inference
forward runs on a paged KV cache through in-place breaks, so training uses
:func:`train_forward`: the same modules and weights (linears, norms, RoPE tables, router,
expert tensors), the same math (absorbed MLA; indexer scores ``Σ_h w·ReLU(q·k)``; causal top-k;
sigmoid routing with the correction bias for selection only), with attention computed densely
over padded ``[B, S]`` batches under the top-k mask. ``tests/test_demo_train.py`` checks it
against :meth:`breakgraph.Engine.prompt_logits`.

Recipe (DSA-style indexer training):

- Stage 1, the first ``dense_frac`` of the run: dense causal attention. Every indexer learns by
  ``KL(p ‖ softmax(I))``, ``p`` = the attention of the layers that use it (its own layer and
  the following "shared" layers), summed over heads and normalised. The indexer's inputs are
  detached, so it learns only from that KL and the LM loss never flows into it.
- Stage 2: sparse attention over the indexer's top-``index_topk`` keys; the KL is taken over the
  selected keys only.
- Language-model loss on the answer tokens (and the end-of-text token) only.
- MoE load balance: no auxiliary loss; after each step every router's
  ``e_score_correction_bias`` moves by ``±bias_update_rate`` towards equal expert load
  (DeepSeek-V3's auxiliary-loss-free balancing). Gradients reach the router through the
  (unbiased) routing weights of the chosen experts.

A further stage of training (``--init-from FOLDER``) starts from a saved checkpoint's weights,
tokenizer and shape with a fresh optimizer and lr schedule, in stage 2 from its first step; with
another ``--seed`` it trains on problems the earlier stage did not generate. Chained stages keep
each run short (a GPU lease) while the model trains for their sum.

Run (prints progress lines and ends with the accuracy on the held-out template and phrasing
splits, the example prompts, and the annotation accuracy; see :mod:`breakgraph.demo.evaluate`)::

    python -m breakgraph.demo.train --out OUT --device cuda
"""

from __future__ import annotations

import argparse
import json
import math
import time
from array import array
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from breakgraph.demo.evaluate import evaluate, evaluate_splits
from breakgraph.demo.mixture import DEFAULT_SHARES, GSM8K_TRAIN, make_mixture
from breakgraph.demo.problems import Problem, format_example, format_prompt
from breakgraph.demo.tokenizer import EOS, PAD, build_corpus, save_tokenizer, train_tokenizer
from breakgraph.demo.train_step import GraphedSteps, TrainStep
from breakgraph.kernels.moe import route_ref
from breakgraph.kernels.rope import rope
from breakgraph.layers.linear import LinearBase
from breakgraph.layers.mlp import Experts, MoE
from breakgraph.models.config import ModelConfig
from breakgraph.models.glm5 import DsaForCausalLM
from breakgraph.models.loader import load_checkpoint

#: Share of a run from scratch in stage 1 (dense attention, the indexer fitted to it).
DENSE_FRAC = 0.2

# The shipped model's shape (HF config.json fields); vocab and special ids come from the tokenizer.
DEMO_SHAPE: dict = {
    "hidden_size": 320, "intermediate_size": 640, "moe_intermediate_size": 192, "num_hidden_layers": 6,
    "num_attention_heads": 8, "num_key_value_heads": 8, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "kv_lora_rank": 64, "q_lora_rank": 160, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
    "v_head_dim": 32, "index_n_heads": 8, "index_head_dim": 32, "index_topk": 16, "first_k_dense_replace": 1,
    "max_position_embeddings": 512, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}  # fmt: skip


def alternating_indexer_types(num_layers: int) -> list[str]:
    """GLM-5.2 style: even layers run their own indexer ("full"), odd layers reuse it ("shared")."""
    return ["full" if i % 2 == 0 else "shared" for i in range(num_layers)]


def model_config_dict(
    vocab_size: int, eos_id: int, pad_id: int, dtype: str = "bfloat16", **overrides
) -> dict:
    """The complete HF ``config.json`` of a demo model (every field transformers writes)."""
    from transformers import GlmMoeDsaConfig

    shape = {**DEMO_SHAPE, **overrides}
    shape.setdefault("indexer_types", alternating_indexer_types(shape["num_hidden_layers"]))
    hf = GlmMoeDsaConfig(
        vocab_size=vocab_size, bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id, **shape
    ).to_dict()
    hf.update(
        architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", torch_dtype=dtype, dtype=dtype
    )
    hf.pop("transformers_version", None)
    return dict(sorted(hf.items()))


# ---------------------------------------------------------------------------------------------
# The model and its differentiable training forward


def new_model(
    config: ModelConfig, seed: int, device: torch.device | str = "cpu", std: float = 0.02
) -> DsaForCausalLM:
    """An fp32 :class:`DsaForCausalLM` with seeded random weights, trainable (``requires_grad``)
    except the router correction biases, which the balance update owns."""
    torch.manual_seed(seed)
    model = DsaForCausalLM(config, torch.float32, max_positions=config.max_position_embeddings)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("e_score_correction_bias", ".bias")):
                p.zero_()
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)
            p.requires_grad_(not name.endswith("e_score_correction_bias"))
    return model.to(device)


@dataclass
class _IndexGroup:
    """One indexer and the layers that use its top-k: its scores ``logits [B, S, S]`` (fp32,
    differentiable in the indexer weights only), the keys attention may use ``allowed [B, S, S]``,
    and ``target``, the detached attention probabilities summed over heads and layers."""

    logits: torch.Tensor
    allowed: torch.Tensor
    target: torch.Tensor | None = None


@dataclass
class TrainOutput:
    """``logits [B, S, V]`` fp32; ``index_kl`` (scalar, summed over indexers, mean over real
    query tokens); ``expert_load`` ``[moe_layers, E]`` tokens routed to each expert;
    ``index_scores``: each indexer's detached scores ``[B, S, S]`` (for diagnostics)."""

    logits: torch.Tensor
    index_kl: torch.Tensor
    expert_load: torch.Tensor | None
    index_scores: list[torch.Tensor] = field(default_factory=list)


def _no_autocast(device_type: str):
    return torch.autocast(device_type, enabled=False)


def indexer_logits(
    indexer, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_proj: torch.Tensor | None = None, q_proj: torch.Tensor | None = None,
) -> torch.Tensor:
    """Index scores ``I[b, s, t] = Σ_h w[b,s,h] · ReLU(Di^-0.5 · q[b,s,h] · k[b,t])`` in fp32,
    as :func:`breakgraph.kernels.indexer.indexer_topk_ref` computes them (before masking).
    ``k_proj``, ``q_proj``: ``wk(x)`` and ``wq_b(q_resid)`` of a loaded model whose ``wk`` and
    ``wq_b`` were merged into the attention's projections (then they are None here)."""
    b, s, _ = x.shape
    q = indexer.wq_b(q_resid) if indexer.wq_b is not None else q_proj
    q = indexer._rope(q.reshape(b, s, indexer.n_heads, indexer.head_dim), cos, sin)
    k = indexer._rope(indexer.k_norm(indexer.wk(x) if indexer.wk is not None else k_proj), cos, sin)
    with _no_autocast(x.device.type):
        weights = indexer.weights_proj(x.float()) * indexer.n_heads**-0.5
        dots = torch.einsum("bshd,btd->bsht", q.float(), k.float()) * indexer.head_dim**-0.5
        return torch.einsum("bsh,bsht->bst", weights, dots.relu())


def topk_allowed(logits: torch.Tensor, causal: torch.Tensor, k: int) -> torch.Tensor:
    """Keys each query attends to: the causal top-``k`` of ``logits`` (all causal keys when
    there are at most ``k``), as a bool mask ``[B, S, S]``."""
    s = logits.shape[-1]
    scores = logits.detach().masked_fill(~causal, float("-inf"))
    idx = scores.topk(min(k, s), dim=-1).indices
    picked = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, idx, True)
    return picked & causal


def _mla(
    attn, x: torch.Tensor, q: torch.Tensor, kv_a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    group: _IndexGroup,
) -> torch.Tensor:
    """Absorbed MLA over ``x [B, S, D]`` (``q = q_b_proj(q_resid)``, ``q_resid =
    q_a_layernorm(q_a_proj(x))``, ``kv_a = kv_a_proj_with_mqa(x)``) restricted to
    ``group.allowed``; adds this layer's attention (summed over heads, detached) to
    ``group.target``."""
    b, s, _ = x.shape
    h, dn, dr, dv, r = attn.num_heads, attn.dn, attn.dr, attn.dv, attn.rank
    q_nope, q_pe = q.reshape(b, s, h, dn + dr).split([dn, dr], dim=-1)
    c, k_pe = kv_a.split([r, dr], dim=-1)
    c = attn.kv_a_layernorm(c)
    q_pe = rope(q_pe, cos, sin, interleaved=True)
    k_pe = rope(k_pe, cos, sin, interleaved=True)
    if attn.kv_b_proj is not None:  # training: the absorbed halves are views of the trained weight
        w_kv = attn.kv_b_proj.weight.view(h, dn + dv, r)
        w_kc, w_vc = w_kv[:, :dn], w_kv[:, dn:]
    else:  # a loaded inference model keeps only the absorbed halves
        w_kc, w_vc = attn.w_kc, attn.w_vc
    q_latent = torch.einsum("bshn,hnr->bshr", q_nope, w_kc)
    # the latent and rope parts of [q_latent ‖ q_pe]·[c ‖ k_pe] as two products (no concatenation:
    # torch.compile's backward mis-strides a slice of a concatenated buffer when the length is dynamic)
    dt = q_latent.dtype
    scores = torch.einsum("bshr,btr->bhst", q_latent, c.to(dt))
    scores = (scores + torch.einsum("bshd,btd->bhst", q_pe.to(dt), k_pe.to(dt))).float() * attn.scale
    scores = scores.masked_fill(~group.allowed[:, None], float("-inf"))
    probs = scores.softmax(dim=-1)
    target = probs.detach().sum(dim=1)
    group.target = target if group.target is None else group.target + target
    latent = torch.einsum("bhst,btr->bshr", probs.to(c.dtype), c)
    out = torch.einsum("bshr,hvr->bshv", latent, w_vc)
    return attn.o_proj(out.reshape(b, s, h * dv))


def _routed_experts_dense(
    experts: Experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Every expert on every token, combined with the routing weights (zero for unchosen
    experts). No data-dependent shapes, so no host syncs: the GPU path."""
    gate, up = torch.einsum("nd,efd->enf", x, experts.w13).chunk(2, dim=-1)
    y = torch.einsum("eni,edi->end", F.silu(gate) * up, experts.w2)
    combine = torch.zeros(x.shape[0], experts.w13.shape[0], dtype=weights.dtype, device=x.device)
    combine = combine.scatter(1, ids, weights)
    return torch.einsum("ne,end->nd", combine.to(y.dtype), y)


def _routed_experts_loop(
    experts: Experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Each expert on the tokens routed to it (a host sync per expert; the fast CPU path)."""
    out = None
    for e in range(experts.w13.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[tok], experts.w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, experts.w2[e]) * weights[tok, slot, None].to(gate.dtype)
        out = torch.zeros(x.shape[0], y.shape[1], dtype=y.dtype, device=x.device) if out is None else out
        out = out.index_add(0, tok, y)
    return out


def _moe(moe: MoE, x: torch.Tensor, valid: torch.Tensor, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE block on ``x [B, S, D]``; returns the output and the per-expert load over ``valid`` tokens."""
    b, s, d = x.shape
    flat = x.reshape(b * s, d)
    c = moe.gate.config
    with _no_autocast(x.device.type):
        logits = F.linear(flat.float(), moe.gate.weight)
        weights, ids = route_ref(
            logits, moe.gate.e_score_correction_bias, c.num_experts_per_tok, c.n_group, c.topk_group,
            c.norm_topk_prob, c.routed_scaling_factor,
        )  # fmt: skip
    routed = (_routed_experts_dense if impl == "dense" else _routed_experts_loop)(
        moe.experts, flat, weights, ids
    )
    if moe.shared_experts is not None:
        routed = routed + moe.shared_experts(flat)
    # tokens per expert over the real tokens, counted by a scatter (one_hot checks its ids on the host)
    hits = valid.reshape(-1, 1).expand_as(ids).to(torch.float32)
    load = torch.zeros(c.n_routed_experts, dtype=torch.float32, device=x.device)
    load.index_add_(0, ids.reshape(-1), hits.reshape(-1))
    return routed.reshape(b, s, -1), load


def train_forward(
    model: DsaForCausalLM,
    input_ids: torch.Tensor,
    *,
    sparse: bool,
    valid: torch.Tensor | None = None,
    moe_impl: str = "dense",
) -> TrainOutput:
    """Differentiable forward of ``model`` on right-padded ``input_ids [B, S]`` (positions ``0..S-1``).

    ``sparse``: attention over the indexer's causal top-k (the inference math) or dense causal
    (stage 1). ``valid [B, S]`` bool marks real tokens (for the index KL and expert loads;
    default all). ``moe_impl``: ``"dense"`` (no host syncs) or ``"loop"`` (less compute).
    Padding sits after each row's real tokens, so causality keeps it out of real rows.
    """
    if moe_impl not in ("dense", "loop"):
        raise ValueError(f"moe_impl must be 'dense' or 'loop', got {moe_impl!r}")
    cfg = model.config
    b, s = input_ids.shape
    dev = input_ids.device
    valid = torch.ones(b, s, dtype=torch.bool, device=dev) if valid is None else valid
    positions = torch.arange(s, device=dev)
    causal = torch.ones(s, s, dtype=torch.bool, device=dev).tril()
    h = model.model.embed_tokens(input_ids)
    cos, sin = model.model.rotary.lookup(positions, h.dtype)
    cos, sin = cos[None], sin[None]  # [1, S, d/2]: broadcast over the batch dim
    groups: list[_IndexGroup] = []
    loads = []
    for layer in model.model.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q_a, k_proj, kv_a = attn.a_projections(x)
        q_resid = attn.q_a_layernorm(q_a)
        q, q_idx = attn.b_projections(q_resid, None)
        if attn.indexer is not None:
            # The indexer sees detached inputs: it learns only from its KL loss.
            logits = indexer_logits(
                attn.indexer, x.detach(), q_resid.detach(), cos, sin, k_proj.detach(),
                None if q_idx is None else q_idx.detach(),
            )  # fmt: skip
            allowed = topk_allowed(logits, causal, cfg.index_topk) if sparse else causal.expand(b, s, s)
            groups.append(_IndexGroup(logits, allowed))
        elif not groups:
            raise ValueError("the first layer must run its own indexer ('full')")
        h = h + _mla(attn, x, q, kv_a, cos, sin, groups[-1])
        x = layer.post_attention_layernorm(h)
        if isinstance(layer.mlp, MoE):
            mlp_out, load = _moe(layer.mlp, x, valid, moe_impl)
            loads.append(load)
        else:
            mlp_out = layer.mlp(x)
        h = h + mlp_out
    h = model.model.norm(h)
    logits = F.linear(h, model.lm_head.weight).float()
    kl = sum(index_kl(g, valid) for g in groups)
    scores = [g.logits.detach() for g in groups]
    return TrainOutput(logits, kl, torch.stack(loads) if loads else None, scores)


def index_kl(group: _IndexGroup, valid: torch.Tensor) -> torch.Tensor:
    """``KL(p ‖ softmax(I))`` over each query's allowed keys, mean over ``valid`` queries."""
    p = group.target / group.target.sum(dim=-1, keepdim=True)
    log_q = group.logits.masked_fill(~group.allowed, float("-inf")).log_softmax(dim=-1)
    log_q = log_q.masked_fill(~group.allowed, 0.0)
    kl = (torch.xlogy(p, p) - p * log_q).sum(dim=-1)
    w = valid.to(kl.dtype)
    return (kl * w).sum() / w.sum().clamp(min=1.0)


# ---------------------------------------------------------------------------------------------
# Data


def training_losses(
    model: DsaForCausalLM,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    *,
    sparse: bool,
    moe_impl: str,
    index_kl_weight: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One training step's forward: ``(loss, lm, index_kl, expert_load)`` for right-padded
    ``input_ids [B, S]``, ``labels [B, S]`` (``-100``: no loss) and ``valid [B, S]``, where
    ``loss = lm + index_kl_weight · index_kl`` (:func:`train_forward` says what each is). The
    function ``--compile`` hands to ``torch.compile``."""
    out = train_forward(model, input_ids, sparse=sparse, valid=valid, moe_impl=moe_impl)
    lm = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    return lm + index_kl_weight * out.index_kl, lm, out.index_kl, out.expert_load


@dataclass
class EncodedProblems:
    """Tokenised examples, right-padded: ``tokens [N, L]`` int32, ``lengths [N]`` (with the
    end-of-text token), ``answer_start [N]`` (index of the first answer token)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    answer_start: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids [B, S], labels [B, S], valid [B, S])`` on the CPU, trimmed to the
        longest row; labels are ``-100`` except on answer tokens (next-token targets)."""
        s = int(self.lengths[idx].max())
        ids = self.tokens[idx, :s].long()
        col = torch.arange(s)[None]
        lengths, start = self.lengths[idx, None], self.answer_start[idx, None]
        valid = col < lengths
        targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        labels = torch.where((col >= start - 1) & (col < lengths - 1), targets, torch.full_like(ids, -100))
        return ids, labels, valid


def encode_problems(tok, problems: list[Problem], check: int = 2000, chunk: int = 10000) -> EncodedProblems:
    """Encode ``format_example(p)`` + end-of-text. The answer starts at the first token that
    begins at or past the prompt's last character; for the first ``check`` problems the prompt
    is also encoded alone to confirm its tokens are a prefix of the example's (training sees
    exactly the tokens the zero-shot prompt gives). Works in chunks so the tokenizer's per-text
    objects stay few; the ids gather in one int32 buffer (not a Python list of ints)."""
    eos, pad = tok.token_to_id(EOS), tok.token_to_id(PAD)
    flat = array("i")  # every example's ids and its end-of-text, one after another
    lengths: list[int] = []
    starts: list[int] = []
    for c0 in range(0, len(problems), chunk):
        part = problems[c0 : c0 + chunk]
        full = tok.encode_batch([format_example(p) for p in part])
        n_check = max(0, min(check - c0, len(part)))
        prompts = tok.encode_batch([format_prompt(p.question) for p in part[:n_check]])
        for i, (p, f) in enumerate(zip(part, full)):
            n_prompt = len(format_prompt(p.question))
            start = f.char_to_token(n_prompt)  # the token holding the answer's first character
            if start is None:
                raise ValueError(f"the example of {p.question!r} has no token at its answer's first character")
            if f.token_to_chars(start)[0] < n_prompt:  # a token across the boundary belongs to the prompt
                start += 1
            ids = f.ids
            if i < n_check and ids[:start] != prompts[i].ids:
                raise ValueError(f"the prompt of {p.question!r} does not tokenise as a prefix of its example")
            flat.extend(ids)
            flat.append(eos)
            lengths.append(len(ids) + 1)
            starts.append(start)
        del full, prompts
    row_lengths = torch.tensor(lengths)
    tokens = torch.full((len(lengths), int(row_lengths.max())), pad, dtype=torch.int32)
    tokens[torch.arange(tokens.shape[1]) < row_lengths[:, None]] = torch.frombuffer(flat, dtype=torch.int32)  # row-major
    return EncodedProblems(tokens, row_lengths, torch.tensor(starts))


def length_grouped_order(
    lengths: torch.Tensor, batch_size: int, gen: torch.Generator, group: int = 32
) -> torch.Tensor:
    """A random permutation of ``range(len(lengths))`` whose consecutive runs of ``batch_size``
    hold rows of similar length, so that a batch pads little: shuffle, sort each chunk of
    ``group`` batches by length, then shuffle the batches."""
    perm = torch.randperm(len(lengths), generator=gen)
    chunk = batch_size * group
    order = torch.cat([perm[c : c + chunk][torch.argsort(lengths[perm[c : c + chunk]], stable=True)]
                       for c in range(0, len(perm), chunk)])  # fmt: skip
    n = len(order) // batch_size
    batches = order[: n * batch_size].view(n, batch_size)[torch.randperm(n, generator=gen)]
    return torch.cat([batches.reshape(-1), order[n * batch_size :]])


# ---------------------------------------------------------------------------------------------
# Checkpoint export and evaluation

_FP32_TENSORS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")


def export_state_dict(model: DsaForCausalLM, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The model's weights under HF checkpoint names: merged gate‖up linears split into
    ``gate_proj``/``up_proj``, stacked experts split into ``experts.{e}.{gate,up,down}_proj``,
    ``kv_b_proj`` whole. Router weight/bias and the indexer head weights stay fp32 (as in
    GLM-5 checkpoints); everything else is cast to ``dtype``."""
    out: dict[str, torch.Tensor] = {}
    covered: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            parts = ["gate_proj", "up_proj"] if len(module.output_sizes) == 2 else [None]
            base = name.rsplit(".", 1)[0]
            for pname, w in zip(parts, module.weight.split(module.output_sizes, dim=0)):
                out[f"{base}.{pname}.weight" if pname else f"{name}.weight"] = w
            if module.bias is not None:
                out[f"{name}.bias"] = module.bias
            covered.update(f"{name}.{k}" for k in ("weight", "bias"))
        elif isinstance(module, Experts):
            i = module.intermediate
            for e in range(module.w13.shape[0]):
                out[f"{name}.{e}.gate_proj.weight"] = module.w13[e, :i]
                out[f"{name}.{e}.up_proj.weight"] = module.w13[e, i:]
                out[f"{name}.{e}.down_proj.weight"] = module.w2[e]
            covered.update(f"{name}.{k}" for k in ("w13", "w2"))
    for name, p in model.named_parameters():
        if name not in covered:
            out[name] = p
    result = {}
    for name, t in out.items():
        keep = name.endswith(_FP32_TENSORS)
        result[name] = t.detach().to("cpu", torch.float32 if keep else dtype).contiguous()
    required, _ = model.checkpoint_targets()
    if set(result) != set(required):
        raise RuntimeError(
            f"export names differ from the loader's: missing {sorted(set(required) - set(result))[:5]}, "
            f"extra {sorted(set(result) - set(required))[:5]}"
        )
    return result


def save_checkpoint(
    model: DsaForCausalLM, config_dict: dict, tok, folder: Path, dtype: str = "bfloat16"
) -> Path:
    """Write ``config.json``, ``generation_config.json``, ``model.safetensors`` and the tokenizer
    (unless ``tok`` is None) into ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    save_file(
        export_state_dict(model, torch_dtype), str(folder / "model.safetensors"), metadata={"format": "pt"}
    )
    cfg = {**config_dict, "torch_dtype": dtype, "dtype": dtype}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": None, "eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"],
           "do_sample": False, "max_new_tokens": 128}  # fmt: skip
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tok is not None:
        save_tokenizer(tok, folder, model_max_length=cfg["max_position_embeddings"])
    return folder


# ---------------------------------------------------------------------------------------------
# Training


@dataclass
class TrainArgs:
    """Hyper-parameters of :func:`train_demo` (see ``--help`` for each)."""

    steps: int = 6000
    batch_size: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dense_frac: float | None = None  # None: DENSE_FRAC, or 0 with init_from (the indexer is trained)
    time_budget: float | None = None
    deadline: float | None = None  # seconds from the start by which the loop ends (shortens time_budget)
    index_kl_weight: float = 1.0
    bias_update_rate: float = 1e-3
    train_problems: int = 300_000
    mixture: dict = field(default_factory=lambda: dict(DEFAULT_SHARES))
    val_problems: int = 200
    vocab_size: int = 2048
    tokenizer_problems: int = 20000
    tokenizer_gsm8k: bool = True
    data_workers: int = 1
    moe_impl: str | None = None  # default: "dense" on CUDA, "loop" on CPU
    amp: bool | None = None  # default: bf16 autocast on CUDA
    compile: bool = False  # the step's forward and loss through torch.compile
    graphs: bool = False  # the step replayed from a graph per (padded length, stage)
    log_every: int = 50
    eval_every: int = 0
    eval_device: str | None = None
    final_eval_device: str = "cpu"
    test_problems: int = 200
    threads: int | None = None
    save_dtype: str = "bfloat16"
    save_every: int = 0
    resume: bool = False
    shape: dict = field(default_factory=dict)
    init_from: str | None = None  # a checkpoint folder: start from its tokenizer, shape and weights


def tokenizer_shares(mixture: dict[str, float]) -> dict[str, float]:
    """The shares of :func:`~breakgraph.demo.tokenizer.build_corpus`'s generated problems for a
    training ``mixture``: the mixture's shares of ``choices`` and ``fillers`` problems, and the
    rest split as before (15% worded, 30% phrased, 35% varied, the remainder templates), so the
    merges are learnt on text like the training text (fillers included)."""
    total = sum(mixture.values()) or 1.0
    choices, filled = mixture.get("choices", 0.0) / total, mixture.get("fillers", 0.0) / total
    rest = 1.0 - choices - filled
    return {"worded_share": 0.15 * rest, "phrased_share": 0.3 * rest, "varied_share": 0.35 * rest,
            "choices_share": choices, "filled_share": filled}  # fmt: skip


def _progress(step: int, elapsed: float, a: TrainArgs) -> float:
    """How far the run is, 0 → 1: by steps, or by wall time when that is further along."""
    p = step / a.steps
    if a.time_budget:
        p = max(p, elapsed / a.time_budget)
    return min(p, 1.0)


def _lr_factor(step: int, progress: float, a: TrainArgs) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine to ``min_lr_ratio`` over the progress."""
    warm = min(1.0, (step + 1) / max(1, a.warmup_steps))
    w0 = min(a.warmup_steps / a.steps, 0.5)
    t = max(0.0, progress - w0) / (1 - w0)
    return warm * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _param_groups(model: DsaForCausalLM, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _log(msg: str) -> None:
    print(msg, flush=True)


def _eval_on(out_dir: Path, val_set: list[Problem], a: TrainArgs, device: str, dtype: str) -> tuple[dict, object]:
    val = evaluate(out_dir, val_set, device, dtype=dtype)
    _log(f"val accuracy (training mixture) {val.accuracy:.3f} ({val.correct}/{val.total}) | {val.seconds:.0f}s")
    return evaluate_splits(out_dir, device=device, n_templates=a.test_problems, log=_log, dtype=dtype), val


def _final_eval(out_dir: Path, val_set: list[Problem], a: TrainArgs) -> tuple[dict, object]:
    """Validation and held-out accuracy on ``a.final_eval_device`` (fp32 on a CPU, bf16 on a GPU);
    if the GPU run fails, the CPU runs it instead, so a finished training run always reports."""
    if a.final_eval_device != "cpu":
        try:
            return _eval_on(out_dir, val_set, a, a.final_eval_device, "bfloat16")
        except Exception as exc:  # noqa: BLE001 - fall back to the CPU rather than lose the report
            _log(f"final eval on {a.final_eval_device} failed ({type(exc).__name__}: {exc}); evaluating on the CPU")
    return _eval_on(out_dir, val_set, a, "cpu", "float32")


def _start_checkpoint(folder: Path, shape: dict) -> tuple[Tokenizer, dict]:
    """The tokenizer and complete ``config.json`` of the checkpoint ``--init-from`` names; its
    shape is fixed, so ``shape`` overrides are refused."""
    if shape:
        raise ValueError(
            f"--shape {shape} cannot be combined with --init-from {folder}: the shape is the checkpoint's"
        )
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"--init-from {folder}: no {name} there")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    cfg_dict = json.loads((folder / "config.json").read_text())
    want = (cfg_dict.get("vocab_size"), cfg_dict.get("eos_token_id"), cfg_dict.get("pad_token_id"))
    got = (tok.get_vocab_size(), tok.token_to_id(EOS), tok.token_to_id(PAD))
    if got != want:
        raise ValueError(
            f"--init-from {folder}: tokenizer.json (vocab, {EOS}, {PAD}) = {got} does not match config.json's "
            f"(vocab_size, eos_token_id, pad_token_id) = {want}"
        )
    return tok, cfg_dict


def train_demo(
    out_dir: str | Path,
    seed: int = 0,
    steps: int = 6000,
    device: str = "cpu",
    *,
    args: TrainArgs | None = None,
    final_eval: bool = True,
) -> dict:
    """Train the demo model and save it to ``out_dir`` (an HF checkpoint folder).

    Seeded: the data, tokenizer, initial weights and batch order depend only on ``seed``
    (CPU runs are bit-reproducible for a fixed thread count; CUDA up to kernel nondeterminism).
    Returns a summary dict (final losses, timings, accuracies), also written to
    ``out_dir/training.json``.
    """
    a = args or TrainArgs()
    a.steps = steps
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if a.threads:
        torch.set_num_threads(a.threads)
    moe_impl = a.moe_impl or ("dense" if cuda else "loop")
    if a.graphs and (a.compile or moe_impl != "dense"):
        raise ValueError("--graphs takes the eager, dense-MoE step: not with --compile or --moe-impl loop "
                         f"(got compile={a.compile}, moe_impl={moe_impl!r})")  # fmt: skip
    amp = cuda if a.amp is None else a.amp
    if a.dense_frac is None:
        a.dense_frac = 0.0 if a.init_from else DENSE_FRAC
    eval_every = a.eval_every
    if cuda:
        torch.set_float32_matmul_precision("high")
    out_dir = Path(out_dir)
    t_start = time.perf_counter()

    model = None
    if a.init_from:  # loaded before the data stage, which takes minutes at full size
        if Path(a.init_from).resolve() == out_dir.resolve():
            raise ValueError(f"--init-from {a.init_from} is --out: the run would overwrite the checkpoint it starts from")
        tok, cfg_dict = _start_checkpoint(Path(a.init_from), a.shape)
        config = ModelConfig.from_dict(cfg_dict)
        model = new_model(config, seed, dev)
        load_checkpoint(model, Path(a.init_from))
        _log(f"weights ({cfg_dict.get('torch_dtype')}), tokenizer and shape from {a.init_from}; a fresh optimizer")
    problems = make_mixture(a.train_problems + a.val_problems, seed, a.mixture, workers=a.data_workers)
    val_set = problems[a.train_problems :]
    t_problems = time.perf_counter()
    if not a.init_from:
        corpus = build_corpus(
            a.tokenizer_problems, seed, GSM8K_TRAIN if a.tokenizer_gsm8k and GSM8K_TRAIN.is_file() else None,
            **tokenizer_shares(a.mixture),
        )
        tok = train_tokenizer(corpus, vocab_size=a.vocab_size)
        cfg_dict = model_config_dict(
            tok.get_vocab_size(), tok.token_to_id(EOS), tok.token_to_id(PAD), a.save_dtype, **a.shape
        )
    t_tokenizer = time.perf_counter()
    data = encode_problems(tok, problems[: a.train_problems])
    del problems  # the token tensor is all training needs
    t_encoded = time.perf_counter()
    if model is None:
        config = ModelConfig.from_dict(cfg_dict)
        model = new_model(config, seed, dev)
    n_params = sum(p.numel() for p in model.parameters())
    if a.deadline:
        left = max(a.deadline - (time.perf_counter() - t_start), 1.0)
        a.time_budget = min(a.time_budget, left) if a.time_budget else left
    budget = f" or {a.time_budget:.0f}s of training, whichever comes first" if a.time_budget else ""
    _log(
        f"data: {len(data)} train / {len(val_set)} val problems, {int(data.lengths.sum())} tokens, "
        f"max len {data.tokens.shape[1]}, vocab {tok.get_vocab_size()} ({t_encoded - t_start:.1f}s: problems "
        f"{t_problems - t_start:.1f}, tokenizer {t_tokenizer - t_problems:.1f}, encoding {t_encoded - t_tokenizer:.1f})"
    )
    _log(
        f"model: glm_moe_dsa {n_params / 1e6:.2f}M params, {config.num_hidden_layers} layers "
        f"({config.mlp_layer_types.count('sparse')} MoE x {config.n_routed_experts} experts top-"
        f"{config.num_experts_per_tok}), index_topk {config.index_topk}, indexer_types {list(config.indexer_types)}"
    )
    _log(
        f"recipe: {a.steps} steps{budget} (first {a.dense_frac:.0%} dense, then sparse), batch {a.batch_size}, "
        f"lr {a.lr} warmup {a.warmup_steps} cosine, wd {a.weight_decay}, device {dev}, "
        f"{'bf16 autocast' if amp else 'fp32'}, moe {moe_impl}, "
        f"{'compiled' if a.compile else 'graphs per length' if a.graphs else 'eager'}, "
        f"threads {torch.get_num_threads()}"
    )

    opt = torch.optim.AdamW(
        _param_groups(model, a.weight_decay),
        lr=a.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True if cuda else None,
    )
    # torch.compile traces the forward and the loss at the first step, with a dynamic sequence
    # length, and again at the switch to sparse attention
    losses = partial(training_losses, moe_impl=moe_impl, index_kl_weight=a.index_kl_weight)
    train_step = TrainStep(
        model, torch.compile(losses, dynamic=True) if a.compile else losses, amp=amp,
        bias_update_rate=a.bias_update_rate,
    )  # fmt: skip
    run_step = train_step
    if a.graphs:
        run_step = GraphedSteps(
            train_step, tok.token_to_id(PAD), max_length=config.max_position_embeddings,
            longest=int(data.lengths.max()), log=_log,
        )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    order, cursor = length_grouped_order(data.lengths, a.batch_size, gen), 0
    history: list[dict] = []
    run_loss = run_kl = None
    t_train, eval_s, tokens_seen, step, progress = time.perf_counter(), 0.0, 0, 0, 0.0
    sparse_from = None
    state_file = out_dir.parent / f"{out_dir.name}.train_state.pt"
    if a.resume and state_file.is_file():
        st = torch.load(state_file, map_location=dev, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        order, cursor, step, tokens_seen, history = (
            st["order"],
            st["cursor"],
            st["step"],
            st["tokens"],
            st["history"],
        )
        run_loss, run_kl, sparse_from = st["run_loss"], st["run_kl"], st["sparse_from"]
        t_train -= st["train_s"] + st["eval_s"]
        eval_s = st["eval_s"]
        progress = _progress(step, st["train_s"] + eval_s, a)
        _log(f"resumed from {state_file} at step {step}")

    def save_state() -> None:
        tmp = state_file.with_suffix(".tmp")
        torch.save(
            {"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "order": order,
             "cursor": cursor, "step": step, "tokens": tokens_seen, "history": history, "run_loss": run_loss,
             "run_kl": run_kl, "sparse_from": sparse_from, "train_s": elapsed, "eval_s": eval_s},
            tmp,
        )  # fmt: skip
        tmp.replace(state_file)

    while progress < 1.0:
        if cursor + a.batch_size > len(data):
            order, cursor = length_grouped_order(data.lengths, a.batch_size, gen), 0
        ids, labels, valid = data.batch(order[cursor : cursor + a.batch_size])
        cursor += a.batch_size
        tokens_seen += int(valid.sum())
        if cuda:
            ids, labels, valid = (t.pin_memory().to(dev, non_blocking=True) for t in (ids, labels, valid))
        sparse = progress >= a.dense_frac
        if sparse and sparse_from is None:
            sparse_from = step
            _log(f"step {step}: stage 2, sparse attention over the indexer's top-{config.index_topk}")
        lr = a.lr * _lr_factor(step, progress, a)
        for group in opt.param_groups:
            group["lr"] = lr
        try:  # a compile happens inside the first steps of each stage
            res = run_step(ids, labels, valid, sparse)
        except Exception as exc:  # noqa: BLE001 - a failed compile must not cost the run
            if not a.compile or train_step.losses_fn is losses:
                raise
            why = f"{type(exc).__name__}: {str(exc)[:300]}"
            _log(f"step {step}: torch.compile failed ({why}); eager steps from here")
            train_step.losses_fn = losses
            res = run_step(ids, labels, valid, sparse)
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        opt.step()
        with torch.no_grad():
            run_loss = res.lm.clone() if run_loss is None else 0.95 * run_loss + 0.05 * res.lm
            run_kl = res.index_kl.clone() if run_kl is None else 0.95 * run_kl + 0.05 * res.index_kl
        step += 1
        elapsed = time.perf_counter() - t_train - eval_s
        progress = _progress(step, elapsed + eval_s, a)
        if step % a.log_every == 0 or progress >= 1.0:
            share = ""
            if res.expert_load is not None:
                load = res.expert_load.float()
                frac = load / load.sum(-1, keepdim=True)
                share = f" | max expert share {frac.max().item():.2f}"
            rec = {"step": step, "stage": "sparse" if sparse else "dense", "lm_loss": round(run_loss.item(), 5),
                   "index_kl": round(run_kl.item(), 5), "lr": lr, "train_s": round(elapsed, 1)}  # fmt: skip
            history.append(rec)
            _log(
                f"step {step} ({progress:.0%}) | {rec['stage']} | loss {rec['lm_loss']:.4f} | index_kl "
                f"{rec['index_kl']:.4f} | lr {rec['lr']:.2e} | {step / elapsed:.2f} step/s | "
                f"{tokens_seen / elapsed / 1e3:.1f}k tok/s{share} | {elapsed:.0f}s"
            )
        if eval_every and step % eval_every == 0 and progress < 1.0:
            t_eval = time.perf_counter()
            try:
                save_checkpoint(model, cfg_dict, tok, out_dir, a.save_dtype)
                val = evaluate(out_dir, val_set, a.eval_device or device)
            except Exception as exc:  # noqa: BLE001 - a monitoring failure must not cost the run
                _log(f"eval step {step} failed ({type(exc).__name__}: {exc}); periodic evaluation is now off")
                eval_every = 0
            else:
                history.append({"step": step, "val_accuracy": val.accuracy, "train_s": round(elapsed, 1)})
                _log(
                    f"eval step {step} | val accuracy {val.accuracy:.3f} ({val.correct}/{val.total}) "
                    f"| {val.seconds:.0f}s"
                )
            eval_s += time.perf_counter() - t_eval
        if a.save_every and step % a.save_every == 0 and progress < 1.0:
            save_state()

    train_s = time.perf_counter() - t_train - eval_s
    if isinstance(run_step, GraphedSteps):
        _log(f"graphs: {len(run_step.graphs)} captured in {run_step.capture_seconds:.1f}s"
             f"{'; turned off after a failed capture' if run_step.off else ''}")  # fmt: skip
    save_checkpoint(model, cfg_dict, tok, out_dir, a.save_dtype)
    state_file.unlink(missing_ok=True)
    size_mb = sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file()) / 1e6
    summary = {
        "seed": seed, "device": str(dev), "params": n_params, "steps": step, "train_seconds": round(train_s, 1),
        "steps_per_second": round(step / train_s, 3), "final_lm_loss": history[-1]["lm_loss"] if history else None,
        "folder_mb": round(size_mb, 2), "args": asdict(a), "history": history,
    }  # fmt: skip
    _log(f"saved {out_dir} ({size_mb:.1f} MB) after {train_s:.0f}s of training")
    if final_eval:
        res, val = _final_eval(out_dir, val_set, a)
        for name, r in res.items():
            for q, text, final in r.misses()[:3] if name != "all" else ():
                _log(f"  [{name} miss] Q: {q}\n  A: {text!r} (expected {final})")
        summary.update(
            val_accuracy=val.accuracy, test_accuracy=res["templates"].accuracy,
            phrasing_accuracy=res["phrasings"].accuracy, examples_accuracy=res["examples"].accuracy,
            annotation_accuracy=res["all"].annotation_accuracy,
        )  # fmt: skip
        _log(f"total {time.perf_counter() - t_start:.0f}s")
    (out_dir / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show a flag's default unless it is unset (None/False) or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> dict:
    d = TrainArgs()
    p = argparse.ArgumentParser(
        description="Train the demo GLM-5-architecture model on generated word problems and save it as an "
        "HF checkpoint folder (loads with breakgraph.Engine and transformers).",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="training device")
    p.add_argument(
        "--seed", type=int, default=0,
        help="seed for the problems, tokenizer, initial weights and batch order (with --init-from: the problems "
        "and their order)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step")
    p.add_argument("--lr", type=float, default=d.lr, help="peak AdamW learning rate")
    p.add_argument(
        "--min-lr-ratio",
        type=float,
        default=d.min_lr_ratio,
        help="final lr as a fraction of the peak (cosine)",
    )
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear lr warm-up steps")
    p.add_argument(
        "--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay on matrices"
    )
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="gradient-norm clip")
    p.add_argument(
        "--dense-frac",
        type=float,
        default=None,
        help=f"fraction of the run in stage 1 (dense attention); default {DENSE_FRAC}, 0 with --init-from",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds for the training loop (periodic evals included); the lr schedule and the stage "
        "switch follow steps or elapsed time, whichever is further along, and training stops at the budget",
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds from the start of the run (data stage included) by which the training loop ends; "
        "shortens --time-budget when the data stage runs long",
    )
    p.add_argument(
        "--index-kl-weight", type=float, default=d.index_kl_weight, help="weight of the indexer KL loss"
    )
    p.add_argument(
        "--bias-update-rate",
        type=float,
        default=d.bias_update_rate,
        help="router correction-bias step per update (0: off)",
    )
    p.add_argument("--train-problems", type=int, default=d.train_problems, help="distinct training problems")
    p.add_argument(
        "--mixture",
        type=json.loads,
        default=d.mixture,
        help="JSON shares of the training sources (templates, wordings, phrases, varied, grammar, choices, fillers, gsm8k)",
    )
    p.add_argument(
        "--val-problems",
        type=int,
        default=d.val_problems,
        help="validation problems (disjoint from train and test)",
    )
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="BPE vocabulary size")
    p.add_argument(
        "--tokenizer-problems",
        type=int,
        default=d.tokenizer_problems,
        help="generated problems in the tokenizer corpus",
    )
    p.add_argument(
        "--no-tokenizer-gsm8k", action="store_true", help="train the tokenizer on generated problems only"
    )
    p.add_argument(
        "--data-workers", type=int, default=d.data_workers,
        help="processes generating the training problems (the problems do not depend on it)",
    )
    p.add_argument(
        "--moe-impl",
        choices=["dense", "loop"],
        default=None,
        help="routed-expert compute (default: dense on CUDA, loop on CPU)",
    )
    p.add_argument(
        "--amp", choices=["auto", "on", "off"], default="auto", help="bf16 autocast (auto: on for CUDA)"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="run each step's forward and loss through torch.compile (its backward follows): fewer, fused "
        "kernels after a compile at the first step (again at the switch to sparse attention)",
    )
    p.add_argument(
        "--graphs",
        action="store_true",
        help="replay each step's forward, backward and balance update from a graph per batch size, padded "
        "length (a multiple of 32 tokens) and stage: CUDA graphs on a GPU, where an eager step waits on the host "
        "launching ~2,200 small kernels (at 512 problems a step on an H100 it was no faster than eager: the GPU "
        "bounds a step that large); each stage's first batch is padded to the longest row so later graphs fit in its memory; on the "
        "CPU a recording stand-in (slower, for tests). Takes the dense MoE (--moe-impl dense on the CPU), not "
        "--compile",
    )
    p.add_argument("--log-every", type=int, default=d.log_every, help="steps between progress lines")
    p.add_argument(
        "--eval-every",
        type=int,
        default=d.eval_every,
        help="steps between validation-accuracy checks (0: none)",
    )
    p.add_argument("--eval-device", default=None, help="device for periodic validation (default: --device)")
    p.add_argument(
        "--final-eval-device",
        default=d.final_eval_device,
        help="device for the final accuracy: cpu runs fp32 (the accuracy gate's setting), a GPU bf16, "
        "falling back to the CPU if it fails",
    )
    p.add_argument(
        "--test-problems", type=int, default=d.test_problems, help="held-out problems for the final accuracy"
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=d.save_every,
        help="steps between training-state saves to OUT.train_state.pt (0: never)",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from OUT.train_state.pt when it exists (same flags)"
    )
    p.add_argument("--no-final-eval", action="store_true", help="skip the final val/test accuracy")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--save-dtype", choices=["bfloat16", "float32"], default=d.save_dtype, help="checkpoint weight dtype"
    )
    p.add_argument(
        "--shape",
        type=json.loads,
        default={},
        help="JSON overrides of the model shape, e.g. '{\"hidden_size\": 128}'",
    )
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start from this checkpoint folder's weights (as saved: bf16 for the shipped model), tokenizer and "
        "shape: a further stage of training with a fresh optimizer and lr schedule, sparse attention from the "
        "first step unless --dense-frac says otherwise; the tokenizer and --shape options do not apply; give "
        "a --seed the earlier stage did not use for problems drawn anew (the generators may repeat some)",
    )
    ns = p.parse_args(argv)
    args = TrainArgs(
        batch_size=ns.batch_size, lr=ns.lr, min_lr_ratio=ns.min_lr_ratio, warmup_steps=ns.warmup_steps,
        weight_decay=ns.weight_decay, grad_clip=ns.grad_clip, dense_frac=ns.dense_frac, time_budget=ns.time_budget,
        deadline=ns.deadline,
        index_kl_weight=ns.index_kl_weight, bias_update_rate=ns.bias_update_rate, train_problems=ns.train_problems,
        mixture=ns.mixture,
        val_problems=ns.val_problems, vocab_size=ns.vocab_size, tokenizer_problems=ns.tokenizer_problems,
        tokenizer_gsm8k=not ns.no_tokenizer_gsm8k, data_workers=ns.data_workers,
        moe_impl=ns.moe_impl, amp={"auto": None, "on": True, "off": False}[ns.amp], compile=ns.compile, graphs=ns.graphs,
        log_every=ns.log_every,
        eval_every=ns.eval_every, eval_device=ns.eval_device, final_eval_device=ns.final_eval_device,
        test_problems=ns.test_problems, threads=ns.threads, save_dtype=ns.save_dtype,
        save_every=ns.save_every,
        resume=ns.resume, shape=ns.shape, init_from=str(ns.init_from) if ns.init_from else None,
    )  # fmt: skip
    return train_demo(ns.out, ns.seed, ns.steps, ns.device, args=args, final_eval=not ns.no_final_eval)


if __name__ == "__main__":
    main()
