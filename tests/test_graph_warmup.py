"""The warm-up policy both graph runners share (breakgraph/graphs/warmup.py), on plain callables."""

from __future__ import annotations

import pytest
import torch

from breakgraph.graphs.jit_guard import CompileInCapture
from breakgraph.graphs.warmup import capture_ladder, warm_then_capture

CPU = torch.device("cpu")


@pytest.mark.parametrize("warmup, expected", [("once", [True, False, False]), ("every", [True, True, True])])
def test_once_warms_only_the_first_size_and_every_warms_all(warmup, expected):
    seen: list[tuple[int, bool]] = []
    capture_ladder([64, 16, 4], lambda n, warm: seen.append((n, warm)), lambda: None, warmup=warmup, device=CPU,
                   what="bucket")  # fmt: skip
    assert seen == list(zip([64, 16, 4], expected, strict=True))


def test_an_unwarmed_failure_restarts_the_ladder_with_every_size_warmed():
    calls: list[tuple[int, bool]] = []
    restarts: list[int] = []

    def capture_one(n: int, warm: bool) -> None:
        calls.append((n, warm))
        if n == 16 and not warm:
            raise RuntimeError("lazy init inside the capture")

    capture_ladder([64, 16, 4], capture_one, lambda: restarts.append(len(calls)), warmup="once", device=CPU,
                   what="bucket")  # fmt: skip
    assert restarts == [2]  # after the failed unwarmed capture of 16
    assert calls[2:] == [(64, True), (16, True), (4, True)]


def test_a_warmed_failure_or_retry_off_is_raised_as_it_is():
    def always_fails(n: int, warm: bool) -> None:
        raise RuntimeError(f"bad bucket {n}")

    with pytest.raises(RuntimeError, match="bad bucket 64"):
        capture_ladder([64, 16], always_fails, lambda: None, warmup="every", device=CPU, what="bucket")

    def fails_unwarmed(n: int, warm: bool) -> None:
        if not warm:
            raise RuntimeError(f"bad bucket {n}")

    with pytest.raises(RuntimeError, match="bad bucket 16"):
        capture_ladder([64, 16], fails_unwarmed, lambda: pytest.fail("no restart with retry off"), warmup="once",
                       device=CPU, what="bucket", retry=False)  # fmt: skip


def test_bad_warmup_name_is_named():
    with pytest.raises(ValueError, match="--cuda-graph-warmup"):
        capture_ladder([1], lambda n, w: None, lambda: None, warmup="sometimes", device=CPU, what="bucket")


def test_a_compile_met_in_an_unwarmed_capture_warms_up_and_captures_again():
    events: list[str] = []
    attempts = iter([CompileInCapture("_k"), "graph"])

    def capture() -> str:
        events.append("capture")
        result = next(attempts)
        if isinstance(result, Exception):
            raise result
        return result

    result, _, warmups = warm_then_capture(False, lambda: events.append("warm"), capture, "bucket 8")
    assert (result, warmups, events) == ("graph", 1, ["capture", "warm", "capture"])

    def compiles_again() -> str:
        raise CompileInCapture("_k")

    with pytest.raises(CompileInCapture):  # the warm-up should have compiled it: an error, not a loop
        warm_then_capture(True, lambda: None, compiles_again, "bucket 8")
