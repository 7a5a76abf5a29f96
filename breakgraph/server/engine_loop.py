"""The engine thread: owns the :class:`~breakgraph.engine.engine.Engine` and runs its steps
off the HTTP event loop.

Everything that touches the engine (tokenizing, adding, stepping, aborting, detokenizing)
happens on this one thread, so the engine needs no locks. The HTTP side talks to it through
a thread-safe inbox of commands (``add`` a group of :class:`Handle` s, ``abort`` one, ``call``
a function on the engine thread);
results go back through each handle's ``sink``, which the HTTP side binds to
``loop.call_soon_threadsafe`` into an asyncio queue. Events per handle, in order: exactly one
:class:`Accepted` or :class:`Failed`; then :class:`Progress` events, the last of which has
``finish_reason`` set — or a :class:`Failed` if the engine fails meanwhile.

Failure policy: if ``engine.step()`` raises, every request inside the engine at that moment
gets :class:`Failed` (HTTP 500; the exception is logged, never sent), the engine's requests
are aborted so their pages return to the pool, and the loop goes on serving new requests.
:meth:`EngineLoop.health` reports the engine unhealthy after ``max_step_failures``
consecutive failed steps (until a step succeeds), while it is wedged (work is pending and the
engine thread has not come back from a step for ``stall_timeout_s``), and once the loop itself
has died (a bug outside ``step``; new requests are then refused with 503).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from breakgraph.engine.detokenizer import TokenPieces
from breakgraph.engine.request import Request, RequestStatus
from breakgraph.engine.sampling import SamplingParams
from breakgraph.engine.scheduler import RequestTooLongError
from breakgraph.server.metrics import ServerMetrics
from breakgraph.server.prompt_logprobs import PromptLogprobs
from breakgraph.server.protocol import APIError
from breakgraph.server.settings import ServerSettings

if TYPE_CHECKING:
    from breakgraph.engine.engine import Engine

logger = logging.getLogger(__name__)


@dataclass
class Accepted:
    """The request is in the engine; ``prompt_tokens`` is its tokenized length."""

    prompt_tokens: int


@dataclass
class PromptEcho:
    """The prompt as ``echo`` repeats it: its text and, when log-probabilities were asked
    for, each token's text, log-probability (``None`` for the first) and top alternatives."""

    text: str
    token_texts: list[str] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[str, float]] | None] = field(default_factory=list)


