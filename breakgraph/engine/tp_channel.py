"""Rank 0's commands to the other tensor-parallel ranks: a fixed schema, signed per job.

A command is one store value: ``<hex HMAC-SHA256>.<JSON body>``, the body
``{"seq": n, "method": name, "args": {...}}``. The HMAC key is a random secret of the job
(spawned ranks get it in their spawn arguments, torchrun ranks from ``BREAKGRAPH_TP_SECRET``),
never sent over the store. A worker checks the signature before it parses anything, then the
sequence number (a replayed or reordered command is refused), the method (a closed set) and
every argument's type (:data:`METHODS`); anything else raises :class:`CommandRefused`. Nothing
is unpickled: tensors travel as ``torch.distributed`` broadcasts, described by the header.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import typing
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch

from breakgraph.engine.config import PREFILL_BACKENDS
from breakgraph.forward_context import ForwardBatch, ForwardMode

MAX_COMMAND_BYTES = 1 << 24
TENSOR_DTYPES = ("int64", "int32")


class CommandRefused(ValueError):
    """A command that is not rank 0's, out of sequence, or not of the schema."""


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _int_list(v: Any) -> bool:
    return isinstance(v, list) and all(_int(x) for x in v)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _batch_header(v: Any) -> bool:
    try:
        batch_fields_from_header(v)
    except (CommandRefused, TypeError, KeyError, ValueError):
        return False
    return True


# method → {argument: type check}. Every argument is required; no other is accepted.
METHODS: dict[str, dict[str, Callable[[Any], bool]]] = {
    "forward": {"all_logits": lambda v: isinstance(v, bool), "batch": _batch_header},
    "set_prefill_backend": {
        "backend": lambda v: v in PREFILL_BACKENDS,
        "buckets": _optional(_int_list),
        "max_bucket": _optional(_int),
    },
    "shutdown": {},
}


def sign(key: bytes, seq: int, method: str, args: dict[str, Any]) -> bytes:
    """The store value of command ``seq``: ``method(**args)`` signed with ``key``."""
    body = json.dumps({"seq": seq, "method": method, "args": args}, separators=(",", ":")).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest().encode() + b"." + body


def verify(key: bytes, value: bytes, seq: int) -> tuple[str, dict[str, Any]]:
    """``(method, args)`` of a store value that must be command ``seq`` signed with ``key``;
    raises :class:`CommandRefused` saying why not."""
    if len(value) > MAX_COMMAND_BYTES:
        raise CommandRefused(f"command of {len(value)} bytes (most {MAX_COMMAND_BYTES})")
    mac, dot, body = bytes(value).partition(b".")
    want = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
    if not dot or not hmac.compare_digest(mac, want):
        raise CommandRefused("command signature does not match this job's key: not from this job's rank 0")
    try:
        message = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise CommandRefused(f"command is not JSON: {exc}") from None
    if not isinstance(message, dict) or set(message) != {"seq", "method", "args"}:
        raise CommandRefused("command must be an object with exactly seq, method and args")
    if message["seq"] != seq:
        raise CommandRefused(f"command number {message['seq']!r} where {seq} was due")
    check(message["method"], message["args"])
    return message["method"], message["args"]


def check(method: Any, args: Any) -> None:
    """Raise :class:`CommandRefused` unless ``method(**args)`` fits :data:`METHODS`."""
    if method not in METHODS:
        raise CommandRefused(f"unknown method {method!r} (known: {sorted(METHODS)})")
    schema = METHODS[method]
    if not isinstance(args, dict) or set(args) != set(schema):
        raise CommandRefused(f"{method} takes exactly the arguments {sorted(schema)}")
    for name, fits in schema.items():
        if not fits(args[name]):
            raise CommandRefused(f"{method}: argument {name!r} has the wrong type or value")


# -- ForwardBatch over the wire ------------------------------------------------------------------
def _batch_fields() -> dict[str, str]:
    """``{field: "tensor" | "mode" | "ints"}`` for every ForwardBatch field that is sent."""
    hints = typing.get_type_hints(ForwardBatch, include_extras=False, localns={"KVCache": object})
    kinds = {}
    for f in fields(ForwardBatch):
        hint = hints[f.name]
        if f.name in ("kv_cache", "length_bound", "derived"):  # each rank's own; a stand-in's; made per rank
            continue
        if hint is torch.Tensor:
            kinds[f.name] = "tensor"
        elif hint is ForwardMode:
            kinds[f.name] = "mode"
        elif hint == list[int]:
            kinds[f.name] = "ints"
        else:
            raise TypeError(f"ForwardBatch.{f.name}: {hint} cannot be sent to tensor-parallel workers")
    return kinds


