"""The batched sampler against plain per-row reference computations on fresh random fp32
logits, its seeding, and its one device→host copy per step."""

from __future__ import annotations

import math

import pytest
import torch

from breakgraph import Engine, SamplingParams
from breakgraph.engine.request import Request
from breakgraph.engine.sampling import Sampler, SamplingParamError

V = 50
EOS = {3}


@pytest.fixture(scope="module")
def glm(hf_checkpoints):
    return hf_checkpoints["glm_moe_dsa"]


def random_logits(rows: int, vocab: int = V) -> torch.Tensor:
    return torch.randn(rows, vocab) * 3  # fresh per test run: the references must hold for any logits


def request(prompt_len=6, outputs=(), **kw) -> Request:
    req = Request(torch.randint(0, V, (prompt_len,)).tolist(), SamplingParams(**kw))
    req.output_ids = list(outputs)
    return req


def reference_process(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """One row, the way the OpenAI/vLLM docs describe it, one token at a time."""
    p, out = req.params, logits.clone()
    for t, b in p.logit_bias.items():
        out[t] += b
    if len(req.output_ids) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else EOS):
            out[t] = -math.inf
    for t in set(req.prompt_ids) | set(req.output_ids):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(req.output_ids):
        out[t] -= p.frequency_penalty * req.output_ids.count(t) + p.presence_penalty
    return out


def test_bias_min_tokens_and_penalties_equal_the_reference_per_row():
    sampler = Sampler(EOS)
    reqs = [
        request(logit_bias={1: 5.0, 7: -2.5, 49: 100.0}),
        request(outputs=[4, 4, 9], min_tokens=5, stop_token_ids=[11, 12]),
        request(outputs=[4, 4, 9], min_tokens=3, stop_token_ids=[11]),  # min_tokens reached: nothing banned
        request(outputs=[5, 5, 5, 8], presence_penalty=0.7, frequency_penalty=-0.3),
        request(outputs=[2, 2, 30], repetition_penalty=1.8),
        request(outputs=[2, 6], repetition_penalty=0.6, presence_penalty=-1.5, frequency_penalty=1.1,
                logit_bias={6: 2.0}, min_tokens=4, ignore_eos=True, stop_token_ids=[0]),  # fmt: skip
        request(outputs=[1, 2, 3]),  # nothing asked for
    ]
    logits = random_logits(len(reqs))
    got = sampler.process(logits, reqs)
    for b, req in enumerate(reqs):
        torch.testing.assert_close(got[b], reference_process(logits[b], req), rtol=1e-6, atol=1e-6)


def test_penalty_counts_grow_on_the_device_step_by_step():
    sampler = Sampler(EOS)
    reqs = [request(temperature=1.0, seed=s, presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.3)
            for s in range(3)] + [request()]  # fmt: skip
    for _ in range(6):
        logits = random_logits(len(reqs))
        expected = torch.stack([reference_process(logits[b], r) for b, r in enumerate(reqs)])
        torch.testing.assert_close(sampler.process(logits, reqs), expected, rtol=1e-6, atol=1e-6)
        for r, s in zip(reqs, sampler(logits, reqs)):
            r.output_ids.append(s.token)
    counts = torch.bincount(torch.tensor(reqs[0].output_ids), minlength=V).float()
    assert torch.equal(reqs[0].sampler_state.counts, counts)
    assert reqs[3].sampler_state is None


