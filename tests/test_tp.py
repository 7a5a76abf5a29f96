"""Tensor parallelism on CPU (gloo, 2 ranks): TP2 computes what TP1 computes, the loader
shards (FP8 included), configuration errors name the field, and a dead rank ends the job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tiny_models import write_fp8_checkpoint

from breakgraph import Engine, SamplingParams
from breakgraph.distributed import ParallelState, ShardingError
from breakgraph.engine.tp_launch import TensorParallelError
from breakgraph.models.config import ModelConfig
from breakgraph.models.glm5 import check_tensor_parallel
from breakgraph.models.loader import load_model

MODEL_TYPES = ["glm_moe_dsa", "deepseek_v32"]
BUCKETS = [16, 64]
COMMON = {"device": "cpu", "dtype": "float32", "page_size": 4, "cuda_graph_bs_prefill": BUCKETS}
RTOL = 1e-5


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in (37, 5, 20)]


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for a, b in zip(got, want):
        rel = ((a - b).abs().max() / b.abs().max()).item()
        assert rel <= RTOL, f"{what}: max relative difference {rel:.2e}"


def greedy(engine: Engine) -> list[list[int]]:
    outs = engine.generate(prompts(seed=1), SamplingParams(max_new_tokens=6, ignore_eos=True))
    return [c.token_ids for c in outs]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_tp2_logits_and_tokens_equal_tp1_eager_and_breakable(model_type, hf_checkpoints):
    folder = hf_checkpoints[model_type]
    ref = Engine(folder, **COMMON)
    want_logits, want_tokens = ref.prompt_logits(prompts()), greedy(ref)
    cfg = ref.config
    tp1_breaks = cfg.num_hidden_layers + sum(cfg.has_indexer(i) for i in range(cfg.num_hidden_layers))
    with Engine(folder, tp_size=2, **COMMON) as engine:
        assert engine.prefill_backend == "disabled" and len(engine.tp.worker_pids) == 1
        assert_close(engine.prompt_logits(prompts()), want_logits, "TP2 eager")
        assert greedy(engine) == want_tokens
        engine.set_prefill_backend("breakable", BUCKETS)  # the workers rebuild their graphs too
        assert_close(engine.prompt_logits(prompts()), want_logits, "TP2 breakable (CPU graph backend)")
        assert greedy(engine) == want_tokens
        stats = engine.graph_stats()
        assert stats["replays"] >= 1, "breakable selected but prefill ran eagerly"
        # On CPU every all-reduce is a break: embedding + (o_proj + MLP/MoE) per layer.
        assert stats["breaks"][64] == tp1_breaks + 1 + 2 * engine.config.num_hidden_layers
    assert not dist.is_initialized()


def test_loader_reads_each_rank_its_shard(hf_checkpoints):
    folder = hf_checkpoints["glm_moe_dsa"]
    full = load_model(folder, dtype=torch.float32)
    for rank in range(2):
        part = load_model(folder, dtype=torch.float32, parallel=ParallelState(rank, 2))
        check_shards(full, part, rank, 2)


def check_shards(full, part, rank: int, tp: int) -> None:
    """Every parameter of ``part`` (rank ``rank`` of ``tp``) is its slice of ``full``'s."""

    def rows(t):
        n = t.shape[0] // tp
        return t[rank * n : (rank + 1) * n]

    def cols(t):
        n = t.shape[-1] // tp
        return t[..., rank * n : (rank + 1) * n]

    def halves(t):  # gate‖up rows: this rank's rows of each half
        g, u = t.chunk(2, dim=-2)
        n = g.shape[-2] // tp
        return torch.cat([g[..., rank * n : (rank + 1) * n, :], u[..., rank * n : (rank + 1) * n, :]], dim=-2)

    want = dict(full.named_parameters())
    checked = set()
    for name, p in part.named_parameters():
        w = want[name]
        if name.endswith(("fused_b_proj.weight", "fused_b_proj.weight_scale_inv")):  # this rank's q_b rows ‖ wq_b
            merged = full.get_submodule(name.rsplit(".", 1)[0])
            nq = merged.output_sizes[0] * w.shape[0] // merged.out_features
            w = torch.cat([rows(w[:nq]), w[nq:]])
        elif name.endswith(("q_b_proj.weight", "kv_b_proj.weight", "q_b_proj.weight_scale_inv", "kv_b_proj.weight_scale_inv",
                          "embed_tokens.weight", "lm_head.weight")):  # fmt: skip
            w = rows(w)
        elif name.endswith(
            ("o_proj.weight", "down_proj.weight", "o_proj.weight_scale_inv", "down_proj.weight_scale_inv")
        ):
            w = cols(w)
        elif name.endswith(
            ("gate_up_proj.weight", "gate_up_proj.weight_scale_inv", "experts.w13", "experts.w13_scale")
        ):
            w = halves(w)
        elif name.endswith(("experts.w2", "experts.w2_scale")):
            w = cols(w)
        else:
            checked.add("replicated")
        assert p.shape == w.shape and torch.equal(p.float(), w.float()), name
    assert "replicated" in checked
    attn, ref = part.model.layers[0].self_attn, full.model.layers[0].self_attn
    assert torch.equal(attn.w_kc, rows(ref.w_kc)) and torch.equal(attn.w_vc, rows(ref.w_vc))


