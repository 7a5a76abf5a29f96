"""``breakgraph`` command line: generate | serve | bench {prefill,decode,ttft,serve} | eval gsm8k."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Subcommands living in their own modules: name → (module, extra it needs or None, help). Each
# module provides add_arguments(parser) and main(args) -> int, and imports its extra's packages
# only inside main, so every --help works on the base install.
_MOUNTED = {
    ("serve",): ("breakgraph.server.cli", "serve", "start the OpenAI-compatible HTTP server"),
    ("bench", "serve"): ("breakgraph.bench.serve", "bench", "load-test an OpenAI-compatible server (TTFT, TPOT, ITL)"),
    ("bench", "prefill"): ("breakgraph.bench.prefill", None, "prefill latency per graph backend vs the physical floor"),
    ("bench", "decode"): ("breakgraph.bench.decode", None,
                          "decode-step latency through the engine per context length vs its floor"),
    ("bench", "ttft"): ("breakgraph.bench.ttft", None,
                        "time to first token of long prompts through the engine's chunked prefill"),
    ("eval", "gsm8k"): ("breakgraph.eval.gsm8k", "eval", "few-shot GSM8K accuracy against a /v1/completions endpoint"),
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: …)`` to every flag's help that does not already say ``default:``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        return help_text if "default:" in help_text.lower() else super()._get_help_string(action)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an :class:`~breakgraph.Engine`."""
    g = parser.add_argument_group("model and engine")
    g.add_argument("--model-path", default=None,
                   help="HF checkpoint folder (config.json, *.safetensors, tokenizer.json); default: the built-in tiny GLM-5 model")
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="activation/weight dtype; auto = bfloat16 on CUDA, float32 on CPU (FP8 weights stay FP8)")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="auto/safetensors read the checkpoint; dummy draws seeded random weights from config.json")
    g.add_argument("--context-length", type=int, default=None, help="longest prompt + output in tokens (default: the model's)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page")
    g.add_argument("--num-pages", type=int, default=None, help="KV-cache pages (default: sized from free memory)")
    g.add_argument("--mem-fraction-static", type=float, default=0.85,
                   help="on CUDA, the share of free memory (after weights) the KV cache may take")
    g.add_argument("--max-running-requests", type=int, default=64, help="most requests decoding at once")
    g.add_argument("--chunked-prefill-size", type=int, default=4096, help="most prompt tokens per prefill step")
    g.add_argument("--seed", type=int, default=0, help="seed for dummy weights")
    c = parser.add_argument_group("graphs")
    c.add_argument("--cuda-graph-backend-prefill", default=None, choices=["disabled", "breakable", "piecewise"],
                   help="prefill under graphs: breakable (breakable CUDA graphs), piecewise (torch.compile split at "
                        "the split ops) or disabled (eager). Default: breakable on CUDA, disabled on CPU; on CPU the "
                        "graph backends run on the CPU graph backend")
    c.add_argument("--cuda-graph-bs-prefill", type=int, nargs="+", default=None,
                   help="token counts to capture prefill graphs for (default: the bucket ladder up to --cuda-graph-max-bs-prefill)")
    c.add_argument("--cuda-graph-max-bs-prefill", type=int, default=None,
                   help="largest prefill bucket in tokens (default: min(--chunked-prefill-size, 4096)); "
                        "prefill chunks never exceed it")
    c.add_argument("--cuda-graph-backend-decode", default=None, choices=["disabled", "full"],
                   help="decode under full graphs, one per batch-size bucket (default: full on CUDA, disabled on CPU)")
    c.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="largest decode batch captured (default: min(--max-running-requests, 64))")
    c.add_argument("--fold-islands", action="store_true",
                   help="run single-kernel graph segments eagerly inside the neighbouring break")
    add_parallel_arguments(parser)


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tp-size`` (also for commands with their own engine flags, e.g. ``bench prefill``)."""
    p = parser.add_argument_group("parallelism")
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel ranks, one process each (one GPU each on CUDA), started by breakgraph "
                        "(or by torchrun when RANK/WORLD_SIZE are set)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        device=args.device, dtype=args.dtype, load_format=args.load_format, context_length=args.context_length,
        page_size=args.page_size, num_pages=args.num_pages, mem_fraction_static=args.mem_fraction_static,
        max_running_requests=args.max_running_requests, chunked_prefill_size=args.chunked_prefill_size,
        seed=args.seed, cuda_graph_backend_prefill=args.cuda_graph_backend_prefill,
        cuda_graph_bs_prefill=args.cuda_graph_bs_prefill, cuda_graph_max_bs_prefill=args.cuda_graph_max_bs_prefill,
        cuda_graph_backend_decode=args.cuda_graph_backend_decode, cuda_graph_max_bs=args.cuda_graph_max_bs,
        fold_islands=args.fold_islands, tp_size=args.tp_size,
    )  # fmt: skip


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts", description="Generate text offline.",
                       formatter_class=_HelpFormatter)
    p.add_argument("--prompt", action="append", required=False,
                   help="prompt text (repeat the flag for a batch); default: a sample arithmetic question")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate per prompt")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    s.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    s.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens at least this fraction as likely as the most likely one (0 = off)")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--min-tokens", type=int, default=0, help="tokens to generate before EOS or a stop id may end it")
    s.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted from the logit of each generated token")
    s.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted from a token's logit once per time it was generated")
    s.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divides positive / multiplies negative logits of tokens in the prompt or output (1 = off)")
    s.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN_ID=BIAS",
                   help="add BIAS to the logit of TOKEN_ID (repeatable)")
    s.add_argument("--sampling-seed", type=int, default=None, help="seed for reproducible sampling")
    add_engine_arguments(p)
    p.set_defaults(func=_run_generate)


DEFAULT_PROMPT = "Question: Lena has 12 apples and buys 7 more. How many apples does she have now?\nAnswer:"


def _run_generate(args: argparse.Namespace) -> int:
    from breakgraph import Engine, SamplingParams

    try:
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            min_p=args.min_p, stop=args.stop, seed=args.sampling_seed, min_tokens=args.min_tokens,
            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty, logit_bias=_parse_logit_bias(args.logit_bias),
        )  # fmt: skip
    except ValueError as exc:
        print(f"breakgraph generate: {exc}", file=sys.stderr)
        return 2
    engine = Engine(args.model_path, **engine_kwargs(args))
    try:
        params.check_vocab(engine.config.vocab_size)
    except ValueError as exc:
        print(f"breakgraph generate: {exc}", file=sys.stderr)
        return 2
    prompts = args.prompt or [DEFAULT_PROMPT]
    for prompt, out in zip(prompts, engine.generate(prompts, params)):
        print(f"{prompt}{out.text}")
        print(f"--- {len(out.token_ids)} tokens, finish_reason={out.finish_reason}")
    return 0


def _parse_logit_bias(items: list[str]) -> dict[int, float]:
    """``--logit-bias TOKEN_ID=BIAS`` values → ``{token_id: bias}``."""
    bias = {}
    for item in items:
        token, _, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias takes TOKEN_ID=BIAS, got {item!r}") from None
    return bias


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="breakgraph", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, (module, extra, help_text) in _MOUNTED.items():
        parent = sub
        if len(path) == 2:
            if path[0] not in groups:
                g = sub.add_parser(path[0], help=f"{path[0]} tools")
                groups[path[0]] = g.add_subparsers(dest=f"{path[0]}_command", required=True)
            parent = groups[path[0]]
        p = parent.add_parser(path[-1], help=help_text, description=help_text, formatter_class=_HelpFormatter)
        p.set_defaults(module=module, extra=extra, command_name=" ".join(path))
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            p.set_defaults(unavailable=f"'{' '.join(path)}' is not available in this build")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP request is noise
    if getattr(args, "unavailable", None):
        print(args.unavailable, file=sys.stderr)
        return 2
    if hasattr(args, "func"):
        return args.func(args)
    missing = missing_extra_packages(args.extra) if args.extra else []
    if missing:
        print(f"breakgraph {args.command_name} needs the {args.extra} extra: pip install 'breakgraph[{args.extra}]' "
              f"(not installed: {', '.join(missing)})", file=sys.stderr)  # fmt: skip
        return 2
    return importlib.import_module(args.module).main(args)


def missing_extra_packages(extra: str) -> list[str]:
    """The distributions that breakgraph's optional-dependency group ``extra`` lists and that are
    not installed, in breakgraph's metadata order; ``[]`` when breakgraph itself is not installed
    (a source tree on ``sys.path``: the imports then say what is missing)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        requires = metadata.requires("breakgraph") or []
    except metadata.PackageNotFoundError:
        return []
    missing = []
    for line in requires:
        req = Requirement(line)
        if req.marker is None or not req.marker.evaluate({"extra": extra}):
            continue
        try:
            metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            missing.append(req.name)
    return missing


if __name__ == "__main__":
    sys.exit(main())
