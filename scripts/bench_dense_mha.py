"""Micro-benchmark of dense-causal MLA in its two forms on ``glm5-tp8-rank`` shapes (8 heads,
r = 512, dn = 192, dr = 64, dv = 256, bf16, page 64, fresh prompts below K = 2048), µs per layer
and ms over 78 layers, medians of CUDA-graph replays, each from the latent query or latent keys
to the per-head values ``[T, H, dv]``:

* absorbed: ``q_nope·w_kc``, the dense-causal kernel the engine takes for such a batch
  (``sparse_mla_attention`` with causal rows), ``·w_vc``;
* MHA: the keys' projections ``c·[w_kc ‖ w_vc]ᵀ`` (one GEMM) and the MHA kernel
  (``breakgraph/kernels/triton_dense_mha.py``) — also the kernel alone, with its TFLOP/s of
  causal work (``2·pairs·H·(dn + dr + dv)``).

    python scripts/bench_dense_mha.py --tokens 128 1024 2048 --sweep --budget 60
    python scripts/bench_dense_mha.py --aot     # no GPU: sm_90a registers / spills of each tile

``--sweep`` times the MHA kernel's tiles (query rows, key block, warps, stages, keys per
program where a block's keys are cut across programs) and prints each
one's time and its error against the default's output; the table comes last.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernels_attention import bench  # noqa: E402

HEADS, RANK, DN, DR, DV, TOPK, LAYERS, PAGE = 8, 512, 192, 64, 256, 2048, 78, 64
SCALE = (DN + DR) ** -0.5
# (BLOCK_M, BLOCK_N, num_warps, num_stages, CHUNK keys: 0 = a block's keys in one program)
TILES = [(64, 64, 4, 2, 0), (128, 64, 8, 2, 0), (64, 64, 8, 2, 0), (64, 64, 4, 3, 0), (64, 64, 8, 2, 512),
         (64, 64, 8, 2, 256), (64, 64, 8, 2, 384), (128, 64, 8, 2, 512), (128, 64, 8, 2, 256),
         (128, 64, 8, 2, 768), (64, 64, 4, 2, 512), (64, 64, 4, 2, 256)]  # fmt: skip


def make_case(tokens: int, seed: int = 0) -> dict:
    """A fresh prompt of ``tokens`` tokens: latent rows in a paged bf16 cache (shuffled pages),
    queries, ``w_kc``/``w_vc`` (views of one ``w_kv``, as the layer holds them) scaled like trained weights."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    width = -(-(tokens + 64) // PAGE)
    table = (torch.randperm(width, device="cuda", generator=g) + 1).int()[None, :]
    kv_new = rnd(tokens, RANK + DR).bfloat16()
    pos = torch.arange(tokens, device="cuda")
    cache = rnd((width + 1) * PAGE, RANK + DR).bfloat16()
    cache[table[0, pos // PAGE].long() * PAGE + pos % PAGE] = kv_new
    q = rnd(tokens, HEADS, DN + DR).bfloat16()
    q_full = rnd(tokens, HEADS, RANK + DR).bfloat16()
    q_full[..., RANK:] = q[..., DN:]
    w_kv = (rnd(HEADS * (DN + DV), RANK) * RANK**-0.5).bfloat16()  # w_kc's rows, then w_vc's (as the layer holds them)
    projected = torch.empty(tokens, HEADS * (DN + DV), dtype=torch.bfloat16, device="cuda")  # k_nope ‖ v
    return dict(
        q=q, q_full=q_full, kv=kv_new, cache=cache, table=table, pos=pos, req=torch.zeros_like(pos),
        w_kv=w_kv, w_kc=w_kv[: HEADS * DN].view(HEADS, DN, RANK), w_vc=w_kv[HEADS * DN :].view(HEADS, DV, RANK),
        topk=torch.empty(tokens, TOPK, dtype=torch.int32, device="cuda"),
        out=torch.empty(tokens, HEADS, DV, dtype=torch.bfloat16, device="cuda"),
        attn=torch.empty(tokens, HEADS, RANK, dtype=torch.bfloat16, device="cuda"),
        k_nope=projected[:, : HEADS * DN].view(tokens, HEADS, DN), v=projected[:, HEADS * DN :].view(tokens, HEADS, DV),
        projected=projected,
    )  # fmt: skip


def absorbed(c: dict) -> None:
    from breakgraph.kernels.linear import bmm_into
    from breakgraph.kernels.sparse_mla import sparse_mla_attention

    t = c["q"].shape[0]
    bmm_into(c["q"][..., :DN].transpose(0, 1), c["w_kc"], c["q_full"][..., :RANK].transpose(0, 1))
    sparse_mla_attention(
        c["q_full"], c["cache"], c["topk"], c["table"], c["req"], PAGE, SCALE, c["attn"], positions=c["pos"],
        dense_below=TOPK, request_tokens=[t], packed_rows=True, causal_rows=True,
    )  # fmt: skip
    bmm_into(c["attn"].transpose(0, 1), c["w_vc"].transpose(1, 2), c["out"].transpose(0, 1))


def projections(c: dict) -> None:
    torch.matmul(c["kv"][:, :RANK], c["w_kv"].t(), out=c["projected"])  # one GEMM: k_nope ‖ v


def mha_kernel(c: dict, config: dict | None = None) -> None:
    from breakgraph.kernels.triton_dense_mha import dense_causal_mha_triton

    dense_causal_mha_triton(
        c["q"][..., :DN], c["q_full"][..., RANK:], c["k_nope"], c["kv"][:, RANK:], c["v"], c["pos"], None, SCALE,
        c["out"], config=config,
    )  # fmt: skip


def mha(c: dict) -> None:
    projections(c)
    mha_kernel(c)


def run(args) -> None:
    from breakgraph.kernels.dense_mha import dense_causal_mha_ref

    results: dict[int, dict[str, float]] = {}
    begin = time.monotonic()
    cases = {}
    for tokens in args.tokens:
        c = cases[tokens] = make_case(tokens, seed=tokens)
        res = results[tokens] = {}
        res["absorbed"] = bench(partial(absorbed, c), rep=40)
        want = c["out"].float().clone()
        res["mha"] = bench(partial(mha, c), rep=40)
        got = c["out"].float().clone()
        ref = torch.empty(tokens, HEADS, DV, device="cuda")
        qn, qp = c["q"][..., :DN].float(), c["q"][..., DN:].float()
        dense_causal_mha_ref(qn, qp, c["k_nope"].float(), c["kv"][:, RANK:].float(), c["v"].float(), c["pos"], None,
                             SCALE, ref)  # fmt: skip
        err = partial(lambda x, r: ((x - r).norm() / r.norm()).item(), r=ref)
        res["mha kernel"] = bench(partial(mha_kernel, c), rep=40)
        c["want"] = c["out"].float().clone()
        print(f"    T={tokens}: absorbed {res['absorbed'] * 1e3:.1f} µs, MHA {res['mha'] * 1e3:.1f} µs (kernel "
              f"{res['mha kernel'] * 1e3:.1f}); error vs the fp32 MHA twin: MHA {err(got):.1e}, absorbed "
              f"{err(want):.1e} (different rounding of the same attention)", flush=True)  # fmt: skip
    if args.sweep:
        for tile, tokens in itertools.product(TILES, args.tokens):
            if args.budget and time.monotonic() - begin > args.budget:
                print(f"    budget of {args.budget:.0f} s spent: the rest of the sweep skipped", flush=True)
                break
            c = cases[tokens]
            cfg = dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "CHUNK"), tile))
            c["out"].fill_(float("nan"))
            try:
                t = bench(partial(mha_kernel, c, cfg), rep=40)
            except Exception as e:  # noqa: BLE001 — e.g. out of shared memory
                print(f"    T={tokens} {cfg}: {type(e).__name__} {str(e)[:120]}", flush=True)
                continue
            d = ((c["out"].float() - c["want"]).norm() / c["want"].norm()).item()
            results[tokens][f"kernel {tile}"] = t
            print(f"    T={tokens} kernel {tile}: {t * 1e3:.1f} µs, vs default {d:.1e}", flush=True)
    print(f"\ndense-causal MLA, fresh prompts, {HEADS} heads, bf16: µs per layer (ms over {LAYERS} layers)")
    print(f"{'tokens':>6} {'absorbed':>9} {'MHA':>7} {'kernel':>7} {'TFLOP/s':>7} {'best tile':>9} {'abs. ms':>7} "
          f"{'MHA ms':>7}  best tile (BLOCK_M, BLOCK_N, warps, stages, CHUNK)")  # fmt: skip
    for tokens, res in results.items():
        pairs = tokens * (tokens + 1) // 2
        flops = 2 * pairs * HEADS * (DN + DR + DV)
        tiles = {k: v for k, v in res.items() if k.startswith("kernel ")}
        best = min(tiles, key=tiles.get) if tiles else "kernel -"
        print(f"{tokens:>6} {res['absorbed'] * 1e3:9.1f} {res['mha'] * 1e3:7.1f} {res['mha kernel'] * 1e3:7.1f} "
              f"{flops / (res['mha kernel'] * 1e-3) / 1e12:7.0f} {tiles.get(best, float('nan')) * 1e3:9.1f} "
              f"{res['absorbed'] * LAYERS:7.2f} {res['mha'] * LAYERS:7.2f}  {best[7:]}")  # fmt: skip


