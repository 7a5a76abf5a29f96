"""``breakgraph`` command line: generate | serve | bench {prefill,decode,ttft,itl,serve,model-folder} | eval gsm8k."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from breakgraph.engine.config import PARALLEL, EngineConfig, flag_fields, flag_name

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
    ("bench", "itl"): ("breakgraph.bench.itl", None,
                       "inter-token latency of running streams while a context-length prompt prefills"),
    ("bench", "model-folder"): ("breakgraph.bench.model_folder", None,
                                "write a bench preset's config.json and a tokenizer covering its vocabulary"),
    ("eval", "gsm8k"): ("breakgraph.eval.gsm8k", "eval", "few-shot GSM8K accuracy against a /v1/completions endpoint"),
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: …)`` to every flag's help that does not already say ``default:``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        return help_text if "default:" in help_text.lower() else super()._get_help_string(action)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an :class:`~breakgraph.Engine`: one per
    field of :class:`~breakgraph.engine.config.EngineConfig` that has a flag, in its group."""
    _add_config_flags(parser, flag_fields())


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tp-size`` (also for commands with their own engine flags, e.g. ``bench prefill``)."""
    _add_config_flags(parser, flag_fields(PARALLEL))


def add_config_arguments(parser: argparse.ArgumentParser, *names: str) -> None:
    """The flags of the named :class:`~breakgraph.engine.config.EngineConfig` fields, with the
    engine's defaults and help (for benches that build their own engine, e.g. ``--page-size``)."""
    by_name = {f.name: f for f in flag_fields()}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"add_config_arguments: no engine flag for {unknown}")
    _add_config_flags(parser, [by_name[n] for n in names])


def _add_config_flags(parser: argparse.ArgumentParser, config_fields: list) -> None:
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in config_fields:
        m = f.metadata
        if m["group"] not in groups:
            groups[m["group"]] = parser.add_argument_group(m["group"])
        kwargs: dict = {"help": m["help"], "default": f.default}
        if m["type"] is bool:
            kwargs["action"] = "store_true"
        else:
            kwargs.update(type=m["type"], choices=m["choices"], nargs=m["nargs"])
        groups[m["group"]].add_argument(f"--{flag_name(f.name)}", **kwargs)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine settings parsed from the flags of :func:`add_engine_arguments` (all but
    ``model_path``), as keywords for ``Engine(args.model_path, **engine_kwargs(args))``."""
    return {f.name: getattr(args, f.name) for f in flag_fields() if f.name != "model_path"}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The :class:`~breakgraph.engine.config.EngineConfig` the flags of :func:`add_engine_arguments` describe."""
    return EngineConfig(model_path=args.model_path, **engine_kwargs(args))


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


DEFAULT_PROMPT = "Question: Tom has 17 apples and buys 26 more. How many apples does he have?\nAnswer:"


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
    engine = Engine(engine_config(args))
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
    from breakgraph import env

    parser = argparse.ArgumentParser(
        prog="breakgraph", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="environment variables (read where they act; a bad value is refused by name):\n" + env.describe(),
    )  # fmt: skip
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
