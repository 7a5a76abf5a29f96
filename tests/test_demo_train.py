"""The demo trainer: its training forward is the inference math, it learns, and what it saves
loads in breakgraph and transformers with the same fp32 logits (CPU, micro model)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from breakgraph import Engine
from breakgraph.demo.problems import train_split
from breakgraph.demo.tokenizer import build_corpus, train_tokenizer
from breakgraph.demo.train import (
    TrainArgs,
    encode_problems,
    main,
    model_config_dict,
    new_model,
    save_checkpoint,
    train_demo,
    train_forward,
    training_losses,
)
from breakgraph.layers.mlp import MoE
from breakgraph.models.config import ModelConfig
from breakgraph.models.loader import load_model

INDEX_TOPK = 8
MICRO = {
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 48,
    "qk_nope_head_dim": 16, "v_head_dim": 24, "index_topk": INDEX_TOPK, "max_position_embeddings": 256,
}  # fmt: skip

TWO_LAYERS = json.dumps({**MICRO, "num_hidden_layers": 2})  # --shape of the CLI runs


def _cli_args(out, shape: str | None, *extra: str) -> list[str]:
    args = ["--out", str(out), "--device", "cpu", "--batch-size", "4", "--train-problems", "64",
            "--val-problems", "4", "--vocab-size", "400", "--no-tokenizer-gsm8k", "--tokenizer-problems", "500",
            "--warmup-steps", "1", "--log-every", "1", "--no-final-eval"]  # fmt: skip
    return args + (["--shape", shape] if shape else []) + list(extra)


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(build_corpus(1500, seed=0), vocab_size=400)


@pytest.fixture(scope="module")
def micro(tok):
    """A random micro model with a non-zero router correction bias and clearly separated index
    scores (positive head weights, so few keys tie at a score of 0), and 3 encoded problems.
    Seeds chosen so the k-th/(k+1)-th score gap is ≥ 3e-4 (≈ 2e-5 of the score scale)."""
    cfg = model_config_dict(tok.get_vocab_size(), 0, 1, "float32", **MICRO)
    model = new_model(ModelConfig.from_dict(cfg), seed=3, std=0.1)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 2.0
        for layer in model.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
            indexer = layer.self_attn.indexer
            if indexer is not None:
                indexer.weights_proj.weight[:, 0] = 1.0
    data = encode_problems(tok, train_split(3, seed=5))
    return cfg, model, data


def topk_margin(scores: list[torch.Tensor], lengths: torch.Tensor) -> float:
    """Smallest gap between the k-th and (k+1)-th causal index score, over every indexer and
    every real query row that has more than k keys."""
    s = scores[0].shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    gaps = []
    for sc in scores:
        top = sc.masked_fill(~causal, float("-inf")).topk(INDEX_TOPK + 1, dim=-1).values
        for r, n in enumerate(lengths.tolist()):
            gaps.append(
                (top[r, INDEX_TOPK:n, INDEX_TOPK - 1] - top[r, INDEX_TOPK:n, INDEX_TOPK]).min().item()
            )
    return min(gaps)


def test_training_forward_equals_engine_prompt_logits(micro, tmp_path):
    cfg, model, data = micro
    ids, _, valid = data.batch(torch.arange(len(data)))
    assert int(data.lengths.min()) >= 4 * INDEX_TOPK, "sequences must be long enough for top-k to be sparse"
    folder = save_checkpoint(model, cfg, None, tmp_path / "ckpt", "float32")
    with torch.no_grad():
        out = train_forward(model, ids, sparse=True, valid=valid)
        dense = train_forward(model, ids, sparse=False, valid=valid).logits
    assert topk_margin(out.index_scores, data.lengths) > 2e-4, (
        "near-ties at the top-k boundary: fragile check"
    )
    ours = out.logits
    engine = Engine(folder, device="cpu", dtype="float32", page_size=4)
    rows = [ids[r, : int(data.lengths[r])].tolist() for r in range(len(data))]
    ref = engine.prompt_logits(rows)
    for r, want in enumerate(ref):
        got = ours[r, : len(rows[r])]
        err = (got - want).abs().max().item()
        assert err <= 1e-4 * want.abs().max().item(), f"row {r}: max |Δlogit| {err:.3g}"
        # the sparse mask matters: dense attention gives other logits
        assert (dense[r, : len(rows[r])] - want).abs().max().item() > 1e-3
    # the training forward also runs on a loaded inference model (absorbed w_kc/w_vc only)
    loaded = load_model(folder, dtype=torch.float32)
    with torch.no_grad():
        again = train_forward(loaded, ids, sparse=True, valid=valid).logits
    assert (again - ours).abs().max().item() <= 1e-4 * ours.abs().max().item()


def test_saved_folder_loads_in_breakgraph_and_transformers_with_matching_logits(micro, tok, tmp_path):
    from transformers import GlmMoeDsaForCausalLM

    cfg, model, data = micro
    folder = save_checkpoint(model, cfg, tok, tmp_path / "ckpt", "bfloat16")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "glm_moe_dsa" and config["torch_dtype"] == "bfloat16"
    assert config["indexer_types"] == ["full", "shared", "full", "shared"]
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert (config["eos_token_id"], config["pad_token_id"]) == (0, 1) and "bos_token_id" in config
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.float32
        assert f.get_tensor("model.layers.1.mlp.experts.0.gate_proj.weight").dtype == torch.bfloat16
    for name in (
        "model.layers.1.mlp.experts.7.down_proj.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.0.self_attn.kv_b_proj.weight", "model.layers.0.mlp.gate_proj.weight",
        "model.layers.2.self_attn.indexer.weights_proj.weight", "model.layers.2.self_attn.indexer.k_norm.bias",
    ):  # fmt: skip
        assert name in names, name
    assert not any("layers.1.self_attn.indexer" in n for n in names), "shared layers have no indexer"

    engine = Engine(folder, device="cpu", dtype="float32", page_size=4)
    hf = GlmMoeDsaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows = [data.tokens[r, : int(data.lengths[r])].tolist() for r in range(len(data))]
    for ids, ours in zip(rows, engine.prompt_logits(rows)):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        err = (ours - ref).abs().max().item()
        assert err <= 1e-4 * ref.abs().max().item(), f"max |Δlogit| {err:.3g}"
    text = engine.generate("Question: Mia has 3 apples.\nAnswer:")[0]
    assert text.prompt_tokens > 0


def test_moe_dense_and_loop_paths_agree_and_gradients_stay_where_they_belong(micro):
    _, model, data = micro
    ids, labels, valid = data.batch(torch.arange(len(data)))
    a = train_forward(model, ids, sparse=True, valid=valid, moe_impl="dense")
    b = train_forward(model, ids, sparse=True, valid=valid, moe_impl="loop")
    assert (a.logits - b.logits).abs().max().item() < 1e-4
    assert torch.equal(a.expert_load, b.expert_load) and int(a.expert_load.sum()) == 3 * 2 * int(valid.sum())

    indexer_params = {n for n, _ in model.named_parameters() if ".indexer." in n}
    model.zero_grad(set_to_none=True)
    F.cross_entropy(a.logits.flatten(0, 1), labels.flatten()).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(grads[n] is None for n in indexer_params), "the LM loss must not reach the indexer"
    assert grads["model.layers.1.mlp.gate.weight"].abs().sum() > 0, "the router learns through its weights"
    assert grads["model.layers.1.mlp.gate.e_score_correction_bias"] is None

    model.zero_grad(set_to_none=True)
    b.index_kl.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads) <= indexer_params and grads, "the index KL trains the indexer only"
    model.zero_grad(set_to_none=True)


@pytest.mark.slow
def test_the_compiled_training_step_equals_the_eager_one(micro, tok):
    """``--compile``: ``torch.compile`` of :func:`training_losses` (dynamic sequence length) gives
    the eager losses, expert loads and gradients (fp32, CPU) with sparse attention over the
    indexer's top-k, the stage of most steps, at two batch lengths."""
    _, model, data = micro
    compiled = torch.compile(training_losses, dynamic=True)
    more = encode_problems(tok, train_split(5, seed=9))
    for batch in (data.batch(torch.arange(len(data))), more.batch(torch.arange(len(more)))):
        runs = []
        for fn in (training_losses, compiled):
            model.zero_grad(set_to_none=True)
            loss, lm, kl, load = fn(model, *batch, sparse=True, moe_impl="dense", index_kl_weight=0.5)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            runs.append((torch.stack([loss, lm, kl]).detach(), load, grads))
        (want, want_load, want_grads), (got, got_load, got_grads) = runs
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got, want)
        assert torch.equal(got_load, want_load) and set(got_grads) == set(want_grads)
        for n, g in want_grads.items():
            assert torch.allclose(got_grads[n], g, rtol=1e-4, atol=1e-6), n
    model.zero_grad(set_to_none=True)