@dataclass
class Progress:
    """New tokens of one choice. ``text`` is the output text that may be shown now, following
    the previous event's (the request's detokenizer holds back a tail that could still begin a
    stop string; the deltas add up to the final text).
    ``token_texts``/``top_logprobs`` are filled only when log-probabilities were asked for;
    ``echo`` only in the first event of an ``echo`` request."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None
    cached_tokens: int
    token_texts: list[str] = field(default_factory=list)
    token_bytes: list[bytes] = field(default_factory=list)
    top_logprobs: list[list[tuple[str, float]]] = field(default_factory=list)
    echo: PromptEcho | None = None


@dataclass
class Failed:
    error: APIError


Event = Accepted | Progress | Failed


class Handle:
    """One engine request as the HTTP side sees it.

    ``prompt`` is text or token ids; ``max_tokens`` ``None`` means "as many as fit in the
    context". ``sink(event)`` must be thread-safe and must not block. ``prompt_field`` names
    the request field errors about the prompt should point at. ``echo``: the first event
    carries the prompt (:class:`PromptEcho`, with log-probabilities when ``top_logprobs`` is
    not ``None``).
    """

    def __init__(
        self,
        prompt: str | list[int],
        params: dict[str, Any],
        max_tokens: int | None,
        sink: Callable[[Event], None],
        *,
        prompt_field: str = "prompt",
        top_logprobs: int | None = None,
        echo: bool = False,
    ) -> None:
        self.prompt = prompt
        self.params = params
        self.max_tokens = max_tokens
        self.sink = sink
        self.prompt_field = prompt_field
        self.top_logprobs = top_logprobs
        self.echo = echo
        self.arrival = time.monotonic()
        # engine-thread state
        self.req: Request | None = None
        self.sent = 0
        self.first_token_time: float | None = None


class EngineLoop:
    """Runs ``engine`` on a daemon thread. ``max_queued``: most requests accepted but not yet
    running (``None``: unbounded); beyond it :meth:`submit` raises a 503 :class:`APIError`.
    ``max_step_failures`` (0: never) and ``stall_timeout_s``: see :meth:`health`."""

    def __init__(
        self,
        engine: Engine,
        metrics: ServerMetrics | None = None,
        max_queued: int | None = None,
        *,
        max_step_failures: int = ServerSettings.max_step_failures,
        stall_timeout_s: float = ServerSettings.stall_timeout_s,
    ) -> None:
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self.max_queued = max_queued
        self.max_step_failures = max_step_failures
        self.stall_timeout_s = stall_timeout_s
        self.step_failures = 0  # consecutive failed steps (engine thread writes)
        self._beat = time.monotonic()  # when the engine thread was last between steps
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0  # accepted by submit(), not yet running or finished (guarded by _lock)
        self._stop = threading.Event()
        self._closed = False  # set (under _lock) once the thread takes no more work
        self._thread = threading.Thread(target=self._run, name="breakgraph-engine", daemon=True)
        self._live: dict[Request, Handle] = {}  # engine thread only
        self._waiting: list[Handle] = []  # engine thread only: in the engine, not yet running
        self.error: BaseException | None = None  # what killed the loop, if anything
        self.stats: dict[str, Any] = {}
        self._stats_time = 0.0
        self._graph_stats = getattr(engine, "graph_stats", None)
        self._pieces = TokenPieces(engine.tokenizer)
        self._refresh_stats(force=True)

    # -- HTTP side ------------------------------------------------------------------------
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread; requests still in flight get a 503 ``Failed``."""
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def num_queued(self) -> int:
        return self._queued

    def health(self) -> str | None:
        """``None`` when healthy; else why not: ``"dead"`` (the loop has stopped), ``"failing"``
        (the last ``max_step_failures`` steps all raised), ``"tp_failed"`` (a tensor-parallel rank
        failed) or ``"wedged"`` (requests are in flight and the engine thread has not come back
        from a step for ``stall_timeout_s``)."""
        if not self.alive:
            return "dead"
        failure = self.engine.tp_failure
        if failure:
            logger.warning("health: tensor parallelism failed: %s", failure)
            return "tp_failed"
        if self.max_step_failures and self.step_failures >= self.max_step_failures:
            return "failing"
        busy = bool(self._live) or self._queued > 0
        if busy and time.monotonic() - self._beat > self.stall_timeout_s:
            return "wedged"
        return None

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine thread between steps; the future holds its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed or not self.alive:
                raise APIError(503, "the engine loop is not running", type="server_error", code="engine_unavailable")
            self._inbox.put(("call", (fn, future)))
        return future

    def submit(self, handles: list[Handle]) -> None:
        """Hand ``handles`` to the engine as one group: all are added, or all fail together."""
        if not self.alive:
            raise APIError(503, "the engine loop is not running", type="server_error", code="engine_unavailable")
        with self._lock:  # held across the put, so that a closing loop cannot miss this group
            if self._closed:
                raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
            if self.max_queued is not None and len(handles) > self.max_queued:
                raise APIError(
                    400,
                    f"this request makes {len(handles)} generations (prompts × n) but the queue holds "
                    f"{self.max_queued} (--max-queued-requests); send fewer at once",
                    param="n", code="too_many_generations",
                )  # fmt: skip
            if self.max_queued is not None and self._queued + len(handles) > self.max_queued:
                raise APIError(
                    503,
                    f"the server is overloaded: {self._queued} requests are already waiting and the queue holds "
                    f"{self.max_queued} (--max-queued-requests); retry later",
                    type="server_overloaded", code="queue_full",
                )  # fmt: skip
            self._queued += len(handles)
            self._inbox.put(("add", handles))

    def abort(self, handle: Handle) -> None:
        """Abort ``handle`` (a no-op once it has finished); its pages are freed."""
        self._inbox.put(("abort", handle))

    # -- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            device = getattr(self.engine, "device", None)
            if device is not None and device.type == "cuda" and device.index is not None:
                torch.cuda.set_device(device)  # the current device is per thread
            while not self._stop.is_set():
                self._beat = time.monotonic()
                self._drain(block=not self.engine.has_unfinished())
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished():
                    self._step()
                self._refresh_stats()
        except BaseException as exc:
            logger.exception("the engine loop died; the server now reports unhealthy")
            self.error = exc
            self._fail_all(APIError(500, "the engine loop died", type="server_error", code="engine_error"))
            self._stop.set()
        finally:
            self._fail_all(
                APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
            )
            with self._lock:
                self._closed = True
            self._fail_inbox()

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                kind, arg = cmd
                if kind == "add":
                    self._add(arg)
                elif kind == "abort":
                    self._abort(arg)
                elif kind == "call":
                    fn, future = arg
                    try:
                        future.set_result(fn())
                    except Exception as exc:  # noqa: BLE001 — the caller gets it
                        future.set_exception(exc)
                cmd = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _unqueue(self, n: int) -> None:
        with self._lock:
            self._queued -= n

    def _prepare(self, h: Handle) -> tuple[list[int], SamplingParams]:
        engine = self.engine
        try:
            ids = engine.tokenize(h.prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), param=h.prompt_field) from exc
        ctx = engine.context_length
        if not ids:
            raise APIError(400, f"'{h.prompt_field}' is empty after tokenization", param=h.prompt_field)
        if len(ids) >= ctx:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens but the context length is {ctx}, and at least one token must "
                "be generated; shorten the prompt",
                param=h.prompt_field, code="context_length_exceeded",
            )  # fmt: skip
        max_new = h.max_tokens if h.max_tokens is not None else ctx - len(ids)
        if len(ids) + max_new > ctx:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens and max_tokens is {max_new}: {len(ids) + max_new} > the context "
                f"length {ctx}; lower max_tokens to at most {ctx - len(ids)}",
                param="max_tokens", code="context_length_exceeded",
            )  # fmt: skip
        try:
            params = SamplingParams(max_new_tokens=max_new, **h.params)
            params.check_vocab(engine.config.vocab_size)
        except ValueError as exc:  # a SamplingParamError names its field
            raise APIError(400, str(exc), param=getattr(exc, "field", None)) from exc
        return ids, params

    def _add(self, handles: list[Handle]) -> None:
        try:
            prepared = [self._prepare(h) for h in handles]
            for ids, params in prepared:  # all or none: check every member before adding any
                self.engine.check_request(ids, params)
        except Exception as exc:  # noqa: BLE001 — every member of the group gets an answer, whatever failed
            if isinstance(exc, APIError):
                err = exc
            elif isinstance(exc, (RequestTooLongError, ValueError)):
                err = APIError(400, str(exc), param=handles[0].prompt_field)
            else:
                logger.exception("could not add a request group")
                err = APIError(500, "could not add the request", type="server_error", code="internal_error")
            self._unqueue(len(handles))
            for h in handles:
                h.sink(Failed(err))
            return
        for h, (ids, params) in zip(handles, prepared):
            req = self.engine.add_request(ids, params)
            req.top_logprobs_num = h.top_logprobs or 0
            if h.echo and h.top_logprobs is not None:  # set before the next step admits it
                req.prompt_logits = PromptLogprobs(req.prompt_ids, h.top_logprobs)
            h.req = req
            self._live[req] = h
            self._waiting.append(h)
            self.metrics.prompt_tokens.inc(len(req.prompt_ids))
            h.sink(Accepted(len(req.prompt_ids)))

    def _abort(self, h: Handle) -> None:
        req = h.req
        if req is None or req not in self._live:
            return
        self.engine.abort(req)
        self._finish(h)

    def _step(self) -> None:
        try:
            progressed = self.engine.step()
        except Exception:
            logger.exception("engine step failed; failing the %d requests in the engine", len(self._live))
            self.metrics.engine_errors.inc()
            self.step_failures += 1
            self._fail_all(APIError(500, "the engine failed while serving this request", type="server_error",
                                    code="engine_error"))  # fmt: skip
            return
        self.step_failures = 0
        self._beat = time.monotonic()
        # Requests the step admitted leave the queue's count before any client sees their
        # tokens: a client that saw one may count on its slot in the queue being free.
        if self._waiting:
            still = [
                h for h in self._waiting if h.req.status is RequestStatus.WAITING and h.req in self._live
            ]
            if len(still) != len(self._waiting):
                self._unqueue(len(self._waiting) - len(still))
                self._waiting = still
        for req in progressed:
            h = self._live.get(req)
            if h is not None:
                self._emit(h)
        if (
            len(self._live) > self.engine.num_waiting + self.engine.num_running
        ):  # finished outside step(): never leave one hanging
            for req, h in list(self._live.items()):
                if req.finished:
                    self._emit(h)

    def _token_text(self, token_id: int) -> str:
        return self._pieces.piece(token_id)[0]

    def _emit(self, h: Handle) -> None:
        req = h.req
        new_ids = req.output_ids[h.sent :]
        ev = Progress(
            token_ids=new_ids, logprobs=req.output_logprobs[h.sent :], text=req.detokenizer.stream_delta(req.finished),
            finish_reason=req.finish_reason if req.finished else None, cached_tokens=req.num_cached_tokens,
        )  # fmt: skip
        if h.echo and h.sent == 0:
            ev.echo = self._echo(h)
        if h.top_logprobs is not None:
            pieces = [self._pieces.piece(t) for t in new_ids]
            ev.token_texts = [text for text, _ in pieces]
            ev.token_bytes = [raw for _, raw in pieces]
            for pos in range(h.sent, len(req.output_ids)):
                alts = req.output_top_logprobs[pos] if pos < len(req.output_top_logprobs) else []
                ev.top_logprobs.append([(self._token_text(t), lp) for t, lp in alts[: h.top_logprobs]])
        now = time.monotonic()
        if new_ids:
            if h.first_token_time is None:
                h.first_token_time = now
                self.metrics.ttft.observe(now - h.arrival)
            self.metrics.generation_tokens.inc(len(new_ids))
        h.sent = len(req.output_ids)
        h.sink(ev)
        if req.finished:
            self._finish(h)

    def _echo(self, h: Handle) -> PromptEcho:
        req = h.req
        ids = req.prompt_ids
        text = h.prompt if isinstance(h.prompt, str) else self._decode(ids)
        echo = PromptEcho(text)
        collected = req.prompt_logits
        if isinstance(collected, PromptLogprobs):
            echo.token_texts = [self._token_text(t) for t in ids]
            echo.logprobs = [None, *collected.logprobs]
            echo.top_logprobs = [None, *([(self._token_text(t), lp) for t, lp in alts] for alts in collected.top_logprobs)]
            req.prompt_logits = None  # sent once
        return echo

    def _decode(self, ids: list[int]) -> str:
        tok = self.engine.tokenizer
        return tok.decode(ids) if tok is not None else ""

    def _finish(self, h: Handle) -> None:
        req = h.req
        self._live.pop(req, None)
        if h in self._waiting:
            self._waiting.remove(h)
            self._unqueue(1)
        now = time.monotonic()
        self.metrics.requests.labels(finish_reason=req.finish_reason or "abort").inc()
        self.metrics.cached_tokens.inc(req.num_cached_tokens)
        self.metrics.e2e.observe(now - h.arrival)
        if h.first_token_time is not None and len(req.output_ids) > 1:
            self.metrics.tpot.observe((now - h.first_token_time) / (len(req.output_ids) - 1))

    def _fail_all(self, error: APIError) -> None:
        for req, h in list(self._live.items()):
            try:
                self.engine.abort(req)
            except Exception:
                logger.exception("abort of %s failed", req.rid)
            self._finish(h)
            h.sink(Failed(error))
        for req in self.engine.unfinished():  # not ours (e.g. a health probe that lost its handle)
            try:
                self.engine.abort(req)
            except Exception:
                logger.exception("abort of %s failed", req.rid)

    def _fail_inbox(self) -> None:
        err = APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._unqueue(len(arg))
                for h in arg:
                    h.sink(Failed(err))
            elif kind == "call":
                arg[1].set_exception(err)

    def _refresh_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._stats_time < 0.1:
            return
        self._stats_time = now
        engine = self.engine
        kv = engine.kv_usage()
        graph = None
        if self._graph_stats is not None:
            try:
                graph = self._graph_stats()
            except Exception:
                logger.exception("engine.graph_stats() failed")
        self.stats = {
            "running": engine.num_running,
            "waiting": engine.num_waiting,
            "preemptions": engine.stats().preemptions,
            "pages_used": kv.used,
            "pages_cached": kv.cached,
            "pages_total": kv.total,
            "graph": graph,
        }
