"""Micro-benchmark of the dense-causal MLA kernels (``breakgraph/kernels/triton_dense_mla.py``)
on ``glm5-tp8-rank`` shapes: bf16 latent cache, r = 512, dr = 64, K = 2048, fresh prompts (the
tokens below K run dense-causal), µs per layer and ms over 78 layers, medians of CUDA-graph
replays of the dense launcher alone: the chunked kernel (the default) against the balanced one.

    python scripts/bench_dense_mla.py --heads 8 --tokens 1024 8192 --pages 16 64 --sweep
    python scripts/bench_dense_mla.py --aot          # no GPU: sm_90a registers / spills per variant

The sweep tries the balanced kernel's key block / stages, forward grid (programs per head block)
and bf16 partials, and prints each variant's time and its difference from the chunked kernel's
output; the table comes last.
"""

from __future__ import annotations

import argparse
import itertools
import signal
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernels_attention import bench  # noqa: E402

RANK, ROPE, TOPK, LAYERS = 512, 64, 2048, 78
DEVICE = "cuda"
GLM5_SCALE = (192 + 64) ** -0.5
# (block_n, num_stages, programs per SM, partials in bf16): the balanced kernel's variants of --sweep
VARIANTS = [(64, 2, 1, True), (64, 2, 2, False), (64, 2, 0.5, False), (32, 3, 1, False), (32, 2, 1, False),
            (64, 3, 1, False)]  # fmt: skip


