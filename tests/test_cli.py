"""``breakgraph`` command line without its extras: every ``--help`` runs, a subcommand that needs
an extra names it, help texts state their defaults. (``.ci/check-base-install`` runs the same in a
fresh venv holding the base install only.)"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from importlib import metadata

import pytest

from breakgraph import cli

# The top-level modules of every extra's packages (pyproject.toml's optional-dependencies).
EXTRA_MODULES = ("httpx", "fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client", "matplotlib")


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, child in subs[0].choices.items():
        yield from _leaves(child, (*path, name))


def test_every_command_is_found():
    got = {path for path, _ in _leaves(cli.build_parser())}
    assert got == {("generate",), ("serve",), ("bench", "serve"), ("bench", "prefill"), ("bench", "decode"),
                   ("bench", "ttft"), ("bench", "itl"), ("bench", "model-folder"), ("eval", "gsm8k")}


def test_every_help_runs_when_the_extras_cannot_be_imported():
    """In a child process where importing any extra's package fails, each subcommand's --help
    still prints its flags (the modules import their extras only when they run)."""
    paths = [list(p) for p, _ in _leaves(cli.build_parser())]
    code = f"""
import contextlib, io, json, sys
for name in {EXTRA_MODULES!r}:
    sys.modules[name] = None  # makes `import name` raise ModuleNotFoundError
from breakgraph.cli import main
helps = {{}}
for path in {paths!r}:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([*path, "--help"])
        except SystemExit as exc:
            assert exc.code == 0, (path, exc.code)
    helps[" ".join(path)] = out.getvalue()
print(json.dumps(helps))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    helps = json.loads(r.stdout.strip().splitlines()[-1])
    assert "--port" in helps["serve"] and "--base-url" in helps["bench serve"]
    assert "--num-shots" in helps["eval gsm8k"] and "--backends" in helps["bench prefill"]
    assert "--max-new-tokens" in helps["generate"]


@pytest.mark.parametrize(("command", "extra"), [(["serve"], "serve"), (["bench", "serve"], "bench"),
                                                (["eval", "gsm8k"], "eval")])  # fmt: skip
def test_a_command_without_its_extra_says_which_to_install(command, extra, monkeypatch, capsys):
    real = metadata.distribution

    def without_httpx(name: str):
        if name == "httpx":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "distribution", without_httpx)
    module = importlib.import_module(cli.build_parser().parse_args(command).module)
    monkeypatch.setattr(module, "main", lambda args: pytest.fail(f"{command} ran without its extra"))
    assert cli.main(command) == 2
    err = capsys.readouterr().err
    assert f"breakgraph {' '.join(command)} needs the {extra} extra: pip install 'breakgraph[{extra}]'" in err
    assert "not installed: httpx" in err


def test_missing_extra_packages_reads_the_installed_metadata():
    assert cli.missing_extra_packages("serve") == []  # the test install holds every serving package
    assert cli.missing_extra_packages("no-such-extra") == []


def test_serve_help_states_every_default():
    parser = dict(_leaves(cli.build_parser()))[("serve",)]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            text = formatter._expand_help(action)
            assert "default:" in text.lower(), f"{action.option_strings[0]}: {text!r}"
    assert "(default: 30000)" in parser.format_help()


def test_top_level_help_lists_every_environment_variable_with_its_default():
    from breakgraph import env

    text = cli.build_parser().format_help()
    for name, knob in env.KNOBS.items():
        line = next((ln for ln in text.splitlines() if ln.strip().startswith(name + " ")), None)
        assert line is not None, f"{name} missing from breakgraph --help"
        assert (repr(knob.default) in line) if knob.default else ("unset by default" in line), line