BATCH_FIELDS = _batch_fields()


def batch_header(batch: ForwardBatch) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The header of ``batch`` (host values, and dtype and shape of each device tensor) and its
    tensors flattened to int64, in header order, for one packed broadcast."""
    header: dict[str, Any] = {}
    tensors = []
    for name, kind in BATCH_FIELDS.items():
        value = getattr(batch, name)
        if kind == "tensor":
            dtype = str(value.dtype).removeprefix("torch.")
            if dtype not in TENSOR_DTYPES:
                raise TypeError(f"ForwardBatch.{name} is {value.dtype}; only {TENSOR_DTYPES} tensors are sent to workers")
            header[name] = [dtype, list(value.shape)]
            tensors.append(value.reshape(-1).to(torch.int64))
        elif kind == "mode":
            header[name] = value.value
        else:
            header[name] = list(value)
    return header, tensors


def batch_fields_from_header(header: Any) -> dict[str, Any]:
    """Check a header against :data:`BATCH_FIELDS`: ``{field: host value}`` with, for tensor
    fields, ``(dtype, shape)``. Raises :class:`CommandRefused` naming the field."""
    if not isinstance(header, dict) or set(header) != set(BATCH_FIELDS):
        raise CommandRefused(f"a batch header has exactly the fields {sorted(BATCH_FIELDS)}")
    out: dict[str, Any] = {}
    for name, kind in BATCH_FIELDS.items():
        value = header[name]
        if kind == "tensor":
            ok = (
                isinstance(value, list) and len(value) == 2 and value[0] in TENSOR_DTYPES
                and _int_list(value[1]) and len(value[1]) <= 4
            )  # fmt: skip
            if not ok:
                raise CommandRefused(f"batch field {name!r} must be [dtype in {TENSOR_DTYPES}, shape]")
            out[name] = (getattr(torch, value[0]), tuple(value[1]))
        elif kind == "mode":
            try:
                out[name] = ForwardMode(value)
            except ValueError:
                raise CommandRefused(f"batch field {name!r}: unknown mode {value!r}") from None
        else:
            if not _int_list(value):
                raise CommandRefused(f"batch field {name!r} must be a list of non-negative ints")
            out[name] = value
    return out


def tensor_sizes(header: dict[str, Any]) -> list[int]:
    """Elements of each tensor of a checked header, in header order."""
    sizes = []
    for name, kind in BATCH_FIELDS.items():
        if kind == "tensor":
            n = 1
            for s in header[name][1]:
                n *= s
            sizes.append(n)
    return sizes


def batch_from_header(header: dict[str, Any], packed: torch.Tensor, kv_cache: Any) -> ForwardBatch:
    """The ForwardBatch a checked header and its packed int64 tensors describe, over ``kv_cache``."""
    spec = batch_fields_from_header(header)
    chunks = iter(packed.split(tensor_sizes(header)))
    values: dict[str, Any] = {"kv_cache": kv_cache}
    for name, kind in BATCH_FIELDS.items():
        if kind == "tensor":
            dtype, shape = spec[name]
            values[name] = next(chunks).view(shape).to(dtype)
        else:
            values[name] = spec[name]
    return ForwardBatch(**values)


class CommandChannel:
    """Signed commands through a store: rank 0 :meth:`post`\\ s command ``n`` under key ``n``,
    every worker :meth:`receive`\\ s them in order. ``store`` is a ``torch.distributed`` store
    (prefixed for this job), ``key`` the job's secret."""

    def __init__(self, store: Any, key: bytes) -> None:
        self._store = store
        self._key = key
        self._seq = 0
        self._last_sync = 0  # rank 0: the newest command every worker is known to have read
        self._deleted_through = 0  # rank 0: command keys deleted from the store so far

    def post(self, method: str, args: dict[str, Any]) -> None:
        """Rank 0: post ``method(**args)`` (checked against :data:`METHODS` first, so rank 0
        never sends what a worker would refuse)."""
        check(method, args)
        self._seq += 1
        self._store.set(str(self._seq), sign(self._key, self._seq, method, args))
        # Commands up to the last sync point were read by every worker; later ones may be unread.
        while self._deleted_through < self._last_sync:
            self._deleted_through += 1
            self._store.delete_key(str(self._deleted_through))

    def synced(self) -> None:
        """Rank 0: every worker has read the commands posted so far (a collective they all took
        part in has returned since)."""
        self._last_sync = self._seq

    def receive(self) -> tuple[str, dict[str, Any]]:
        """Workers: the next command, waiting for it; :class:`CommandRefused` if it is not rank 0's."""
        self._seq += 1
        return verify(self._key, self._store.get(str(self._seq)), self._seq)