def test_fp8_checkpoint_shards_on_block_boundaries(hf_checkpoints, tmp_path):
    # 16×16 blocks: every TP2 shard of the tiny model is a whole number of blocks.
    folder = write_fp8_checkpoint(hf_checkpoints["glm_moe_dsa"], tmp_path / "fp8", block=16)
    full = load_model(folder, dtype=torch.float32)
    part = load_model(folder, dtype=torch.float32, parallel=ParallelState(1, 2))
    assert part.model.layers[0].self_attn.fused_b_proj.quantized and part.model.layers[1].mlp.experts.quantized
    check_shards(full, part, 1, 2)
    want = Engine(folder, **COMMON).prompt_logits(prompts())  # TP1 computes with the dequantised weights
    with Engine(folder, tp_size=2, **COMMON) as engine:
        assert_close(engine.prompt_logits(prompts()), want, "TP2 FP8")


def test_fp8_shard_off_block_boundary_names_tensor_and_tp_size(hf_checkpoints, tmp_path):
    # 128×128 blocks: q_b_proj has 128 rows, 64 per rank — half a block.
    folder = write_fp8_checkpoint(hf_checkpoints["glm_moe_dsa"], tmp_path / "fp8", block=128)
    with pytest.raises(ShardingError, match=r"q_b_proj\.weight.*--tp-size 2.*64 rows"):
        Engine(folder, tp_size=2, **COMMON)
    assert not dist.is_initialized(), "no rank may start for a model that cannot be sharded"


@pytest.mark.parametrize(
    ("field", "value", "tp"),
    [
        ("num_attention_heads", 4, 3),
        ("vocab_size", 130, 4),
        ("moe_intermediate_size", 30, 4),
        ("intermediate_size", 90, 4),
    ],
)
def test_indivisible_field_is_named_with_the_tp_size(hf_checkpoints, field, value, tp):
    cfg = json.loads((hf_checkpoints["glm_moe_dsa"] / "config.json").read_text())
    cfg[field] = value
    with pytest.raises(ShardingError, match=rf"'{field}' = {value} is not divisible by --tp-size {tp}"):
        check_tensor_parallel(ModelConfig.from_dict(cfg), tp)


def test_engine_refuses_bad_tp_before_starting_ranks(hf_checkpoints):
    with pytest.raises(ShardingError, match=r"num_attention_heads.*--tp-size 3"):
        Engine(hf_checkpoints["glm_moe_dsa"], tp_size=3, **COMMON)
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match=r"--tp-size 2 needs 2 CUDA devices"):
            Engine(hf_checkpoints["glm_moe_dsa"], tp_size=2, device="cuda", dtype="float32")
    with pytest.raises(ValueError, match=r"decode full.*--tp-size > 1 on CPU"):
        Engine(hf_checkpoints["glm_moe_dsa"], tp_size=2, device="cpu", cuda_graph_backend_decode="full")
    assert not dist.is_initialized()


def test_cli_has_tp_size():
    from breakgraph.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["generate", "--tp-size", "2"]).tp_size == 2
    try:
        assert parser.parse_args(["serve", "--tp-size", "4"]).tp_size == 4
    except SystemExit:
        pytest.skip("serve is not available in this build")


