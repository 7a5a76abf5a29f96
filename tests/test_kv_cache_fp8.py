"""``--kv-cache-dtype``: the setting, the cache it allocates, and the FP8 latent cache's accuracy
through the engine against the activation-dtype cache (CPU, fp32 activations).

Accuracy bounds (figures of ``scripts/kv_cache_accuracy.py``'s :func:`compare`, which prints
them). The random tiny GLM-5 / DeepSeek-V3.2 models are chaotic (``index_topk = 8``: a perturbed
hidden state flips later layers' top-k), so there the bounds catch a broken cache, not rounding:
mean |Δ| of the prompt logits ≤ 35 % of their std, arg-max agreement ≥ 50 % (a wrong scale or
layout gives chance agreement). The trained demo model is the accuracy check: mean |Δ| ≤ 5 % of
the std, arg-max agreement ≥ 95 %, identical greedy answers for ≥ 14 of 16 prompts (its gate
on 200 problems: ``tests/test_demo_gate.py``). With the FP8 cache on both sides, chunked prefill equals unchunked
and a prefix-cached extend equals a fresh prefill (1e-4, as ``test_engine.py``): every reader
sees the same stored rows.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from breakgraph import Engine
from breakgraph.engine.config import EngineConfig
from breakgraph.engine.kv_cache import KVCache
from breakgraph.engine.model_runner import BatchEntry, resolve_kv_cache_dtype
from breakgraph.forward_context import ForwardMode
from breakgraph.models.config import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from kv_cache_accuracy import compare, tiny_prompts  # noqa: E402


def test_setting_is_checked_and_resolved():
    assert EngineConfig().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        EngineConfig(kv_cache_dtype="fp8")
    assert EngineConfig.from_dict(EngineConfig(kv_cache_dtype="fp8_e4m3").to_dict()).kv_cache_dtype == "fp8_e4m3"
    assert resolve_kv_cache_dtype("auto", torch.float32) is torch.float32
    assert resolve_kv_cache_dtype("bfloat16", torch.float32) is torch.bfloat16
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16) is torch.float8_e4m3fn


def test_glm5_fp8_cache_rows_and_page_bytes():
    """GLM-5 per rank: 656-byte latent rows instead of 1152; indexer keys stay bf16."""
    from breakgraph.bench.presets import preset_folder

    cfg = ModelConfig.from_pretrained(preset_folder("glm5-tp8-rank"))
    idx_layers = sum(cfg.has_indexer(i) for i in range(cfg.num_hidden_layers))
    bf16 = KVCache.bytes_per_page(cfg, 64, torch.bfloat16)
    fp8 = KVCache.bytes_per_page(cfg, 64, torch.bfloat16, torch.float8_e4m3fn)
    assert bf16 == 64 * (cfg.num_hidden_layers * 1152 + idx_layers * 256)
    assert fp8 == 64 * (cfg.num_hidden_layers * 656 + idx_layers * 256)
    small = dataclasses.replace(cfg, num_hidden_layers=2)
    cache = KVCache(small, 3, 4, torch.bfloat16, torch.device("cpu"), torch.float8_e4m3fn)
    assert cache.fp8_latent and cache.latent[0].dtype == torch.uint8 and cache.latent[0].shape == (12, 656)
    assert cache.indexer_k[0].dtype == torch.bfloat16 and cache.num_tokens == 8


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_fp8_cache_tracks_the_exact_cache_on_tiny_models(model_type, hf_checkpoints):
    fig = compare(hf_checkpoints[model_type], tiny_prompts(128), "cpu", max_new_tokens=16)
    print(fig.line(model_type))
    assert fig.logit_mean_abs <= 0.35 * fig.logit_std, fig
    assert fig.top1_agree >= 0.5, fig


@pytest.mark.slow
def test_fp8_cache_keeps_the_demo_models_greedy_answers():
    from breakgraph.demo.default_model import ASSETS, SHIPPED_NAME

    if not (ASSETS / SHIPPED_NAME / "config.json").is_file():
        pytest.skip("no shipped demo checkpoint")
    from kv_cache_accuracy import demo_prompts

    fig = compare(ASSETS / SHIPPED_NAME, demo_prompts(16), "cpu", context_length=256)
    print(fig.line("demo"))
    assert fig.logit_mean_abs <= 0.05 * fig.logit_std, fig
    assert fig.top1_agree >= 0.95 and fig.same_requests >= 14 / 16, fig


@pytest.fixture(scope="module")
def glm(hf_checkpoints):
    return hf_checkpoints["glm_moe_dsa"]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()


@pytest.mark.parametrize("fp8_indexer", ["0", "1"])
def test_fp8_cache_chunked_and_prefix_cached_prefill_equal_one_pass(glm, fp8_indexer, monkeypatch):
    """Also with the FP8 indexer, whose keys the FP8 cache then stores in FP8 too."""
    monkeypatch.setenv("BREAKGRAPH_INDEXER_FP8", fp8_indexer)
    prompts = tiny_prompts(128, n=2, seed=4)
    kw = dict(device="cpu", dtype="float32", page_size=4, kv_cache_dtype="fp8_e4m3")
    whole = Engine(glm, **kw).prompt_logits(prompts)
    chunked = Engine(glm, chunked_prefill_size=7, **kw).prompt_logits(prompts)
    for a, b in zip(chunked, whole):
        _close(a, b)
    engine = Engine(glm, **kw)
    assert engine.kv_cache.latent[0].dtype == torch.uint8
    assert engine.kv_cache.fp8_index_keys == (fp8_indexer == "1")
    ids = prompts[1]
    pool, runner = engine.kv_cache.pool, engine.runner
    pages = pool.alloc(pool.pages_for(len(ids)))
    runner.forward(runner.make_batch([BatchEntry(ids[:23], 0, pages)], ForwardMode.EXTEND), all_logits=True)
    extended = runner.forward(runner.make_batch([BatchEntry(ids[23:], 23, pages)], ForwardMode.EXTEND), all_logits=True)
    pool.free(pages)
    _close(extended, whole[1][23:])


@pytest.mark.cuda
def test_demo_gate_with_fp8_cache_and_real_cuda_graphs():
    """bf16 activations, breakable prefill graphs and full decode graphs on the FP8 latent cache:
    the demo gate (≥ 0.92 on 200 problems) holds, and ≥ 95 % of answers equal the bf16 cache's."""
    from breakgraph import SamplingParams
    from breakgraph.demo.default_model import ASSETS, SHIPPED_NAME
    from breakgraph.demo.problems import extract_answer, format_prompt, test_split

    if not (ASSETS / SHIPPED_NAME / "config.json").is_file():
        pytest.skip("no shipped demo checkpoint")
    problems = test_split(200)
    texts = {}
    for kv in ("bfloat16", "fp8_e4m3"):
        engine = Engine(ASSETS / SHIPPED_NAME, device="cuda", dtype="bfloat16", kv_cache_dtype=kv, page_size=16,
                        context_length=256, num_pages=len(problems) * 16 + 1, max_running_requests=len(problems),
                        cuda_graph_backend_prefill="breakable", cuda_graph_bs_prefill=[256, 512, 1024],
                        cuda_graph_backend_decode="full", cuda_graph_max_bs=64)  # fmt: skip
        outs = engine.generate([format_prompt(p.question) for p in problems], SamplingParams(max_new_tokens=96))
        assert engine.graph_stats()["replays"] > 0
        texts[kv] = [o.text for o in outs]
        acc = sum(extract_answer(t) == p.final for p, t in zip(problems, texts[kv])) / len(problems)
        print(f"demo gate on GPU, {kv} cache: accuracy {acc:.3f}")
        assert acc >= 0.92, (kv, acc)
    same = sum(a == b for a, b in zip(texts["bfloat16"], texts["fp8_e4m3"])) / len(problems)
    print(f"demo gate on GPU: {same:.1%} of answers identical with the FP8 and bf16 caches")
    assert same >= 0.95


def test_bench_counts_the_tokens_that_fit_per_cache():
    """glm5-tp8-rank, 100 GiB of cache: per token 109,824 bytes in bf16, 71,136 with the FP8 latent
    cache, 62,400 with FP8 indexer keys too (78 layers × (656 + 144))."""
    from breakgraph.bench.prefill import tokens_that_fit
    from breakgraph.bench.presets import preset_folder

    cfg = ModelConfig.from_pretrained(preset_folder("glm5-tp8-rank"))
    budget = 100 << 30
    got = tokens_that_fit(cfg, 64, torch.bfloat16, budget)
    for name, per_token in (("bfloat16", 109_824), ("fp8_e4m3", 71_136), ("fp8_e4m3 + FP8 indexer keys", 62_400)):
        assert got[name] == (budget // (per_token * 64) - 1) * 64, name