def reference_keep(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """The tokens that may be drawn: temperature, then min_p, top-k, top-p, one row at a time."""
    scaled = logits / p.temperature
    probs = torch.softmax(scaled, -1)
    keep = [t for t in range(len(logits)) if probs[t] >= p.min_p * probs.max()]
    if p.top_k:
        kth = sorted((scaled[t].item() for t in keep), reverse=True)[: p.top_k][-1]
        keep = [t for t in keep if scaled[t] >= kth]
    if p.top_p < 1:
        kept = torch.softmax(scaled[keep], -1).tolist()
        order = sorted(range(len(keep)), key=lambda i: -kept[i])
        mass, chosen = 0.0, []
        for i in order:
            if mass > p.top_p:
                break
            chosen.append(keep[i])
            mass += kept[i]
        keep = chosen
    return set(keep)


@pytest.mark.parametrize(
    "kw",
    [dict(temperature=0.8, min_p=0.05), dict(temperature=1.3, top_k=7), dict(temperature=0.5, top_p=0.8),
     dict(temperature=1.0, min_p=0.02, top_k=12, top_p=0.9), dict(temperature=2.0)],
)  # fmt: skip
def test_filters_keep_what_the_reference_keeps(kw):
    params = [SamplingParams(**kw) for _ in range(8)]
    logits = random_logits(8)
    got = Sampler.filter(logits, params)
    for b in range(8):
        assert set(torch.nonzero(torch.isfinite(got[b])).flatten().tolist()) == reference_keep(logits[b], params[b])
        kept = torch.isfinite(got[b])
        torch.testing.assert_close(got[b][kept], (logits[b] / params[b].temperature)[kept])


def test_seeded_draws_follow_the_filtered_distribution():
    """20,000 rows, one seed each, of the same logits: token frequencies match the reference
    probabilities (within 5 standard errors)."""
    n = 20_000
    row = random_logits(1, 12)[0]
    params = SamplingParams(temperature=0.9, top_k=8, top_p=0.95, seed=0)
    keep = sorted(reference_keep(row, params))
    probs = torch.zeros(12)
    probs[keep] = torch.softmax(row[keep] / 0.9, -1)
    reqs = [Request([1], SamplingParams(temperature=0.9, top_k=8, top_p=0.95, seed=s)) for s in range(n)]
    tokens = torch.tensor([s.token for s in Sampler(set())(row.expand(n, -1), reqs)])
    freq = torch.bincount(tokens, minlength=12).double() / n
    err = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert ((freq - probs).abs() <= 5 * err + 1e-12).all(), (freq, probs)


def test_greedy_rows_are_argmax_whatever_shares_the_batch():
    logits = random_logits(6)
    reqs = [request(), request(temperature=1.0, seed=1), request(top_k=1, temperature=0.7),
            request(temperature=0.5, top_p=0.5, seed=2), request(), request(temperature=1.0)]  # fmt: skip
    out = Sampler(EOS)(logits, reqs)
    logprobs = torch.log_softmax(logits, -1)
    for b in (0, 2, 4):
        assert out[b].token == int(torch.argmax(logits[b]))
        assert out[b].logprob == float(logprobs[b, out[b].token])
    for b in range(6):
        assert out[b].logprob == pytest.approx(float(logprobs[b, out[b].token]), abs=1e-6)


def test_a_seeded_draw_depends_on_its_seed_and_token_index_only():
    logits = random_logits(5)
    alone = [Sampler(EOS)(logits[b : b + 1], [request(outputs=[0] * b, temperature=1.0, seed=40 + b)])[0]
             for b in range(5)]  # fmt: skip
    batch = [request(outputs=[0] * b, temperature=1.0, seed=40 + b) for b in range(5)]
    together = Sampler(EOS)(logits, batch)
    assert [s.token for s in together] == [s.token for s in alone]
    shuffled = Sampler(EOS)(logits.flip(0), batch[::-1])[::-1]
    assert [s.token for s in shuffled] == [s.token for s in alone]
    flat = random_logits(1, 1000)[0] * 0  # uniform: the draw is the noise's argmax
    draws = {Sampler(EOS)(flat[None], [request(outputs=[0] * i, temperature=1.0, seed=5)])[0].token for i in range(8)}
    assert len(draws) > 4, "successive token indices draw fresh noise"


def test_top_logprobs_are_the_most_likely_tokens():
    logits = random_logits(3)
    reqs = [request(), request(), request(temperature=1.0)]
    reqs[0].top_logprobs_num, reqs[2].top_logprobs_num = 5, 2
    out = Sampler(EOS)(logits, reqs)
    values, ids = torch.log_softmax(logits, -1).topk(5)
    assert out[0].top == list(zip(ids[0].tolist(), values[0].double().tolist()))
    assert out[1].top == []
    assert out[2].top == list(zip(ids[2, :2].tolist(), values[2, :2].double().tolist()))


def test_bad_params_name_the_field():
    for kw, field in [(dict(min_p=1.5), "min_p"), (dict(min_tokens=9, max_new_tokens=4), "min_tokens"),
                      (dict(repetition_penalty=0.0), "repetition_penalty"),
                      (dict(presence_penalty=math.inf), "presence_penalty"),
                      (dict(logit_bias={1: math.nan}), "logit_bias")]:  # fmt: skip
        with pytest.raises(SamplingParamError) as err:
            SamplingParams(**kw)
        assert err.value.field == field
    with pytest.raises(SamplingParamError, match="logit_bias: token id 50") as err:
        SamplingParams(logit_bias={50: 1.0}).check_vocab(V)
    with pytest.raises(SamplingParamError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1]).check_vocab(V)


SYNCS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


