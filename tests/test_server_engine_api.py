"""The server drives the engine through ``Engine``'s public surface only.

A scan of ``breakgraph/server/*.py`` lists every ``engine.<name>`` the server touches (on
``engine``, ``self.engine``, ``app.state.engine``, names bound to those, and ``getattr`` with a
literal name) and compares it with the public surface: the methods and properties defined on
``Engine`` plus the data attributes its docstring names. The public methods the server needs
are checked against the internals they wrap on a real engine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import breakgraph.server
from breakgraph import Engine, SamplingParams
from breakgraph.engine.engine import KVUsage
from breakgraph.engine.sampling import SamplingParamError
from breakgraph.engine.scheduler import RequestTooLongError

SERVER = Path(breakgraph.server.__file__).parent
DATA_ATTRIBUTES = {"engine_config", "config", "model_path", "context_length", "dtype", "device", "tokenizer"}


def public_api() -> set[str]:
    return {name for name in vars(Engine) if not name.startswith("_")} | DATA_ATTRIBUTES


def _is_engine(node: ast.AST, aliases: set[str]) -> bool:
    return (isinstance(node, ast.Name) and node.id in aliases) or (
        isinstance(node, ast.Attribute) and node.attr == "engine"
    )


def engine_accesses(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` for every attribute of the engine that ``source`` reads, calls or sets."""
    tree = ast.parse(source)
    aliases = {"engine"}
    for node in ast.walk(tree):  # `eng = self.engine` makes `eng` an engine too
        if isinstance(node, ast.Assign) and _is_engine(node.value, aliases):
            aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_engine(node.value, aliases):
            found.append((node.lineno, node.attr))
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and node.args and _is_engine(node.args[0], aliases)
        ):  # fmt: skip
            name = node.args[1] if len(node.args) > 1 else None
            found.append((node.lineno, name.value if isinstance(name, ast.Constant) else "<computed name>"))
    return found


def test_the_scan_sees_internal_accesses():
    source = (
        "self.engine.scheduler.check(r)\n"
        "pool = engine.kv_cache.pool\n"
        "getattr(getattr(engine, 'tp', None), 'failure', None)\n"
        "eng = self.engine\n"
        "eng.runner.model\n"
        "app.state.engine.step()\n"
        "getattr(engine, name)\n"
    )
    assert sorted(engine_accesses(source)) == [
        (1, "scheduler"), (2, "kv_cache"), (3, "tp"), (5, "runner"), (6, "step"), (7, "<computed name>"),
    ]  # fmt: skip
    assert {"scheduler", "kv_cache", "tp", "runner"}.isdisjoint(public_api())


def test_server_uses_only_the_public_engine_api():
    allowed = public_api()
    used, bad = set(), []
    for path in sorted(SERVER.glob("*.py")):
        for line, name in engine_accesses(path.read_text()):
            used.add(name)
            if name not in allowed:
                bad.append(f"{path.name}:{line}: engine.{name}")
    assert not bad, "server code reaches into the engine's internals:\n" + "\n".join(bad)
    assert {"step", "add_request", "abort", "check_request", "kv_usage"} <= used  # the scan saw the server


@pytest.fixture(scope="module")
def engine():
    return Engine(None, device="cpu", dtype="float32", max_running_requests=1)


def test_documented_data_attributes_exist(engine):
    for name in DATA_ATTRIBUTES:
        assert name not in vars(Engine) and name in vars(engine), name


def test_check_request_raises_the_schedulers_errors_and_queues_nothing(engine):
    ctx = engine.context_length
    engine.check_request([1, 2, 3], SamplingParams(max_new_tokens=4))
    with pytest.raises(RequestTooLongError, match="empty"):
        engine.check_request([], SamplingParams())
    with pytest.raises(RequestTooLongError, match="context length"):
        engine.check_request([1] * ctx, SamplingParams(max_new_tokens=1))
    with pytest.raises(SamplingParamError) as err:
        engine.check_request([1], SamplingParams(stop_token_ids=[engine.config.vocab_size]))
    assert err.value.field == "stop_token_ids"
    assert not engine.has_unfinished() and engine.unfinished() == []


def test_counts_kv_usage_and_unfinished_follow_the_scheduler(engine):
    a = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=8, ignore_eos=True))
    b = engine.add_request([4, 5], SamplingParams(max_new_tokens=8, ignore_eos=True))
    try:
        assert (engine.num_waiting, engine.num_running) == (2, 0)
        assert engine.unfinished() == [a, b]
        engine.step()
        assert (engine.num_waiting, engine.num_running) == (1, 1)  # max_running_requests=1
        assert engine.unfinished() == [b, a]
        pool = engine.kv_cache.pool
        assert engine.kv_usage() == KVUsage(pool.num_used, pool.num_cached_idle, pool.capacity_pages)
        assert engine.kv_usage().used > 0
    finally:
        for req in engine.unfinished():
            engine.abort(req)
    assert (engine.num_waiting, engine.num_running, engine.kv_usage().used) == (0, 0, 0)


def test_prefix_caching_switch_and_tp_failure(engine):
    assert engine.tp_failure is None  # single process
    engine.set_prefix_caching(False)
    assert engine.scheduler.prefix_cache is None
    engine.set_prefix_caching(True)
    assert engine.scheduler.prefix_cache is not None
