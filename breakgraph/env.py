"""Every environment variable breakgraph reads, stated once: name, default, allowed values, help.

Two kinds of reader:

* the engine's knobs (``BREAKGRAPH_TP_*``) are read once, when an
  :class:`~breakgraph.engine.config.EngineConfig` is built (they are its fields' defaults), and
  travel in the config from there on;
* the kernel, layer and graph switches sit below the engine and are read where they act, at
  call time, through :func:`read` (so a test or a debugging session can flip one between two
  calls, and code used without an engine — the kernels, the graph backends — sees them too).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Knob:
    """One environment variable: its ``default``, the values it accepts (``None``: any) and what it does."""

    default: str
    choices: tuple[str, ...] | None
    help: str


KNOBS: dict[str, Knob] = {
    "BREAKGRAPH_TP_TIMEOUT_S": Knob("1800", None, "seconds a tensor-parallel collective may wait (model loading included)"),
    "BREAKGRAPH_TP_GRACE_S": Knob("30", None, "seconds rank 0 waits on a hung CUDA collective after a rank died, then exits"),
    "BREAKGRAPH_TP_SECRET": Knob("", None, "under torchrun: the job's shared secret (hex) that signs rank 0's commands"),
    "BREAKGRAPH_KERNELS": Knob("auto", ("auto", "torch"), "torch: plain-PyTorch twins everywhere (read once, at import)"),
    "BREAKGRAPH_INDEXER_FP8": Knob("0", ("0", "1"), "1: the Triton indexer scores in FP8 (default bf16)"),
    "BREAKGRAPH_DENSE_MLA_BALANCED": Knob("auto", ("auto", "0", "1"), "dense-causal MLA: 1: the balanced split with per-key page entries (kernels/triton_dense_mla.py); 0: the chunked kernel; auto (default): balanced at pages under 64 tokens (H200, page 16: 1.19x at 8K tokens, even at 1K), chunked at 64 and up (there 1.8x faster than balanced)"),
    "BREAKGRAPH_DENSE_MHA": Knob("auto", ("auto", "0", "1"), "the prefill tokens at positions below index_topk (every causal key selected): auto (default): they attend in MHA form (each of their keys' latent projected per head, kernels/dense_mha.py) where that takes fewer FLOPs than the absorbed form (no long cached prefix), else absorbed (H100, glm5-tp8-rank-12l, bench prefill: 9.11 vs 10.86 ms at 1024 tokens, 5.66 vs 6.48 at 128); the tokens past index_topk attend in the absorbed form; 1: MHA form wherever there are such tokens; 0: absorbed form always"),
    "BREAKGRAPH_NORM_FP8": Knob("1", ("0", "1"), "0: the FP8 linears quantise their input themselves (default: the RMSNorm before them also writes the FP8 codes of its output)"),
    "BREAKGRAPH_FP8_FUSED_QUANT": Knob("1", ("0", "1"), "1 (default): the Triton W8A8 GEMM that quantises its activation tiles itself where no producer's codes come (W8A8's result, one launch fewer; kernels/triton_fp8.py) is one of the paths the start-up timing tries for each FP8 linear, up to 64 rows; 0: not tried (for comparisons: not yet timed on a GPU)"),
    "BREAKGRAPH_FP8_GEMV": Knob("1", ("0", "1"), "1 (default; H200: 1.1-1.6x over the best other path at 1-16 rows): the few-row FP8 GEMV (kernels/triton_fp8_gemv.py) is one of the paths the start-up timing tries for each FP8 linear, up to 64 rows; 0: not tried"),
    "BREAKGRAPH_FP8_TIMING_COLD": Knob("1", ("0", "1"), "1 (default): the FP8 start-up timing cycles each timed graph through copies of the weight past L2 (every call reads its weight from HBM, as a decode step does); 0: one weight, replayed (favours small-row paths whose weight stays in L2)"),
    "BREAKGRAPH_GEMV_FP32_OUT": Knob("1", ("0", "1"), "1 (default): the router's and the indexer's head-weight products (bf16 -> fp32) up to 16 rows in one Triton GEMV launch (H200: 5.2 vs 6.4 us for the indexer's at 1 row, the router's even); 0: cuBLAS (split-K GEMM, its reduction, the scaling)"),
    "BREAKGRAPH_MOE_W8A8": Knob("1", ("0", "1"), "FP8 routed experts off the decode kernels: 1 (default): activations quantised to e4m3 per 128 columns (W8A8; H200, `scripts/bench_kernels_moe.py --only compare`: faster than every W8A16 variant at 1 to 4096 tokens, 148.9 vs 175.0 us a layer's GEMMs at 16 tokens, 428.9 vs 765.2 at 1024); 0: bf16 activations x fp8 weight tiles (W8A16, closer to the bf16 twin: 1.7e-3 relative against 3.7e-2)"),
    "BREAKGRAPH_MOE_DEQUANT": Knob("product", ("scaled", "product"), "FP8 MoE decode kernels (up to 8 tokens): product (default; H200: 58.9 vs 89.5 us a layer at 1 token) puts the block scales on the activations' columns; scaled scales every weight in registers"),
    "BREAKGRAPH_PDL": Knob("auto", ("0", "1", "auto"), "programmatic dependent launch of the Triton kernels on Hopper GPUs (each launched while the one before it runs, its weights loaded before it waits; kernels/pdl.py). auto (default): the decode graphs of up to 16 rows (H200, glm5-tp8-rank, bench decode --pdl auto 0: 8.03 vs 9.02 ms a step at batch 1, 22.00 vs 22.36 at 16) and prefills of up to 128 tokens on the prefill graphs, their graphs and breaks (37.01 vs 38.38 ms at 128 tokens); 1: every decode step and prefill too (2.3% slower at batch 64, a 1024-token prefill not faster); 0: plain stream order"),
    "BREAKGRAPH_PREFILL_LENGTH_BOUNDS": Knob("1", ("0", "1"), "1 (default): breakable prefill graphs capture each bucket once more per prefill length bound of the model below the context length (GLM-5: index_topk), for batches whose sequences are that short (no indexer queries or head weights in them; twice the prefill graphs to capture at start-up); 0: one graph per bucket, which computes them unless the context length itself is at most index_topk (eager prefill skips them wherever the batch allows)"),
    "BREAKGRAPH_GRAPH_DEBUG": Knob("0", None, "1: replay every captured graph against an eager run and name the first mismatch"),
    "BREAKGRAPH_COMPILE_AHEAD": Knob("0", ("0", "fp8", "1"), "1: at start-up, the Triton kernels the FP8 GEMM timing and the graph ladders launch are compiled first in parallel worker processes (each ladder run once dry over all its buckets, its kernels compiled in one batch and loaded, so captures need no warm-up beyond the first); fp8: for the FP8 timing only; 0 (default; an H200 cold start with 1 took 171.9 s, the launchers loading one after another): each at its first launch"),
    "BREAKGRAPH_CACHE_DIR": Knob("", None, "where start-up measurements (the FP8 GEMM choice) are kept; default $XDG_CACHE_HOME/breakgraph or ~/.cache/breakgraph; off: none (safe to delete)"),
    "BREAKGRAPH_HOME": Knob("~/.cache/breakgraph", None, "where the built-in default model is written"),
}  # fmt: skip


def read(name: str) -> str:
    """The value of knob ``name`` (its default when unset). Raises ``ValueError`` naming the
    variable when the value is not one it accepts, and ``KeyError`` for a name not in :data:`KNOBS`."""
    knob = KNOBS[name]
    value = os.environ.get(name, knob.default)
    if knob.choices is not None and value not in knob.choices:
        raise ValueError(f"{name} must be one of {', '.join(knob.choices)}, got {value!r}")
    return value


def describe() -> str:
    """One line per knob, ``NAME (default D; one of A, B): help``, for ``breakgraph --help``."""
    lines = []
    for name, knob in KNOBS.items():
        default = f"default {knob.default!r}" if knob.default else "unset by default"
        choices = f"; one of {', '.join(knob.choices)}" if knob.choices else ""
        lines.append(f"  {name} ({default}{choices}): {knob.help}")
    return "\n".join(lines)
