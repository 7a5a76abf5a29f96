"""The built-in default model used when no ``--model-path`` is given.

If the package ships trained weights (``assets/<name>/``), those are used. Otherwise a tiny
GLM-5-architecture checkpoint with seeded random weights and a byte-level BPE tokenizer is
written once to ``$BREAKGRAPH_HOME`` (default ``~/.cache/breakgraph``) — a real HF
checkpoint folder, made with transformers' ``save_pretrained``.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from breakgraph import env

logger = logging.getLogger(__name__)

ASSETS = Path(__file__).parent / "assets"
SHIPPED_NAME = "glm5-tiny-arith"
RANDOM_NAME = "glm5-tiny-random"

TINY_GLM5 = dict(
    vocab_size=2048, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, index_topk=32,
    index_head_dim=32, index_n_heads=8, first_k_dense_replace=1, max_position_embeddings=1024, n_group=1,
    topk_group=1, routed_scaling_factor=2.5, rms_norm_eps=1e-5, tie_word_embeddings=False,
    bos_token_id=None, eos_token_id=0, pad_token_id=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    indexer_types=["full", "shared", "full", "shared"],
)  # fmt: skip


# What /v1/models says about the default model (README.md, "The demo model", says the same at length).
SHIPPED_DESCRIPTION = (
    "breakgraph's built-in demo model: a tiny (about 12M parameters) model of the GLM-5 architecture "
    "(MLA, DSA sparse attention, MoE), trained from scratch only on short arithmetic word problems. "
    "It is not GLM-5 and not a chat model: it answers one grade-school word problem or sum "
    "(+ - * /, whole numbers up to 1000) prompted as 'Question: ...\nAnswer:' with worked steps "
    "and '#### N', and knows nothing else."
)
RANDOM_DESCRIPTION = (
    "breakgraph's fallback default model: a tiny GLM-5-architecture model with random weights; "
    "its output is noise. It is not GLM-5."
)


def model_description(path: str | Path) -> str | None:
    """A plain description of the model in ``path`` when it is one of the built-in default
    models (the shipped demo or the random fallback), else ``None``."""
    here = Path(path).resolve()
    if here == (ASSETS / SHIPPED_NAME).resolve():
        return SHIPPED_DESCRIPTION
    if here == (cache_home() / RANDOM_NAME).resolve():
        return RANDOM_DESCRIPTION
    return None


def cache_home() -> Path:
    return Path(env.read("BREAKGRAPH_HOME")).expanduser()


def default_model_path() -> Path:
    """Folder of the default model, creating the random fallback on first use."""
    shipped = ASSETS / SHIPPED_NAME
    if (shipped / "config.json").is_file():
        return shipped
    folder = cache_home() / RANDOM_NAME
    if not (folder / "config.json").is_file():
        make_random_checkpoint(folder)
    return folder


def make_random_checkpoint(folder: Path, seed: int = 0) -> Path:
    """Write the tiny random GLM-5 checkpoint (+ tokenizer) to ``folder`` atomically."""
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    from breakgraph.demo.tokenizer import build_corpus, save_tokenizer, train_tokenizer

    logger.info("creating the default tiny GLM-5 checkpoint in %s (first use)", folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        torch.manual_seed(seed)
        model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**TINY_GLM5)).to(torch.bfloat16)
        model.save_pretrained(tmp)
        tok = train_tokenizer(build_corpus(n_problems=2000, seed=seed), vocab_size=TINY_GLM5["vocab_size"])
        save_tokenizer(tok, tmp, model_max_length=TINY_GLM5["max_position_embeddings"])
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