def test_a_decode_step_copies_to_the_host_once(glm, monkeypatch):
    """Every feature on at once, batch of 4: each decode step reads the device exactly once."""
    engine = Engine(glm, device="cpu", dtype="float32", page_size=4)
    kinds = [dict(), dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=1),
             dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                  logit_bias={5: 1.0}, min_tokens=4),
             dict(repetition_penalty=1.1, min_tokens=2, stop_token_ids=[7])]  # fmt: skip
    reqs = [engine.add_request([1, 2, 3, 4 + i], SamplingParams(max_new_tokens=8, **kw)) for i, kw in enumerate(kinds)]
    for r in reqs:
        r.top_logprobs_num = 3
    while any(r.in_prefill for r in reqs):
        engine.step()
    calls = []
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _original=original, **k):
            calls.append(_name)
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    steps = 0
    while engine.has_unfinished() and steps < 4:
        calls.clear()
        engine.step()
        steps += 1
        assert calls == ["tolist"], calls
    assert steps == 4


def test_seeded_generation_alone_equals_it_in_a_batch(glm):
    engine = Engine(glm, device="cpu", dtype="float32", page_size=4)
    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (9, 14, 5, 11)]
    seeded = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    others = [SamplingParams(max_new_tokens=6, ignore_eos=True),
              SamplingParams(max_new_tokens=10, temperature=0.7, seed=9, presence_penalty=0.4, ignore_eos=True),
              SamplingParams(max_new_tokens=3, temperature=1.2, top_k=5, ignore_eos=True)]  # fmt: skip
    alone = engine.generate(prompts[0], seeded)[0].token_ids
    assert engine.generate(prompts[0], seeded)[0].token_ids == alone, "run to run"
    batched = engine.generate(prompts, [seeded, *others])[0].token_ids
    assert batched == alone
    other_seed = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.95, seed=4321, ignore_eos=True)
    assert engine.generate(prompts[0], other_seed)[0].token_ids != alone


def test_generate_cli_takes_the_sampling_flags(capsys):
    from breakgraph.cli import main

    assert main(["generate", "--device", "cpu", "--logit-bias", "7"]) == 2
    assert "--logit-bias takes TOKEN_ID=BIAS" in capsys.readouterr().err
    assert main(["generate", "--device", "cpu", "--min-tokens", "9", "--max-new-tokens", "4"]) == 2
    assert "min_tokens" in capsys.readouterr().err
    engine = Engine(None, device="cpu", dtype="float32")
    token = engine.tokenizer.encode(" 7", add_special_tokens=False)[0]
    argv = ["generate", "--device", "cpu", "--max-new-tokens", "3", "--logit-bias", f"{token}=100", "--min-tokens", "3",
            "--presence-penalty", "-1", "--frequency-penalty", "0.5", "--repetition-penalty", "1.1", "--min-p", "0.1"]  # fmt: skip
    assert main(argv) == 0
    assert engine.tokenizer.decode([token] * 3) + "\n--- 3 tokens" in capsys.readouterr().out


@pytest.mark.cuda
def test_on_cuda_the_sampler_synchronizes_once_and_draws_what_the_cpu_draws():
    """CUDA's sync debug mode warns at every synchronizing call: the sampler makes as many as
    one copy to the host does. Integer hashing makes the noise the same on both devices (up to
    the last bits of the logs)."""
    import warnings

    reqs = [request(), request(temperature=0.9, top_k=10, top_p=0.9, min_p=0.01, seed=1),
            request(outputs=[4, 4], temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3,
                    repetition_penalty=1.2, logit_bias={5: 2.0}, min_tokens=4, seed=2)]  # fmt: skip
    for r in reqs:
        r.top_logprobs_num = 2
    logits = random_logits(3)
    cpu = Sampler(EOS)(logits, reqs)
    for r in reqs:
        r.sampler_state = None
    sampler, gpu_logits = Sampler(EOS), logits.cuda()
    sampler(gpu_logits, reqs)  # warm up
    for r in reqs:
        r.sampler_state = None
    def syncs_of(fn):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                result = fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return result, [str(w.message) for w in caught if "synchroniz" in str(w.message)]

    _, one_copy = syncs_of(lambda: gpu_logits[:, :4].tolist())
    gpu, syncs = syncs_of(lambda: sampler(gpu_logits, reqs))
    assert one_copy and len(syncs) == len(one_copy), syncs
    assert [s.token for s in gpu] == [s.token for s in cpu]
    assert [s.logprob for s in gpu] == pytest.approx([s.logprob for s in cpu], abs=1e-4)


@pytest.mark.parametrize("stop", ["", ["ok", ""], [None]])
def test_empty_or_non_string_stop_strings_are_refused_naming_the_field(stop):
    with pytest.raises(SamplingParamError) as err:
        SamplingParams(stop=stop)
    assert err.value.field == "stop"
