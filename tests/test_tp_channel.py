"""The tensor-parallel command channel: it listens on loopback only, and a worker runs only the
commands its own rank 0 signed, of the fixed schema — nothing it reads is unpickled."""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from breakgraph import Engine, SamplingParams
from breakgraph.engine import tp_channel
from breakgraph.engine.tp_channel import CommandRefused, batch_header, sign, verify
from breakgraph.engine.tp_launch import TensorParallelError, torchrun_key
from breakgraph.forward_context import ForwardMode

KEY = bytes(range(32))
COMMON = {"device": "cpu", "dtype": "float32", "page_size": 4}


def header() -> dict:
    from breakgraph.forward_context import ForwardBatch

    t = torch.arange(3)
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=t, positions=t, token_req=torch.zeros(3, dtype=torch.int64),
        out_cache_loc=t, page_table=torch.ones(1, 1, dtype=torch.int32), seq_lens=torch.tensor([3], dtype=torch.int32),
        seq_lens_cpu=[3], prefix_lens_cpu=[0], extend_lens_cpu=[3], kv_cache=None,
    )  # fmt: skip
    return batch_header(batch)[0]


def test_a_signed_command_of_the_schema_is_accepted():
    value = sign(KEY, 7, "forward", {"all_logits": False, "batch": header()})
    method, args = verify(KEY, value, 7)
    assert method == "forward" and args["batch"]["mode"] == "extend"
    assert verify(KEY, sign(KEY, 8, "shutdown", {}), 8) == ("shutdown", {})


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (sign(bytes(32), 1, "shutdown", {}), "signature"),  # another job's key
        (sign(KEY, 1, "shutdown", {}).replace(b'"seq":1', b'"seq":2'), "signature"),  # tampered body
        (pickle.dumps(("shutdown",)), "signature"),  # the old pickled command
        (b"", "signature"),
        (sign(KEY, 2, "shutdown", {}), "command number 2 where 1 was due"),  # replayed or reordered
        (sign(KEY, 1, "exec", {"code": "print(1)"}), "unknown method 'exec'"),
        (sign(KEY, 1, "shutdown", {"now": True}), "exactly the arguments"),
        (sign(KEY, 1, "forward", {"all_logits": 1, "batch": {}}), "argument 'all_logits'"),
        (sign(KEY, 1, "forward", {"all_logits": True, "batch": {"mode": "extend"}}), "argument 'batch'"),
        (sign(KEY, 1, "set_prefill_backend", {"backend": "rm -rf", "buckets": None, "max_bucket": None}),
         "argument 'backend'"),
        (sign(KEY, 1, "set_prefill_backend", {"backend": "breakable", "buckets": [-16], "max_bucket": None}),
         "argument 'buckets'"),
    ],
)  # fmt: skip
def test_a_forged_or_malformed_command_is_refused(value, why):
    with pytest.raises(CommandRefused, match=why):
        verify(KEY, value, 1)


def test_a_signed_body_that_is_not_json_or_not_an_object_is_refused():
    import hashlib
    import hmac

    for body in (b"[" * 100_000, b"\x80\x04", b"[1, 2]"):
        value = hmac.new(KEY, body, hashlib.sha256).hexdigest().encode() + b"." + body
        with pytest.raises(CommandRefused):
            verify(KEY, value, 1)
    with pytest.raises(CommandRefused, match="bytes"):
        verify(KEY, b"0" * (tp_channel.MAX_COMMAND_BYTES + 1), 1)


def test_torchrun_needs_the_jobs_secret(monkeypatch):
    monkeypatch.delenv("BREAKGRAPH_TP_SECRET", raising=False)
    with pytest.raises(TensorParallelError, match="BREAKGRAPH_TP_SECRET"):
        torchrun_key()
    monkeypatch.setenv("BREAKGRAPH_TP_SECRET", "ab" * 32)
    assert torchrun_key() == bytes.fromhex("ab" * 32)


def listening_addresses(pid: int) -> list[str]:
    """``host:port`` of every TCP socket process ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            host, port = cols[1].split(":")
            raw = bytes.fromhex(host)
            if table == "tcp":
                addr = ".".join(str(b) for b in raw[::-1])
            else:  # four little-endian 32-bit words
                addr = ":".join(raw[i : i + 4][::-1].hex() for i in range(0, 16, 4))
            found.append(f"{addr}:{int(port, 16)}")
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_tp_listens_on_loopback_only_and_refuses_a_forged_command(hf_checkpoints, tmp_path):
    engine = Engine(hf_checkpoints["glm_moe_dsa"], tp_size=2, **COMMON)
    try:
        params = SamplingParams(max_new_tokens=2, ignore_eos=True)
        assert engine.generate([[1, 2, 3]], params)[0].token_ids
        with pytest.raises(ValueError, match="argument 'buckets'"):  # refused on rank 0, nothing posted
            engine.set_prefill_backend("breakable", [16.5])
        assert engine.generate([[1, 2, 3]], params)[0].token_ids
        (pid,) = engine.tp.worker_pids
        port = engine.tp.store_port
        for p in (os.getpid(), pid):
            addresses = listening_addresses(p)
            assert addresses and all(a.startswith("127.0.0.1:") for a in addresses), (p, addresses)
        assert f"127.0.0.1:{port}" in listening_addresses(os.getpid())

        # Anyone on this host can reach the store; what they write is refused, never run.
        marker = tmp_path / "ran"

        class Payload:
            def __reduce__(self):
                return (Path.touch, (marker,))

        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
        commands = dist.PrefixStore("cmd/", client)
        nxt = str(engine.tp.channel._seq + 1)
        commands.set(nxt, pickle.dumps(Payload()))
        deadline = time.monotonic() + 30
        while engine.tp._procs[0][1].exitcode is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine.tp._procs[0][1].exitcode == 1, "the worker did not stop on a forged command"
        assert not marker.exists(), "the forged command ran"
        with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {pid}\) exited with code 1"):
            engine.generate([[1, 2, 3]], params)
    finally:
        engine.shutdown()
    assert not dist.is_initialized()
