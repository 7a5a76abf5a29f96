"""The command line a benchmark records beside its numbers, so the run can be repeated."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable


def command_line(words: list[str], add_arguments: Callable[[argparse.ArgumentParser], None], args: argparse.Namespace) -> str:
    """``words`` (e.g. ``["breakgraph", "bench", "prefill"]``) followed by every flag that
    ``add_arguments`` defines, at its value in ``args`` (defaults spelled out too, so the line
    repeats the run whatever the defaults become)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parts = list(words)
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        value = getattr(args, action.dest, action.default)
        flag = action.option_strings[0]
        if action.nargs == 0:  # a switch: given or not
            parts += [flag] if value else []
        elif value is not None:
            parts += [flag, *map(str, value if isinstance(value, list) else [value])]
    return shlex.join(parts)