def test_a_few_training_steps_reduce_the_loss(tok):
    cfg = model_config_dict(tok.get_vocab_size(), 0, 1, "float32", **MICRO)
    model = new_model(ModelConfig.from_dict(cfg), seed=0)
    data = encode_problems(tok, train_split(64, seed=2))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    torch.manual_seed(0)
    for step in range(30):
        ids, labels, valid = data.batch(torch.randperm(len(data))[:16])
        loss, lm, _, _ = training_losses(
            model, ids, labels, valid, sparse=step >= 10, moe_impl="loop", index_kl_weight=1.0
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(lm.item())
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses


def test_train_demo_cli_writes_a_loadable_checkpoint(tmp_path):
    summary = main(_cli_args(tmp_path / "ckpt", TWO_LAYERS, "--steps", "4", "--log-every", "2"))
    assert summary["steps"] == 4 and summary["history"][-1]["stage"] == "sparse"
    engine = Engine(tmp_path / "ckpt", device="cpu", dtype="float32")
    assert engine.config.num_hidden_layers == 2 and engine.tokenizer is not None
    assert isinstance(TrainArgs(), TrainArgs) and train_demo is not None


def test_final_eval_falls_back_to_the_cpu_when_the_gpu_eval_fails(monkeypatch, tmp_path):
    from breakgraph.demo import train as T
    from breakgraph.demo.evaluate import EvalResult

    calls = []

    def fake_evaluate(folder, problems, device, dtype="float32"):
        calls.append((device, dtype))
        if device != "cpu":
            raise RuntimeError("no such device")
        return EvalResult(1.0, 1, 1, 0.0)

    monkeypatch.setattr(T, "evaluate", fake_evaluate)
    monkeypatch.setattr(T, "evaluate_splits", lambda folder, device, n_templates, log, dtype: {"device": device})
    res, val = T._final_eval(tmp_path, [], TrainArgs(final_eval_device="cuda"))
    assert calls == [("cuda", "bfloat16"), ("cpu", "float32")] and res == {"device": "cpu"} and val.correct == 1


def test_deadline_shortens_the_time_budget_to_what_is_left_after_the_data(tmp_path):
    summary = main(_cli_args(tmp_path / "ckpt", TWO_LAYERS, "--steps", "100000", "--time-budget", "600",
                             "--deadline", "0.01", "--log-every", "1000"))  # fmt: skip
    assert summary["args"]["time_budget"] == 1.0  # the least a deadline leaves
    assert summary["steps"] < 100000 and summary["train_seconds"] < 30


def _weights(folder) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_init_from_continues_a_checkpoint_with_its_tokenizer_shape_and_weights(tmp_path):
    first = main(_cli_args(tmp_path / "a", TWO_LAYERS, "--steps", "8", "--lr", "1e-2", "--save-dtype", "float32"))
    # lr 0 and no balance update: the continuation must save exactly the weights it started from
    still = main(_cli_args(tmp_path / "b", None, "--steps", "2", "--lr", "0", "--bias-update-rate", "0",
                           "--init-from", str(tmp_path / "a"), "--seed", "1", "--save-dtype", "float32"))  # fmt: skip
    assert (tmp_path / "b" / "tokenizer.json").read_bytes() == (tmp_path / "a" / "tokenizer.json").read_bytes()
    a_cfg, b_cfg = (json.loads((tmp_path / d / "config.json").read_text()) for d in "ab")
    assert a_cfg == b_cfg
    a_w, b_w = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert a_w.keys() == b_w.keys() and all(torch.equal(a_w[k], b_w[k]) for k in a_w)
    # sparse from the first step (the indexer is trained already), and it starts where the first run ended
    assert all(h["stage"] == "sparse" for h in still["history"] if "stage" in h)
    assert still["history"][0]["lm_loss"] < 0.9 * first["history"][0]["lm_loss"]


def test_init_from_refuses_a_shape_and_names_a_missing_file(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json there"):
        main(_cli_args(tmp_path / "b", None, "--steps", "1", "--init-from", str(tmp_path / "half")))
    with pytest.raises(ValueError, match="--shape"):
        main(_cli_args(tmp_path / "b", '{"hidden_size": 64}', "--steps", "1", "--init-from", str(tmp_path / "half")))


def test_a_failed_compile_falls_back_to_the_eager_step(monkeypatch, tmp_path, capsys):
    from breakgraph.demo import train as T

    def failing_compile(fn, **kwargs):
        def compiled(*args, **kw):
            raise RuntimeError("backend exploded")

        return compiled

    monkeypatch.setattr(T.torch, "compile", failing_compile)
    summary = main(_cli_args(tmp_path / "c", TWO_LAYERS, "--steps", "3", "--compile"))
    assert summary["steps"] == 3 and "torch.compile failed (RuntimeError: backend exploded); eager" in capsys.readouterr().out


def _micro_steps(tok, seed: int = 0, bias_update_rate: float = 1e-3, device: str = "cpu"):
    """A micro model, its AdamW and its TrainStep (fp32, dense MoE: the graphable step)."""
    from functools import partial

    from breakgraph.demo.train_step import TrainStep

    cfg = model_config_dict(tok.get_vocab_size(), 0, 1, "float32", **{**MICRO, "num_hidden_layers": 3})
    model = new_model(ModelConfig.from_dict(cfg), seed=seed, device=device, std=0.05)
    losses = partial(training_losses, moe_impl="dense", index_kl_weight=1.0)
    step = TrainStep(model, losses, amp=False, bias_update_rate=bias_update_rate)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    return model, opt, step


def test_padding_a_batch_changes_no_loss_load_or_gradient(tok):
    """Dense stage: in the sparse one a random model's index scores tie (ReLU zeros), and which of
    the tied keys ``topk`` keeps may change with the row's width — another valid top-k."""
    from breakgraph.demo.train_step import pad_batch

    model, _, step = _micro_steps(tok, bias_update_rate=0.0)  # the same routing for both batches
    data = encode_problems(tok, train_split(6, seed=4))
    ids, labels, valid = data.batch(torch.arange(6))
    results, grads = [], []
    for batch in ((ids, labels, valid), pad_batch(ids, labels, valid, ids.shape[1] + 13, pad_id=1)):
        results.append(step(*batch, sparse=False))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (a, b), (ga, gb) = results, grads
    assert torch.allclose(a.lm, b.lm, rtol=1e-6) and torch.allclose(a.index_kl, b.index_kl, rtol=0, atol=2e-6)  # a difference of near-equal sums
    assert torch.equal(a.expert_load, b.expert_load) and a.expert_load.sum() == 2 * 2 * valid.sum()
    assert ga.keys() == gb.keys() and len(ga) > 20
    for n in ga:
        assert torch.allclose(ga[n], gb[n], rtol=1e-5, atol=1e-7), n


@pytest.mark.parametrize("longest", [False, True], ids=["as-they-come", "longest-first"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_graphed_steps_replay_the_eager_steps(tok, device, amp, longest):
    """Steps through GraphedSteps (captured, replayed with new batches, one graph replayed after
    another was captured, both stages; CUDA graphs or the CPU stand-in) leave the same weights,
    biases and losses as plain eager steps of a twin model on the same batches padded alike.
    With ``longest`` the first batch of each stage is padded to the data's longest row."""
    from breakgraph.demo.train_step import GraphedSteps, pad_batch

    # CUDA: the backward's scatter-adds sum in no fixed order, and Adam turns that noise in
    # near-zero gradients into whole steps of the learning rate; so there each step starts both
    # models from the same weights (copied in place: the graphs keep their addresses) and the
    # gradients are compared, bf16 products to a few roundings. The CPU keeps one trajectory.
    cuda = device == "cuda"
    rtol = 1e-4 if amp and cuda else 1e-5
    eager_model, eager_opt, eager_step = _micro_steps(tok, device=device)
    graph_model, graph_opt, graph_step = _micro_steps(tok, device=device)
    graph_step.amp = amp
    data = encode_problems(tok, train_split(60, seed=5))
    graphed = GraphedSteps(
        graph_step, pad_id=1, max_length=MICRO["max_position_embeddings"], length_step=16,
        longest=int(data.lengths.max()) if longest else None,
    )  # fmt: skip
    top = graphed.padded_length(int(data.lengths.max()))
    by_key: dict[int, list[int]] = {}
    for i, n in enumerate(data.lengths.tolist()):
        by_key.setdefault(graphed.padded_length(n), []).append(i)
    first, second = sorted((k for k, rows in by_key.items() if len(rows) >= 12), key=lambda k: -len(by_key[k]))[:2]
    a, b = by_key[first], by_key[second]
    # dense: capture A, replay A, capture B, replay A after B's capture; sparse: capture B, replay B
    batches = [a[0:4], a[4:8], b[0:4], a[8:12], b[4:8], b[8:12]]
    stages = [False, False, False, False, True, True]
    keys = []
    for idx, sparse in zip(batches, stages):
        ids, labels, valid = (t.to(device) for t in data.batch(idx))
        length = graphed.padded_length(ids.shape[1])
        if longest and sparse not in {k[2] for k in keys}:
            length = top  # the stage's first batch
        keys.append((4, length, sparse))
        # the twin: a plain step (gradients set to None, then one backward), not TrainStep
        eager_opt.zero_grad(set_to_none=True)
        padded = pad_batch(ids, labels, valid, length, 1)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
            loss, lm, _, load = eager_step.losses_fn(eager_model, *padded, sparse=sparse)
        loss.backward()
        with torch.no_grad():
            for bias, layer_load in zip(eager_step.biases, load):
                bias.add_(torch.sign(layer_load.mean() - layer_load) * 1e-3)
        got = graphed(ids, labels, valid, sparse)
        assert torch.allclose(got.lm, lm, rtol=rtol) and torch.equal(got.expert_load, load), (got.lm, lm)
        # equal loads move the router biases by equal signs: once a step, a capture's warm-up undone
        assert all(torch.equal(g, e) for g, e in zip(graph_step.biases, eager_step.biases))
        if cuda:
            for (name, p), q in zip(graph_model.named_parameters(), eager_model.parameters()):
                if q.grad is not None:
                    assert torch.allclose(p.grad, q.grad, rtol=1e-3 if amp else 1e-4, atol=1e-6), name
        for model, opt in ((eager_model, eager_opt), (graph_model, graph_opt)):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        if cuda:
            with torch.no_grad():
                for p, q in zip(graph_model.state_dict().values(), eager_model.state_dict().values()):
                    p.copy_(q)
    assert sorted(graphed.graphs) == sorted(set(keys))
    if longest:  # each stage's first graph at the longest row's length, then the shorter ones
        assert max(first, second) < top and {(4, top, False), (4, top, True)} <= set(keys) and len(set(keys)) == 5
    else:
        assert set(keys) == {(4, first, False), (4, second, False), (4, second, True)}  # 3 replays
    assert not graphed.off
    if not cuda:  # one trajectory: the same weights after every step
        want_state, got_state = eager_model.state_dict(), graph_model.state_dict()
        for name, w in want_state.items():
            assert torch.allclose(got_state[name], w, rtol=1e-4, atol=1e-6), name


def test_train_cli_with_graphs_trains_and_logs_its_captures(tmp_path, capsys):
    summary = main(_cli_args(tmp_path / "g", TWO_LAYERS, "--steps", "6", "--graphs", "--moe-impl", "dense"))
    out = capsys.readouterr().out
    assert summary["steps"] == 6 and "graphs per length" in out
    assert "captured the training step at" in out and "dense attention (1 graphs" in out
    with pytest.raises(ValueError, match="--graphs"):
        main(_cli_args(tmp_path / "h", TWO_LAYERS, "--steps", "1", "--graphs", "--compile", "--moe-impl", "dense"))


def test_a_failed_capture_turns_the_graphs_off_and_the_steps_run_eagerly(tok, monkeypatch):
    from breakgraph.demo import train_step as TS
    from breakgraph.graphs.segments import CpuSegmentCapturer

    model, _, step = _micro_steps(tok, bias_update_rate=0.0)
    logs: list[str] = []
    graphed = TS.GraphedSteps(step, pad_id=1, max_length=MICRO["max_position_embeddings"], log=logs.append)

    class RefusingCapturer(CpuSegmentCapturer):
        def begin(self, label):
            raise RuntimeError(f"no graph for {label}")

    monkeypatch.setattr(TS, "make_capturer", lambda device, pool: RefusingCapturer())
    data = encode_problems(tok, train_split(8, seed=6))
    batch = data.batch(torch.arange(4))
    got = graphed(*batch, sparse=False)
    want = step(*TS.pad_batch(*batch, graphed.padded_length(batch[0].shape[1]), 1), sparse=False)
    assert graphed.off and not graphed.graphs and torch.allclose(got.lm, want.lm, rtol=1e-6)
    assert "eager steps from here" in logs[-1] and "no graph for the training step at 4" in logs[-1]
    again = graphed(*data.batch(torch.arange(4, 8)), sparse=False)  # eager now: unpadded, no capture
    assert again.lm.isfinite() and not graphed.graphs


def test_init_from_refuses_its_own_output_folder_and_a_mismatched_tokenizer(tmp_path, monkeypatch):
    from breakgraph.demo import train as T

    main(_cli_args(tmp_path / "a", TWO_LAYERS, "--steps", "1"))
    monkeypatch.setattr(T, "make_mixture", lambda *a, **k: pytest.fail("the data stage ran before the checks"))
    with pytest.raises(ValueError, match="would overwrite the checkpoint it starts from"):
        main(_cli_args(tmp_path / "a", None, "--steps", "1", "--init-from", str(tmp_path / "a")))
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    (tmp_path / "a" / "config.json").write_text(json.dumps({**cfg, "pad_token_id": cfg["pad_token_id"] + 1}))
    with pytest.raises(ValueError, match="does not match config.json"):
        main(_cli_args(tmp_path / "b", None, "--steps", "1", "--init-from", str(tmp_path / "a")))