def run_with_timeout(fn, timeout: float):
    """``fn()``'s result or exception; fails the test instead of hanging."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still running after {timeout}s: a dead rank made the job hang"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_killed_worker_ends_the_job_with_a_clear_error(hf_checkpoints):
    engine = Engine(hf_checkpoints["glm_moe_dsa"], tp_size=2, **COMMON)
    try:
        engine.prompt_logits(prompts()[:1])
        (pid,) = engine.tp.worker_pids
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {pid}\) was killed by SIGKILL"):
            run_with_timeout(lambda: greedy(engine), timeout=30)
        assert time.monotonic() - start < 30
        with pytest.raises(TensorParallelError, match="SIGKILL"):
            engine.prompt_logits(prompts()[:1])  # the engine stays failed, it does not hang
    finally:
        engine.shutdown()
    assert not dist.is_initialized()
    # a new tensor-parallel engine can start in the same process afterwards
    with Engine(hf_checkpoints["glm_moe_dsa"], tp_size=2, **COMMON) as again:
        assert again.prompt_logits([[1, 2, 3]])[0].shape == (3, 128)


def _process_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # an orphan nobody reaps stays a zombie


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_exit_when_rank0_dies(hf_checkpoints):
    script = textwrap.dedent(f"""
        import os, signal
        from breakgraph import Engine
        engine = Engine({str(hf_checkpoints["glm_moe_dsa"])!r}, tp_size=2, device="cpu", dtype="float32", page_size=4)
        engine.prompt_logits([[1, 2, 3]])
        print(engine.tp.worker_pids[0], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    pid = int(proc.stdout.split()[-1])
    deadline = time.monotonic() + 20
    while not _process_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    gone = _process_gone(pid)
    if not gone:
        os.kill(pid, signal.SIGKILL)
    assert gone, "a worker outlived its rank 0"


@pytest.mark.cuda
def test_tp1_on_cuda_starts_no_process_group(hf_checkpoints):
    engine = Engine(hf_checkpoints["glm_moe_dsa"], device="cuda", dtype="float32", page_size=4, num_pages=64)
    assert engine.tp is None and not dist.is_initialized()
    got = engine.prompt_logits(prompts())
    ref = Engine(
        hf_checkpoints["glm_moe_dsa"], device="cuda", dtype="float32", page_size=4, num_pages=64, tp_size=1
    )
    assert_close(got, ref.prompt_logits(prompts()), "TP1 vs default")


@pytest.fixture(scope="module")
def midsize_checkpoint(tmp_path_factory):
    """A mid-size random GLM-5 checkpoint (~130M params; production head and latent dims, 16
    heads, 32 experts, index_topk 64), saved by transformers in bf16."""
    from tiny_models import glm5_config
    from transformers import GlmMoeDsaForCausalLM

    cfg = glm5_config()
    for key, value in dict(
        vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
        num_attention_heads=16, num_key_value_heads=16, n_routed_experts=32, num_experts_per_tok=4,
        kv_lora_rank=512, q_lora_rank=768, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
        index_topk=64, index_head_dim=128, index_n_heads=16,
    ).items():  # fmt: skip
        setattr(cfg, key, value)
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
    folder = tmp_path_factory.mktemp("glm5-mid")
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("backend", ["disabled", "breakable"])
@pytest.mark.parametrize("size", ["tiny-fp32", "mid-bf16"])
def test_tp2_on_two_gpus_equals_tp1(hf_checkpoints, midsize_checkpoint, backend, size):
    """TP2 over two GPUs against TP1: prompt logits and greedy tokens. fp32: logits within 1e-4
    of the largest, tokens identical. bf16: the all-reduce sums in another order, which can flip
    a near-tie (an expert choice), so the yardstick is bf16 itself: TP2's distance to TP1
    (relative Frobenius) at most twice TP1-bf16's distance to TP1-fp32; the first greedy token
    of every prompt equal, the whole continuation of all but one."""
    fp32 = size == "tiny-fp32"
    folder = hf_checkpoints["glm_moe_dsa"] if fp32 else midsize_checkpoint
    kw = {"device": "cuda", "dtype": "float32" if fp32 else "bfloat16", "page_size": 4, "num_pages": 256,
          "cuda_graph_backend_prefill": backend, "cuda_graph_bs_prefill": BUCKETS}  # fmt: skip
    ref = Engine(folder, **kw)
    want, want_tokens = ref.prompt_logits(prompts()), greedy(ref)
    del ref
    with Engine(folder, tp_size=2, **kw) as engine:
        got, got_tokens = engine.prompt_logits(prompts()), greedy(engine)
    if fp32:
        for a, b in zip(got, want):
            assert ((a - b).abs().max() / b.abs().max()).item() < 1e-4
        assert got_tokens == want_tokens
        return
    exact = Engine(folder, **{**kw, "dtype": "float32"}).prompt_logits(prompts())

    def dist(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    for a, b, c in zip(got, want, exact):
        assert dist(a, b) <= 2 * dist(b, c) + 1e-3, (dist(a, b), dist(b, c))
    assert [t[0] for t in got_tokens] == [t[0] for t in want_tokens]
    assert sum(a == b for a, b in zip(got_tokens, want_tokens)) >= len(want_tokens) - 1