def make_case(heads: int, tokens: int, page: int, seed: int = 0):
    """A fresh prompt of ``tokens`` tokens on shuffled pages (page table as `bench prefill`
    sizes it: input + 64 tokens), bf16 queries and cache."""
    g = torch.Generator().manual_seed(seed)
    width = -(-(tokens + 64) // page)
    table = (torch.randperm(width, generator=g) + 1).int()[None, :]
    gd = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(tokens, heads, RANK + ROPE, generator=gd, device=DEVICE).bfloat16()
    kv = torch.randn((width + 1) * page, RANK + ROPE, generator=gd, device=DEVICE).bfloat16()
    req = torch.zeros(tokens, dtype=torch.int64, device=DEVICE)
    pos = torch.arange(tokens, dtype=torch.int64, device=DEVICE)
    return q, kv, table.to(DEVICE), req, pos



class _Stopped(BaseException):
    """SIGTERM (`timeout`) mid-run: not an Exception, so no variant's error handler takes it."""


def run(args) -> None:
    from breakgraph.kernels.dispatch import num_sms

    sms = num_sms(torch.device(DEVICE))
    cases = list(itertools.product(args.heads, args.tokens, args.pages))
    results: dict[tuple, dict[str, tuple[float, str]]] = {c: {} for c in cases}
    made = {}

    def measure(case, name, fn, opts=""):
        q, kv, pt, req, pos, out, want = made[case]
        rows = pos < TOPK
        out.fill_(float("nan"))
        try:
            t = bench(fn, rep=40)
        except Exception as e:  # noqa: BLE001 — e.g. out of shared memory
            print(f"    {case} {name}: {type(e).__name__} {str(e)[:160]}", flush=True)
            return
        got = out[rows].float()
        diff = float("nan") if want is None else ((got - want).norm() / want.norm()).item()
        results[case][name] = (t, opts)
        print(f"    H={case[0]} T={case[1]} page {case[2]}: {name:<50} {t * 1e3:8.1f} µs  vs chunked {diff:.1e}",
              flush=True)  # fmt: skip

    def stop(*_):
        raise _Stopped("stopped (SIGTERM)")

    signal.signal(signal.SIGTERM, stop)  # under `timeout`: still print the table of what ran
    try:
        measure_all(args, cases, made, measure, sms)
    except _Stopped as e:
        print(f"    {e}: the table holds what ran", flush=True)
    print_table(results)


def measure_all(args, cases, made, measure, sms) -> None:
    """Both kernels at their defaults at every shape, then the sweep (until ``args.budget``)."""
    from breakgraph.kernels.triton_dense_mla import balanced_config, dense_config, dense_mla_attention_triton

    begin = time.monotonic()
    for case in cases:
        heads, tokens, page = case
        q, kv, pt, req, pos = make_case(heads, tokens, page, seed=heads + tokens + page)
        out = torch.empty(tokens, heads, RANK, dtype=torch.bfloat16, device=DEVICE)
        made[case] = (q, kv, pt, req, pos, out, None)
        call = partial(dense_mla_attention_triton, q, kv, pt, req, pos, page, GLM5_SCALE, out, TOPK)
        max_keys = min(TOPK, pt.shape[1] * page)
        measure(case, "chunked", partial(call, balanced=False), str(dense_config(heads, tokens, max_keys, q.device, page)))
        made[case] = made[case][:6] + (out[pos < TOPK].float().clone(),)
        measure(case, "balanced", partial(call, balanced=True), str(balanced_config(heads, q.device)))
    if args.sweep:
        for (bn, st, per_sm, bf16), case in itertools.product(VARIANTS, cases):  # one compile, then every shape
            if args.budget and time.monotonic() - begin > args.budget:
                print(f"    budget of {args.budget:.0f} s spent: the rest of the sweep skipped", flush=True)
                break
            q, kv, pt, req, pos, out, _ = made[case]
            heads, _, page = case
            opts = dict(block_n=bn, num_stages=st, programs=max(1, int(sms * per_sm)) // max(1, -(-heads // 64)),
                        partial_dtype=torch.bfloat16 if bf16 else torch.float32)  # fmt: skip
            call = partial(dense_mla_attention_triton, q, kv, pt, req, pos, page, GLM5_SCALE, out, TOPK,
                           balanced=True, **opts)  # fmt: skip
            name = f"balanced bn {bn} st {st} programs {opts['programs']}" + (" bf16 partials" if bf16 else "")
            measure(case, name, call, str(opts))


def print_table(results: dict) -> None:
    print(f"\ndense-causal MLA, fresh prompts, bf16, K={TOPK}: µs per layer (ms over {LAYERS} layers)")
    print(f"{'H':>3} {'tokens':>6} {'page':>4} {'chunked':>8} {'balanced':>8} {'best':>8} {'chunked ms':>10} "
          f"{'best ms':>7}  best balanced variant")  # fmt: skip
    for (heads, tokens, page), res in results.items():
        nan = (float("nan"), "")
        chunked, balanced = res.get("chunked", nan)[0], res.get("balanced", nan)[0]
        name, (best_t, _) = min(((k, v) for k, v in res.items() if k != "chunked"), key=lambda kv: kv[1][0],
                                default=("-", nan))  # fmt: skip
        print(f"{heads:>3} {tokens:>6} {page:>4} {chunked * 1e3:8.1f} {balanced * 1e3:8.1f} {best_t * 1e3:8.1f} "
              f"{chunked * LAYERS:10.2f} {best_t * LAYERS:7.2f}  {name}")  # fmt: skip


def run_aot(args) -> None:
    from breakgraph.kernels.aot import compile_for_sm90
    from breakgraph.kernels.triton_dense_mla import (
        _dense_mla_balanced_kernel,
        _dense_mla_fwd_kernel,
        _pow2,
        balanced_config,
        dense_config,
    )

    print("sm_90a compile of the dense-causal forward kernels (bf16 cache; mma_loop_insts: per key block)")
    for heads, page in itertools.product(args.heads, args.pages):
        cfg = dense_config(heads, page_size=page)
        a = dict(Q="*bf16", KV="*bf16", PAGE_TABLE="*i32", TOKEN_REQ="*i64", POSITIONS="*i64", OUT="*bf16",
                 WS_O="*fp32", WS_LSE="*fp32", stride_qt=heads * 576, stride_qh=576, stride_kv=576, stride_pt=37,
                 stride_ot=heads * RANK, stride_oh=RANK, num_heads=heads, rank=RANK, rope_dim=ROPE, page_size=page,
                 dense_below=TOPK, chunk_keys=512)  # fmt: skip
        consts = dict(BLOCK_T=cfg["block_t"], HEADS=cfg["heads"], BLOCK_M=_pow2(cfg["block_t"] * cfg["heads"]),
                      BLOCK_N=cfg["block_n"], BLOCK_R=RANK, BLOCK_PE=ROPE, SPLIT=True, PAGE_BLOCKS=True)  # fmt: skip
        info = compile_for_sm90(_dense_mla_fwd_kernel, a, consts, cfg["num_warps"], cfg["num_stages"])
        print(f"  chunked H={heads} page {page} bn={cfg['block_n']} stages={cfg['num_stages']}: {info}", flush=True)
    for heads in args.heads:
        cfg = balanced_config(heads)
        a = dict(Q="*bf16", KV="*bf16", PAGE_TABLE="*i32", TOKEN_REQ="*i64", POSITIONS="*i64", START="*i32",
                 OUT="*bf16", WS_O="*fp32", WS_LSE="*fp32", stride_qt=heads * 576, stride_qh=576, stride_kv=576,
                 stride_pt=37, stride_ot=heads * RANK, stride_oh=RANK, num_heads=heads, rank=RANK, rope_dim=ROPE,
                 page_size=16, page_shift=4)  # fmt: skip
        for bn, st in sorted({(cfg["block_n"], cfg["num_stages"])} | {(v[0], v[1]) for v in VARIANTS}):
            consts = dict(BLOCK_T=cfg["block_t"], HEADS=cfg["heads"], BLOCK_M=_pow2(cfg["block_t"] * cfg["heads"]),
                          BLOCK_N=bn, BLOCK_R=RANK, BLOCK_PE=ROPE, POW2_PAGE=True, ROW32=True)  # fmt: skip
            info = compile_for_sm90(_dense_mla_balanced_kernel, a, consts, cfg["num_warps"], st)
            print(f"  balanced H={heads} (any page) bn={bn} stages={st}: {info}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, nargs="+", default=[8], help="query heads per rank (default 8)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192], help="prompt lengths (default 1024 8192)")
    p.add_argument("--pages", type=int, nargs="+", default=[16, 64], help="page sizes (default 16 64)")
    p.add_argument("--sweep", action="store_true", help="also time the variants (key block, stages, grid)")
    p.add_argument("--budget", type=float, default=0.0, help="seconds for the whole run; past it the sweep stops")
    p.add_argument("--aot", action="store_true", help="compile for sm_90a only (no GPU) and print resources")
    args = p.parse_args()
    if args.aot:
        run_aot(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
