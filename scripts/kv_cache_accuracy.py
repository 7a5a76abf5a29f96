"""FP8 latent KV cache against the activation-dtype cache: the same model, the same prompts.

    python scripts/kv_cache_accuracy.py                       # tiny GLM-5 / DeepSeek-V3.2 + the demo model, CPU
    python scripts/kv_cache_accuracy.py --gate 200            # also the demo gate's accuracy on 200 problems
    python scripts/kv_cache_accuracy.py --device cuda --models demo --gate 200

Per model it prints: prompt-logit max and mean |Δ| (and the logits' std, for scale) over every
prompt position and the share of positions whose arg-max agrees (the max is set by the few
positions where a perturbed hidden state flips a later layer's top-k selection); greedy agreement — the share of requests whose greedy continuations are
identical, and the share of generated tokens before each request's first divergence; with
``--gate N``, the demo model's accuracy on N held-out problems with each cache. The reference
cache is ``--kv-cache-dtype auto`` (fp32 on CPU, bf16 on CUDA); on CPU a bf16 cache is measured
the same way beside the FP8 one, to show how far any rounding of the cache moves each model (the
random tiny models, with ``index_topk = 8``, are chaotic: a perturbed hidden state flips later
layers' top-k selections). ``tests/test_kv_cache_fp8.py`` asserts bounds on these figures
through :func:`compare`.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass
class Figures:
    logit_max_abs: float
    logit_mean_abs: float
    logit_std: float
    top1_agree: float  # share of prompt positions whose arg-max token is the same
    same_requests: float  # share of requests with identical greedy tokens
    tokens_before_divergence: float  # share of generated tokens before the first difference
    worst: str = ""  # where the max |Δ| is: prompt, position, top-token probability in each cache
    accuracy: dict[str, float] | None = None  # demo gate, per cache

    def line(self, name: str) -> str:
        gate = "" if not self.accuracy else "; gate " + ", ".join(f"{k} {v:.3f}" for k, v in self.accuracy.items())
        return (f"{name:<21} vs auto: prompt logits max |Δ| {self.logit_max_abs:.4f}, mean |Δ| {self.logit_mean_abs:.5f} "
                f"(logit std {self.logit_std:.2f}), top-1 agree {self.top1_agree:.1%}; greedy: {self.same_requests:.0%} of requests identical, "
                f"{self.tokens_before_divergence:.1%} of tokens before a divergence{gate}; max |Δ| at {self.worst}")  # fmt: skip


def _engine(path, device: str, kv: str, **kw):
    from breakgraph import Engine

    dtype = "float32" if device == "cpu" else "bfloat16"
    return Engine(path, device=device, dtype=dtype, kv_cache_dtype=kv, page_size=16, **kw)


def compare(
    path, prompts: list, device: str = "cpu", max_new_tokens: int = 24, kv: str = "fp8_e4m3", **engine_kw
) -> Figures:
    """Figures of the ``kv`` latent cache against ``auto`` on ``prompts`` (texts or token ids) of model ``path``."""
    from breakgraph import SamplingParams

    logits, tokens = {}, {}
    for name in ("auto", kv):
        engine = _engine(path, device, name, **engine_kw)
        logits[name] = engine.prompt_logits(prompts)
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
        tokens[name] = [o.token_ids for o in outs]
        del engine
    diff = torch.cat([(a - b).abs().flatten() for a, b in zip(logits["auto"], logits[kv])])
    std = torch.cat([a.flatten() for a in logits["auto"]]).std()
    top1 = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(logits["auto"], logits[kv])]).float().mean()
    worst_i = max(range(len(prompts)), key=lambda i: float((logits["auto"][i] - logits[kv][i]).abs().max()))
    a, b = logits["auto"][worst_i], logits[kv][worst_i]
    pos = int((a - b).abs().amax(-1).argmax())
    p_a, p_b = a[pos].softmax(-1), b[pos].softmax(-1)
    worst = (f"prompt {worst_i} position {pos}: top token p {float(p_a.max()):.3f} → {float(p_b.max()):.3f}"
             f"{' (same arg-max)' if int(p_a.argmax()) == int(p_b.argmax()) else ' (arg-max differs)'}")  # fmt: skip
    same, before, total = 0, 0, 0
    for a, b in zip(tokens["auto"], tokens[kv]):
        same += a == b
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        before += n
        total += len(a)
    return Figures(
        float(diff.max()), float(diff.mean()), float(std), float(top1), same / len(prompts), before / max(1, total), worst
    )


def demo_gate(device: str, n: int) -> dict[str, float]:
    """The demo gate's accuracy (zero-shot, greedy, 96 new tokens) on ``n`` problems per cache."""
    from breakgraph import SamplingParams
    from breakgraph.demo.default_model import ASSETS, SHIPPED_NAME
    from breakgraph.demo.problems import extract_answer, format_prompt, test_split

    problems = test_split(n)
    out = {}
    for kv in ("auto", "fp8_e4m3"):
        engine = _engine(ASSETS / SHIPPED_NAME, device, kv, context_length=256, num_pages=n * 16 + 1,
                         max_running_requests=n)  # fmt: skip
        texts = [o.text for o in engine.generate([format_prompt(p.question) for p in problems],
                                                 SamplingParams(max_new_tokens=96))]  # fmt: skip
        out[kv] = sum(extract_answer(t) == p.final for p, t in zip(problems, texts)) / n
    return out


def tiny_checkpoint(model_type: str, folder: Path) -> Path:
    """A tiny random checkpoint of ``tests/tiny_models.py`` (``glm_moe_dsa`` or ``deepseek_v32``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import make_hf_model

    make_hf_model(model_type).save_pretrained(folder)
    return folder


def tiny_prompts(vocab: int, n: int = 8, seed: int = 0) -> list[list[int]]:
    """``n`` random prompts of 20…76 tokens (longer than the tiny models' ``index_topk`` of 8)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (20 + 8 * i,), generator=g).tolist() for i in range(n)]


def demo_prompts(n: int = 16) -> list[str]:
    from breakgraph.demo.problems import format_prompt, test_split

    return [format_prompt(p.question) for p in test_split(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--models", nargs="+", default=["glm5-tiny", "dsv32-tiny", "demo"],
                   choices=("glm5-tiny", "dsv32-tiny", "demo"))  # fmt: skip
    p.add_argument("--gate", type=int, default=0, metavar="N", help="also the demo gate's accuracy on N problems")
    args = p.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    # On CPU the reference (auto) is fp32, so a bf16 cache's figures show how much any rounding
    # of the cache moves each model; on CUDA auto is bf16 itself.
    caches = ("bfloat16", "fp8_e4m3") if args.device == "cpu" else ("fp8_e4m3",)
    with tempfile.TemporaryDirectory() as tmp:
        for name, kv in itertools.product(args.models, caches):
            if name == "demo":
                from breakgraph.demo.default_model import ASSETS, SHIPPED_NAME

                fig = compare(ASSETS / SHIPPED_NAME, demo_prompts(), args.device, kv=kv, context_length=256)
                if args.gate and kv == "fp8_e4m3":
                    fig.accuracy = demo_gate(args.device, args.gate)
            else:
                mt = "glm_moe_dsa" if name == "glm5-tiny" else "deepseek_v32"
                folder = Path(tmp) / mt
                fig = compare(folder if folder.exists() else tiny_checkpoint(mt, folder), tiny_prompts(128), args.device,
                              kv=kv)  # fmt: skip
            print(fig.line(f"{name} {kv}"), flush=True)


if __name__ == "__main__":
    main()