def run_aot() -> None:
    from breakgraph.kernels import aot
    from breakgraph.kernels import triton_dense_mha as tdm

    args = dict(
        QN="*bf16", QP="*bf16", KN="*bf16", KP="*bf16", V="*bf16", OUT="*bf16", POSITIONS="*i64", KEY_ROWS="*i64",
        WS_O="*fp32", WS_LSE="*fp32", stride_qnt=HEADS * (DN + DR), stride_qnh=DN + DR, stride_qpt=HEADS * (RANK + DR), stride_qph=RANK + DR,
        stride_knt=HEADS * DN, stride_knh=DN, stride_kpt=RANK + DR, stride_vt=HEADS * DV, stride_vh=DV,
        stride_ot=HEADS * DV, stride_oh=DV, num_tokens=1000, dn=DN, dr=DR, dv=DV, qk_scale=0.1, chunk_keys=512,
    )  # fmt: skip
    for bm, bn, warps, stages, chunk in TILES:
        consts = dict(D1=128, D2=64, DR=DR, DV=DV, HAS_KEY_ROWS=False, BLOCK_M=bm, BLOCK_N=bn, SPLIT=chunk > 0)
        try:
            info = aot.compile_for_sm90(tdm._dense_mha_fwd_kernel, args, consts, warps, stages)
        except Exception as e:  # noqa: BLE001
            print(f"({bm}, {bn}, {warps}, {stages}, {chunk}): {type(e).__name__} {str(e)[:120]}")
            continue
        print(f"({bm}, {bn}, {warps}, {stages}, {chunk}): {info['regs']} registers, {info['stack']} bytes of stack, "
              f"mma {info['mma']}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 2048], help="prompt lengths (default 128 1024 2048)")
    p.add_argument("--sweep", action="store_true", help="also time the MHA kernel's tiles")
    p.add_argument("--budget", type=float, default=0.0, help="seconds for the whole run; past it the sweep stops")
    p.add_argument("--aot", action="store_true", help="compile for sm_90a only (no GPU) and print resources")
    args = p.parse_args()
    if args.aot:
        run_aot()
    else:
        run(args)


if __name__ == "__main__":
    main()
