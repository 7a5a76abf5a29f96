"""Compiling Triton kernels ahead in worker processes (breakgraph/kernels/precompile.py): a
worker's compile of a recorded specialisation lands under the cache key the launch reads (CPU:
the sm_90a compile needs no GPU; skipped where Triton bundles no ptxas)."""

from __future__ import annotations

import pytest

from breakgraph.kernels import precompile


def _act_quant_specialisation():
    triton = pytest.importorskip("triton")
    from breakgraph.kernels import aot, triton_fp8

    if not aot.tools_available():
        pytest.skip("this triton has no bundled ptxas")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    fn = triton_fp8._act_quant_kernel
    named = {p.name: (p.default if p.has_default else 128) for p in fn.params if p.is_constexpr}
    named.update(INTERP=False)
    # as the JIT keys them: constants and attributes by argument path, the signature by name
    consts = {(i,): named[name] for i, name in enumerate(fn.arg_names) if name in named}
    sig = {name: ("constexpr" if name in named else ("*bf16" if "ptr" in name else "i32")) for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if "ptr" in name}
    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options({"num_warps": 4, "num_stages": 3})
    return triton, fn, sig, consts, attrs, target, options


def test_a_worker_compiles_under_the_key_the_launch_reads(tmp_path, monkeypatch):
    triton, fn, sig, consts, attrs, target, options = _act_quant_specialisation()
    from triton.compiler import ASTSource
    from triton.runtime.jit import serialize_specialization_data

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    data = serialize_specialization_data(fn.__name__, sig, consts, attrs, options, "key")
    precompile.compile_record((fn.fn.__module__, fn.fn.__qualname__, data), (target.backend, target.arch, 32))
    written = sorted(tmp_path.rglob("*"))
    assert any(p.suffix == ".cubin" for p in written)
    # what JITFunction._do_compile does at the launch: a cache hit writes nothing new
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=target, options=options.__dict__)
    assert sorted(tmp_path.rglob("*")) == written and kernel.asm["cubin"]


def test_ahead_compiler_counts_what_compiled(tmp_path, monkeypatch):
    _, fn, sig, consts, attrs, target, options = _act_quant_specialisation()
    from triton.runtime.jit import serialize_specialization_data

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    good = (fn.fn.__module__, fn.fn.__qualname__, serialize_specialization_data(fn.__name__, sig, consts, attrs, options, "k"))
    bad = (fn.fn.__module__, "no_such_kernel", good[2])
    ahead = precompile.AheadCompiler(2, target=(target.backend, target.arch, 32))
    try:
        assert ahead.compile([good, bad]) == 1 and ahead.compile([]) == 0
        assert (ahead.recorded, ahead.compiled) == (2, 1)
    finally:
        ahead.close()
    assert ahead.compile([good]) == 0, "closed: nothing more is compiled ahead"


def test_zero_fill_zeroes_new_tensors_only_inside():
    import torch

    for _ in range(8):  # leave freed memory of these sizes holding non-zeros
        dirty = [torch.full((n,), 7.0) for n in (64, 8, 16)] + [torch.full((4, 4), 7.0)]
        del dirty
    with precompile.zero_fill():
        made = [torch.empty(64), torch.empty_like(torch.ones(8)), torch.ones(4).new_empty(16), torch.empty_strided((4, 4), (4, 1))]
    assert all(bool((t == 0).all()) for t in made)


def test_run_dry_skips_without_the_hook_and_runs_every_thunk_past_a_failing_one(monkeypatch):
    import types

    ahead = precompile.AheadCompiler(1, target=("cuda", 90, 32))
    try:
        monkeypatch.setattr(precompile, "triton_runtime_knobs", lambda: None)
        ran = []
        ahead.run_dry(lambda: ran.append(1))
        assert ran == [], "no Triton hook: no dry run"
        runtime = types.SimpleNamespace(jit_cache_hook=None)
        monkeypatch.setattr(precompile, "triton_runtime_knobs", lambda: runtime)

        def thunk():
            ran.append(2)
            raise RuntimeError("a dry run met something")

        ahead.run_dry(thunk, lambda: ran.append(3))  # logged, not raised; the next thunk still runs
        assert ran == [2, 3] and runtime.jit_cache_hook is None
    finally:
        ahead.close()


def test_recording_without_the_triton_hook_yields_none(monkeypatch):
    monkeypatch.setattr(precompile, "triton_runtime_knobs", lambda: None)
    with precompile.recording() as records:
        assert records is None


def test_recording_keeps_each_specialisation_once_and_skips_the_launch(monkeypatch):
    import types

    runtime = types.SimpleNamespace(jit_cache_hook=None)
    monkeypatch.setattr(precompile, "triton_runtime_knobs", lambda: runtime)
    fn = types.SimpleNamespace(module="m", name="k")
    with precompile.recording() as records:
        for key in ("a", "b", "a"):
            assert runtime.jit_cache_hook(fn=fn, key=key, compile={"specialization_data": key}) is True
    assert records == [("m", "k", "a"), ("m", "k", "b")] and runtime.jit_cache_hook is None
    assert precompile.default_workers() >= 1 and precompile.default_workers(share=10_000) == 1
    monkeypatch.setattr(precompile.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert precompile.default_workers() == 7 and precompile.default_workers(share=2) == 3  # CPUs / share - 1


def test_the_model_runner_compiles_ahead_unless_told_not_to(monkeypatch):
    import types

    from breakgraph.engine import model_runner
    from breakgraph.engine.config import EngineConfig

    made = []
    monkeypatch.setattr(precompile, "triton_runtime_knobs", lambda: types.SimpleNamespace(jit_cache_hook=None))
    monkeypatch.setattr(precompile, "AheadCompiler", lambda workers: made.append(workers) or "pool")
    monkeypatch.setenv("BREAKGRAPH_COMPILE_AHEAD", "0")
    assert model_runner._ahead_compiler(EngineConfig()) is None and made == []
    monkeypatch.setenv("BREAKGRAPH_COMPILE_AHEAD", "1")
    assert model_runner._ahead_compiler(EngineConfig(tp_size=1)) == "pool" and made == [precompile.default_workers()]
    runner = object.__new__(model_runner.ModelRunner)  # only what _prepare reads
    runner._ahead = types.SimpleNamespace(run_dry="dry run")
    assert runner._prepare == "dry run"
    monkeypatch.setenv("BREAKGRAPH_COMPILE_AHEAD", "fp8")
    assert model_runner._ahead_compiler(EngineConfig()) == "pool" and runner._prepare is None, "fp8: no graph dry runs"
    monkeypatch.setattr(precompile, "triton_runtime_knobs", lambda: None)
    assert model_runner._ahead_compiler(EngineConfig()) is None, "no Triton hook: nothing to compile ahead"


def test_a_loaded_record_launches_without_a_cache_miss(tmp_path, monkeypatch):
    """After a dry run's record is compiled and loaded, launching the same specialisation finds
    it in the process's own kernel cache: the hook a graph capture's guard uses does not fire
    (before loading it fires, although the kernel is on disk)."""
    pytest.importorskip("triton")
    import torch
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    from breakgraph.kernels import aot, triton_norm

    if not aot.tools_available():
        pytest.skip("this triton has no bundled ptxas")
    if precompile.triton_runtime_knobs() is None:
        pytest.skip("this triton has no jit_cache_hook")

    class Sm90:  # stands in for the H200's driver: compiles need no GPU
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(driver, "_active", Sm90())
    fn = triton_norm._rms_norm_kernel
    fn.device_caches.clear()
    m, n = 48, 512
    x = torch.zeros(m, n, dtype=torch.bfloat16)
    w = torch.zeros(n, dtype=torch.bfloat16)
    out = torch.empty_like(x)

    def launch():  # compile (from the caches) without running, as a warm-up does
        fn.run(x, None, w, out, None, None, None, m, n, n, 0, 0, 0, 1.0 / n, 1e-6, HAS_RESIDUAL=False,
               QUANT=False, GROUP=128, BLOCK=512, INTERP=False, num_warps=4, PDL=False, grid=(m,), warmup=True)  # fmt: skip

    misses: list[str] = []
    try:
        with precompile.recording() as records:
            launch()
        assert len(records) == 1
        precompile.compile_record(records[0], ("cuda", 90, 32))
        with monkeypatch.context() as patch:
            patch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: misses.append(kw["fn"].name))
            launch()
        assert misses == ["_rms_norm_kernel"], "compiled to disk only: the process's cache still misses"
        fn.device_caches.clear()
        misses.clear()
        assert precompile.load_record(records[0])
        with monkeypatch.context() as patch:
            patch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: misses.append(kw["fn"].name))
            launch()
        assert misses == [], "loaded: the launch must find it in the process's cache"
    finally:
        fn.device_caches.clear()
