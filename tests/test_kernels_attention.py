"""Sparse MLA attention and DSA indexer: Triton kernels against their plain-PyTorch twins.

CPU: every kernel runs under Triton's interpreter in a child process (``TRITON_INTERPRET=1``
must be set before a kernel is first launched, and the CUDA tests in this file need the real
compiler), on small ragged batches with shuffled pages and ``-1`` entries.
GPU (``-m cuda``): GLM-5 shapes (H = 8, 16 and 64, r = 512, dr = 64, K = 2048, Hi = 32,
Di = 128), prefill and decode, and capture in a CUDA graph.

Error bounds (‖out − ref‖ / ‖ref‖, float64):
- same precision (fp32 in, interpreter): ≤ 1e-5;
- sparse MLA in bf16: the twin itself rounds the logits to bf16 (its einsum runs in bf16),
  so the reference is the twin on fp32 inputs, and the kernel must stay within 2× the error
  of merely rounding that reference to bf16 (the output dtype);
- indexer bf16 scores: ≤ 1e-4 of the fp32 twin; FP8 scores: ≤ 1e-3 of an exact emulation
  of the e4m3 quantisation and ≤ 6e-2 of the unquantised scores (e4m3 keeps 3 mantissa bits:
  ~3.5 % is the quantisation floor on Gaussian data);
- top-k: the chosen sets are compared through their exact scores (sorted), so ties and
  FP8 reorderings within tolerance pass and anything else fails.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cuda_capture import warmed_graph

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# ---------------------------------------------------------------------------------------
# Inputs shared by the interpreter and GPU checks
# ---------------------------------------------------------------------------------------


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "output has NaN (unwritten or broken rows)"
    return ((out - ref).norm() / ref.norm()).item()


def make_batch(
    prefix_lens: list[int],
    extend_lens: list[int],
    page_size: int,
    device="cpu",
    spare_pages: int = 5,
    seed: int = 0,
) -> dict:
    """A ragged batch laid out like the engine's: tokens of a request are contiguous; each
    request owns shuffled pages (never page 0); the page table is padded with 0."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages_per_req = [-(-n // page_size) for n in seq_lens]
    width = max(pages_per_req)
    num_pages = 1 + sum(pages_per_req) + spare_pages
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_req):
        table[b, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    token_req = torch.cat([torch.full((e,), b, dtype=torch.int64) for b, e in enumerate(extend_lens)])
    positions = torch.cat(
        [torch.arange(p, p + e, dtype=torch.int64) for p, e in zip(prefix_lens, extend_lens)]
    )
    return {
        "page_table": table.to(device),
        "token_req": token_req.to(device),
        "positions": positions.to(device),
        "page_size": page_size,
        "num_slots": num_pages * page_size,
    }


def random_topk(positions: torch.Tensor, topk: int, max_len: int, seed: int = 0) -> torch.Tensor:
    """``[T, K]`` int32: ``min(K, pos+1)`` distinct causal positions per token (always the
    token itself) at random columns, ``-1`` elsewhere."""
    g = torch.Generator().manual_seed(seed)
    pos = positions.cpu()
    num = pos.shape[0]
    key = torch.rand(num, max_len, generator=g)
    j = torch.arange(max_len)
    key = key.masked_fill(j[None, :] > pos[:, None], -1.0)
    key[torch.arange(num), pos] = 2.0  # the token's own position is always chosen
    k_eff = min(topk, max_len)
    vals, idx = key.topk(k_eff, dim=-1)
    idx = torch.where(vals < 0, torch.full_like(idx, -1), idx)
    out = torch.full((num, topk), -1, dtype=torch.int64)
    out[:, :k_eff] = idx
    cols = torch.rand(num, topk, generator=g).argsort(dim=-1)  # scatter -1 among the columns
    return out.gather(1, cols).to(torch.int32).to(positions.device)


def dense_tokens(batch: dict, block_t: int, dense_below: int) -> torch.Tensor:
    """``[T]`` bool: tokens in the blocks of ``block_t`` the dense-causal path owns (every token
    of the block in one request, every position ``< dense_below``)."""
    req, pos = batch["token_req"], batch["positions"]
    pad = -req.shape[0] % block_t
    req_b = torch.cat([req, req[-1:].expand(pad)]).view(-1, block_t)
    pos_b = torch.cat([pos, pos.new_zeros(pad)]).view(-1, block_t)
    owned = (req_b == req_b[:, :1]).all(1) & (pos_b.amax(1) < dense_below)
    return owned.repeat_interleave(block_t)[: req.shape[0]]


def mla_inputs(batch: dict, heads: int, rank: int, rope: int, topk: int, dtype, device="cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    num = batch["positions"].shape[0]
    q = torch.randn(num, heads, rank + rope, generator=g).to(dtype).to(device)
    kv = torch.randn(batch["num_slots"], rank + rope, generator=g).to(dtype).to(device)
    max_len = batch["page_table"].shape[1] * batch["page_size"]
    tk = random_topk(batch["positions"], topk, max_len, seed=seed + 1)
    return q, kv, tk


def indexer_inputs(batch: dict, heads: int, dim: int, dtype, device="cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    num = batch["positions"].shape[0]
    q = torch.randn(num, heads, dim, generator=g).to(dtype).to(device)
    w = (torch.randn(num, heads, generator=g) * heads**-0.5).to(device)
    k_cache = torch.randn(batch["num_slots"], dim, generator=g).to(dtype).to(device)
    return q, w, k_cache


def fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """Exact emulation of the kernel's e4m3 row quantisation, returned dequantised (fp32)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12)
    q8 = (xf * (torch.full_like(amax, 448.0) / amax)).to(torch.float8_e4m3fn)  # IEEE division, as the kernel
    return q8.float() * (amax * (1.0 / 448.0))


def indexer_scores_ref(q, w, k_cache, batch, scale, dtype=torch.float64, fp8=False) -> torch.Tensor:
    """``[T, L]`` scores in ``dtype`` (``-inf`` past each position), chunked over tokens."""
    from breakgraph.kernels.paging import positions_to_slots

    if fp8:
        q, k_cache = fp8_rows(q), fp8_rows(k_cache)
    pt, req, pos, ps = batch["page_table"], batch["token_req"], batch["positions"], batch["page_size"]
    num, max_len = q.shape[0], pt.shape[1] * ps
    j = torch.arange(max_len, device=q.device)
    out = torch.empty(num, max_len, dtype=dtype, device=q.device)
    chunk = max(1, (1 << 25) // (max_len * k_cache.shape[-1]))
    for s in range(0, num, chunk):
        e = min(s + chunk, num)
        keys = k_cache[positions_to_slots(j.expand(e - s, max_len), pt, req[s:e], ps)].to(dtype)
        logits = torch.einsum("thd,tld->thl", q[s:e].to(dtype), keys) * scale
        out[s:e] = torch.einsum("th,thl->tl", w[s:e].to(dtype), logits.relu())
    return out.masked_fill(j[None, :] > pos[:, None], float("-inf"))


def check_topk(
    got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor, positions: torch.Tensor, tol: float
):
    """``got`` is a valid causal top-k (right count of ``-1``, no duplicates, causal) whose
    exact scores equal those of ``want``'s set, sorted, within ``tol · max|score|``."""
    topk = got.shape[1]
    n_valid = (positions + 1).clamp(max=min(topk, exact.shape[1]))
    assert torch.equal((got >= 0).sum(1), n_valid), "wrong number of -1 entries"
    assert torch.equal((want >= 0).sum(1), n_valid), "twin: wrong number of -1 entries"
    assert bool(((got < 0) | (got.long() <= positions[:, None])).all()), "non-causal position chosen"
    srt = got.long().sort(dim=1).values
    dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    assert not bool(dup.any()), "duplicate positions in a row"

    def chosen(idx):
        v = exact.gather(1, idx.long().clamp(min=0))
        return v.masked_fill(idx < 0, float("-inf")).sort(dim=1, descending=True).values

    a, b = chosen(got), chosen(want)
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin)
    scale = exact[torch.isfinite(exact)].abs().max()
    worst = ((a[fin] - b[fin]).abs().max() / scale).item() if bool(fin.any()) else 0.0
    assert worst <= tol, f"top-k sets differ beyond ties: worst score gap {worst:.3g} > {tol}"


# ---------------------------------------------------------------------------------------
# Interpreter checks (run in a child process with TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------

_RAGGED = {"prefix_lens": [0, 9, 30, 2], "extend_lens": [7, 5, 3, 1]}  # 16 tokens, L up to 33
_DECODE = {"prefix_lens": [4, 40, 17, 0, 25], "extend_lens": [1, 1, 1, 1, 1]}


def _poison_unowned(kv: torch.Tensor, layout: dict, batch: dict) -> torch.Tensor:
    """``kv`` with NaN in every cache row that holds no position of the batch's requests (the
    padding page, spare pages, page tails): a kernel that reads one writes NaN."""
    from breakgraph.kernels.paging import positions_to_slots

    lens = [p + e for p, e in zip(layout["prefix_lens"], layout["extend_lens"])]
    pos = torch.full((len(lens), max(lens)), -1, dtype=torch.int64)
    for b, n in enumerate(lens):
        pos[b, :n] = torch.arange(n)
    owned = positions_to_slots(pos, batch["page_table"], torch.arange(len(lens)), batch["page_size"])[pos >= 0]
    out = torch.full_like(kv, float("nan"))
    out[owned] = kv[owned]
    return out


def _interp_sparse_mla_fp32():
    """fp32 in, exact dots: the kernel computes the twin's function (single pass, split-K,
    heads not a multiple of the head block, D not a power of two, several page sizes; the
    unmasked ``lean`` loop and the lazy rescale, with and without split-K, on rows shorter and
    longer than K). Cache rows outside the requests hold NaN: no variant reads them."""
    from breakgraph.kernels.sparse_mla import sparse_mla_attention_ref
    from breakgraph.kernels.triton_sparse_mla import lean_supported, sparse_mla_attention_triton

    cases = [
        (_RAGGED, 4, 8, 32, 16, 24, {}),
        (_RAGGED, 1, 20, 48, 16, 16, {"block_h": 16}),  # D = 64 with r = 48: padded r block
        (_DECODE, 16, 4, 64, 16, 40, {}),  # D = 80
        (_RAGGED, 3, 8, 32, 16, 24, {"slots": True}),  # cache rows precomputed (page of 3: a division)
        (_DECODE, 4, 8, 32, 16, 40, {"num_splits": 3, "block_n": 16, "slots": True}),
        (_RAGGED, 3, 8, 32, 16, 32, {"lean": True, "lazy": 8.0, "block_n": 32}),  # unused entries read a real row
        (_RAGGED, 4, 16, 32, 16, 32, {"lean": True, "lazy": 0.25, "block_n": 16}),  # rescales often
        (_DECODE, 8, 8, 32, 16, 48, {"lean": True, "lazy": 8.0, "num_splits": 3, "block_n": 16}),
        (_DECODE, 2, 8, 32, 16, 64, {"lean": True, "lazy": 8.0, "block_n": 64}),  # every row shorter than K
        (_RAGGED, 4, 8, 32, 16, 24, {"lazy": 8.0}),  # lazy rescale on the masked loop
        (_RAGGED, 4, 8, 64, 16, 32, {"lean": True, "groups": 4, "lazy": 0.0, "block_n": 16}),  # rescale every block
        (_RAGGED, 4, 8, 64, 16, 64, {}),  # the few-heads default: four column groups, lazy rescale, 8-row heads
        (_RAGGED, 4, 5, 64, 16, 64, {"block_n": 64, "num_warps": 8}),  # 5 heads in the 8-row block
        (_RAGGED, 3, 20, 64, 16, 32, {"lean": True, "groups": 4, "lazy": 8.0, "block_h": 16, "block_n": 32}),
        (_DECODE, 4, 8, 64, 16, 48, {"num_splits": 3, "block_n": 16}),  # the default (8-row heads), split-K
        (_DECODE, 4, 12, 64, 16, 48, {"lean": True, "groups": 4, "block_h": 8, "num_splits": 3, "block_n": 16}),
        (_DECODE, 4, 8, 32, 16, 40, {"lazy": 1.0, "num_splits": 3, "block_n": 16}),
    ]
    for i, (layout, ps, heads, rank, rope, topk, opts) in enumerate(cases):
        batch = make_batch(**layout, page_size=ps, seed=i)
        q, kv, tk = mla_inputs(batch, heads, rank, rope, topk, torch.float32, seed=i)
        kv = _poison_unowned(kv, layout, batch)
        if opts.get("lean"):
            assert lean_supported(kv, topk, rank, rank + rope, opts["block_n"]), (i, opts)
        scale = (rank + rope) ** -0.5 * (1.0 + i)
        args = (tk, batch["page_table"], batch["token_req"], ps, scale)
        ref = torch.empty(q.shape[0], heads, rank)
        sparse_mla_attention_ref(q, kv, *args, ref)
        out = torch.full_like(ref, float("nan"))
        sparse_mla_attention_triton(q, kv, *args, out, **opts)
        err = rel_err(out, ref)
        print(f"sparse_mla fp32 case {i} {opts}: {err:.2e}")
        assert err <= 1e-5, (i, err)


def _interp_sparse_mla_bf16():
    """bf16 in: within 2× the bf16 rounding of the fp32 twin, with and without split-K."""
    from breakgraph.kernels.sparse_mla import sparse_mla_attention_ref
    from breakgraph.kernels.triton_sparse_mla import sparse_mla_attention_triton

    # the gather loop with slots (48 keys: no whole 32-key blocks); the column-group kernel, split-K and not
    for i, (layout, opts) in enumerate([(_RAGGED, {}), (_DECODE, {"num_splits": 4, "block_n": 16}),
                                        (_RAGGED, {"lean": True, "groups": 4, "lazy": 8.0, "block_n": 16})]):  # fmt: skip
        batch = make_batch(**layout, page_size=4, seed=10 + i)
        q, kv, tk = mla_inputs(batch, 16, 64, 16, 48, torch.bfloat16, seed=10 + i)
        args = (tk, batch["page_table"], batch["token_req"], 4, 80**-0.5)
        ref = torch.empty(q.shape[0], 16, 64)
        sparse_mla_attention_ref(q.float(), kv.float(), *args, ref)
        twin = torch.empty(q.shape[0], 16, 64, dtype=torch.bfloat16)
        sparse_mla_attention_ref(q, kv, *args, twin)
        out = torch.full_like(twin, float("nan"))
        sparse_mla_attention_triton(q, kv, *args, out, **opts)
        floor, err, err_twin = rel_err(ref.bfloat16(), ref), rel_err(out, ref), rel_err(twin, ref)
        print(f"sparse_mla bf16 {opts}: kernel {err:.2e}, bf16 floor {floor:.2e}, bf16 twin {err_twin:.2e}")
        assert err <= 2 * floor, (err, floor)
        assert rel_err(out, twin) <= 1e-2


# Prefixes already cached, tokens below and above K, token blocks straddling requests.
_DENSE = {"prefix_lens": [0, 9, 3, 30, 0], "extend_lens": [11, 6, 9, 3, 4]}  # 33 tokens


def _interp_sparse_mla_dense_path():
    """positions + dense_below = K: the dense-causal kernel owns the token blocks below K that
    sit in one request, the sparse kernel the rest; together they equal the twin (fp32: 1e-5;
    bf16: 2× the output rounding). Emptying the top-k rows of the dense blocks changes nothing
    (the dense kernel wrote them); under split-K the dense path is off. With ``dense_elsewhere``
    the dense blocks' rows are left unwritten and every other row is the same."""
    from breakgraph.kernels.sparse_mla import sparse_mla_attention_ref
    from breakgraph.kernels.triton_dense_mla import dense_config
    from breakgraph.kernels.triton_sparse_mla import sparse_mla_attention_triton

    cases = [  # (heads, rank, rope, K, page size, dtype, opts)
        (8, 32, 16, 12, 4, torch.float32, {}),  # 8 tokens × 8 heads = 64 rows
        (8, 32, 16, 12, 3, torch.float32, {"dense_block_t": 4, "dense_block_n": 16}),
        (2, 32, 16, 16, 1, torch.float32, {"dense_block_t": 8}),
        (20, 48, 16, 10, 2, torch.float32, {"block_h": 16}),  # H, r not powers of two
        (72, 32, 16, 12, 4, torch.float32, {}),  # H > 64: dense head blocks
        (8, 32, 16, 12, 4, torch.float32, {"num_splits": 2, "block_n": 16}),  # split-K: sparse only
        (8, 64, 16, 12, 4, torch.bfloat16, {"dense_block_t": 4}),
        (8, 32, 16, 40, 4, torch.float32, {"dense_balanced": True, "dense_block_n": 16, "dense_programs": 3}),
    ]
    for i, (heads, rank, rope, topk, ps, dtype, opts) in enumerate(cases):
        batch = make_batch(**_DENSE, page_size=ps, seed=40 + i)
        q, kv, tk = mla_inputs(batch, heads, rank, rope, topk, dtype, seed=40 + i)
        scale = (rank + rope) ** -0.5 * (1.0 + i / 2)
        pos, rest = batch["positions"], (batch["page_table"], batch["token_req"], ps, scale)
        ref = torch.empty(q.shape[0], heads, rank)
        sparse_mla_attention_ref(q.float(), kv.float(), tk, *rest, ref)

        kw = dict(positions=pos, dense_below=topk, **opts)
        out = torch.full((q.shape[0], heads, rank), float("nan"), dtype=dtype)
        sparse_mla_attention_triton(q, kv, tk, *rest, out, **kw)
        err = rel_err(out, ref)
        if dtype == torch.float32:
            assert err <= 1e-5, (i, err)
        else:
            floor = rel_err(ref.to(dtype), ref)
            assert err <= 2 * floor, (i, err, floor)
        print(f"sparse_mla dense path case {i} H={heads} {opts}: {err:.2e}")
        if "num_splits" in opts:
            continue
        block_t = opts.get("dense_block_t", dense_config(heads)["block_t"])
        dense = dense_tokens(batch, block_t, topk)
        assert dense.any() and (block_t == 1 or (~dense & (pos < topk)).any()), "dense/straddling mix"
        again = torch.full_like(out, float("nan"))
        sparse_mla_attention_triton(q, kv, tk.masked_fill(dense[:, None], -1), *rest, again, **kw)
        assert torch.equal(again, out), "dense blocks were not written densely"
        elsewhere = torch.full_like(out, float("nan"))  # the caller attends the dense blocks: left unwritten
        sparse_mla_attention_triton(q, kv, tk, *rest, elsewhere, dense_elsewhere=True, **kw)
        assert torch.isnan(elsewhere[dense]).all() and torch.equal(elsewhere[~dense], out[~dense]), i


def _interp_sparse_mla_skips_its_launch_when_every_block_is_dense():
    """``request_tokens`` (every position below K): where every request but the last fills whole
    dense token blocks, the cache-row and sparse kernels are not launched and the dense kernel
    alone equals the twin (fp32: 1e-5), the chunked and the balanced dense kernel alike; where a
    request ends inside a block, they are launched and the result equals the twin too."""
    from unittest import mock

    from breakgraph.kernels import triton_sparse_mla
    from breakgraph.kernels.sparse_mla import sparse_mla_attention_ref

    class NotLaunched:
        def __getitem__(self, grid):
            raise AssertionError("a kernel was launched where every token block is dense")

    heads, rank, rope, topk, ps = 8, 32, 16, 32, 4  # 8 heads: dense token blocks of 8
    cases = [  # (prefix lens, token counts, skipped, opts)
        ([0, 5, 2], [8, 16, 5], True, {}),
        ([3, 0, 0], [16, 8, 7], True, {"dense_balanced": True, "dense_block_n": 16, "dense_programs": 3}),
        ([0], [27], True, {}),  # one prompt of any length
        ([0, 5, 2], [8, 13, 5], False, {}),  # the second request ends inside a block
        ([0, 5, 2], [8, 13, 5], False, {"dense_balanced": True, "dense_block_n": 16}),
    ]
    for i, (prefix, counts, skipped, opts) in enumerate(cases):
        batch = make_batch(prefix, counts, page_size=ps, seed=70 + i)
        assert int(batch["positions"].max()) < topk
        q, kv, tk = mla_inputs(batch, heads, rank, rope, topk, torch.float32, seed=70 + i)
        rest = (batch["page_table"], batch["token_req"], ps, (rank + rope) ** -0.5)
        ref = torch.empty(q.shape[0], heads, rank)
        sparse_mla_attention_ref(q, kv, tk, *rest, ref)
        out = torch.full_like(ref, float("nan"))
        kw = dict(positions=batch["positions"], dense_below=topk, request_tokens=counts, **opts)
        spies = ("_topk_slots_kernel", "_sparse_mla_groups_kernel", "_sparse_mla_fwd_kernel")
        with mock.patch.multiple(triton_sparse_mla, **{name: NotLaunched() for name in spies}):
            if skipped:
                triton_sparse_mla.sparse_mla_attention_triton(q, kv, tk, *rest, out, **kw)
            else:
                try:
                    triton_sparse_mla.sparse_mla_attention_triton(q, kv, tk, *rest, out, **kw)
                except AssertionError as e:
                    assert "was launched" in str(e), e
                else:
                    raise AssertionError(f"case {i}: a block straddles two requests, yet no sparse launch")
        if not skipped:
            triton_sparse_mla.sparse_mla_attention_triton(q, kv, tk, *rest, out, **kw)
        err = rel_err(out, ref)
        assert err <= 1e-5, (i, err)
        print(f"sparse launch skipped={skipped} case {i} {counts} {opts}: {err:.2e}")


def packed_topk(positions: torch.Tensor, topk: int, seed: int) -> torch.Tensor:
    """``[T, K]`` int32 rows as the DSA indexer packs them: a token's ``min(K, pos + 1)`` causal
    positions (all of ``0…pos`` in a short row, a random ``K`` of them in a long one, always the
    token itself) in shuffled order in the first columns, ``-1`` after them."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((positions.shape[0], topk), -1, dtype=torch.int32)
    for t, pos in enumerate(positions.tolist()):
        keys = torch.randperm(pos + 1, generator=g)
        if pos + 1 > topk:
            keys = torch.cat([torch.tensor([pos]), keys[keys != pos][: topk - 1]])
        out[t, : keys.numel()] = keys[torch.randperm(keys.numel(), generator=g)].to(torch.int32)
    return out


def _interp_sparse_mla_packed_rows_stop_at_their_keys():
    """``packed_rows``: under split-K each program stops at its row's last key block. Decode
    batches (one token per request), rows shorter and longer than K, the column-group, lean
    and masked loops: equal to the twin (fp32: 1e-5) on packed rows whose columns past the
    keys' last 64-key block hold *wrong* causal positions, which the kernel must not read
    (without ``packed_rows`` the same rows give another result). Without split-K (an extend
    batch beside the dense path) the bound is not applied: clean packed rows equal the twin."""
    from breakgraph.kernels.sparse_mla import sparse_mla_attention_ref
    from breakgraph.kernels.triton_sparse_mla import sparse_mla_attention_triton

    cases = [  # (prefix lens, token counts, heads, rank, K, dense_below, opts)
        ([3, 17, 40, 200], [1, 1, 1, 1], 8, 64, 128, 0, {"num_splits": 4, "groups": 4}),
        ([3, 17, 40, 200], [1, 1, 1, 1], 8, 64, 128, 0, {"num_splits": 2, "groups": 1}),
        ([3, 130, 40], [1, 1, 1], 16, 32, 128, 0, {"num_splits": 4, "lean": False, "block_n": 16}),
        ([0, 90, 5], [11, 6, 9], 8, 64, 128, 128, {"groups": 4}),  # no split-K: the dense path beside sparse rows
    ]
    for i, (prefix, counts, heads, rank, topk, dense_below, opts) in enumerate(cases):
        batch = make_batch(prefix, counts, page_size=4, seed=90 + i)
        pos = batch["positions"]
        q, kv, _ = mla_inputs(batch, heads, rank, 16, topk, torch.float32, seed=90 + i)
        tk = packed_topk(pos, topk, seed=90 + i)
        rest = (batch["page_table"], batch["token_req"], 4, (rank + 16) ** -0.5)
        ref = torch.empty(q.shape[0], heads, rank)
        sparse_mla_attention_ref(q, kv, tk, *rest, ref)
        split = opts.get("num_splits", 1) > 1
        poisoned = tk.clone()
        g = torch.Generator().manual_seed(i)
        for t, p in enumerate(pos.tolist()):
            end = -(-min(topk, p + 1) // 64) * 64
            poisoned[t, end:] = torch.randint(0, p + 1, (topk - end,), generator=g, dtype=torch.int32)
        assert not torch.equal(poisoned, tk), "no column to poison"
        kw = dict(positions=pos, dense_below=dense_below, **opts)
        out = torch.full_like(ref, float("nan"))
        sparse_mla_attention_triton(q, kv, poisoned if split else tk, *rest, out, packed_rows=True, **kw)
        err = rel_err(out, ref)
        assert err <= 1e-5, (i, err)
        if not split:
            continue
        unpacked = torch.full_like(ref, float("nan"))
        sparse_mla_attention_triton(q, kv, poisoned, *rest, unpacked, **kw)
        assert rel_err(unpacked, ref) > 1e-3, (i, "the poisoned columns change nothing: the check proves nothing")
        print(f"packed rows case {i} {opts}: {err:.2e}")


def _interp_sparse_mla_causal_rows_come_from_the_positions():
    """``causal_rows``: every sequence at most K long, the rows are made from the positions and
    ``topk_pos`` is not read. Decode batches under split-K (the column-group and lean loops, the
    cache-row kernel making the rows with its fill; the masked loop making them itself), extend
    batches beside the dense path (the cache-row kernel without its fill; the masked loop, one
    split, bounded at each row's keys), one at many heads, and the FP8 cache, all on a
    ``topk_pos`` of random wrong positions. fp32: equal to the twin on the causal rows (1e-5),
    and the same garbage without ``causal_rows`` gives another result; FP8 cache (bf16
    queries): equal to the same kernels reading the right causal rows as packed rows."""
    from breakgraph.kernels.causal_topk import causal_topk_ref
    from breakgraph.kernels.latent_fp8 import quantize_latent_ref
    from breakgraph.kernels.sparse_mla import sparse_mla_attention_ref
    from breakgraph.kernels.triton_sparse_mla import sparse_mla_attention_triton

    cases = [  # (prefix lens, token counts, heads, rank, K, dense_below, opts, FP8 cache)
        ([3, 17, 40, 120], [1, 1, 1, 1], 8, 64, 128, 0, {"num_splits": 4, "groups": 4}, False),
        ([3, 17, 40, 120], [1, 1, 1, 1], 8, 64, 128, 0, {"num_splits": 2, "groups": 1}, False),
        ([3, 100, 40], [1, 1, 1], 16, 32, 128, 0, {"num_splits": 4, "lean": False, "block_n": 16}, False),  # rows in the loop
        ([0, 90, 5], [11, 6, 9], 8, 64, 128, 128, {"groups": 4}, False),  # no split-K: the dense path beside sparse rows
        ([0, 90, 5], [11, 6, 9], 8, 64, 128, 128, {"num_splits": 1, "lean": False}, False),  # cache rows without the fill
        ([0, 30], [5, 7], 32, 32, 64, 0, {"num_splits": 1}, False),  # many heads: rows in the loop, one split
        ([3, 17, 40, 120], [1, 1, 1, 1], 8, 128, 128, 0, {"num_splits": 4, "groups": 4}, True),
        ([3, 17, 40, 120], [1, 1, 1, 1], 8, 128, 128, 0, {"num_splits": 4, "lean": False, "block_n": 16}, True),
    ]
    for i, (prefix, counts, heads, rank, topk, dense_below, opts, fp8) in enumerate(cases):
        batch = make_batch(prefix, counts, page_size=4, seed=120 + i)
        pos = batch["positions"]
        assert int(pos.max()) < topk
        rope = 64 if fp8 else 16
        q, kv, _ = mla_inputs(batch, heads, rank, rope, topk, torch.bfloat16 if fp8 else torch.float32, seed=120 + i)
        if fp8:
            kv = quantize_latent_ref(kv, rank)
        causal = torch.empty(q.shape[0], topk, dtype=torch.int32)
        causal_topk_ref(pos, causal)
        rest = (batch["page_table"], batch["token_req"], 4, (rank + rope) ** -0.5)
        kw = dict(positions=pos, dense_below=dense_below, **opts)
        ref = torch.full((q.shape[0], heads, rank), float("nan"), dtype=q.dtype)
        if fp8:
            sparse_mla_attention_triton(q, kv, causal, *rest, ref, packed_rows=True, **kw)
        else:
            sparse_mla_attention_ref(q, kv, causal, *rest, ref)
        g = torch.Generator().manual_seed(i)
        garbage = torch.stack([torch.randint(0, p + 1, (topk,), generator=g, dtype=torch.int32) for p in pos.tolist()])
        out = torch.full_like(ref, float("nan"))
        sparse_mla_attention_triton(q, kv, garbage, *rest, out, causal_rows=True, **kw)
        err = rel_err(out.float(), ref.float())
        assert err <= (1e-6 if fp8 else 1e-5), (i, err)
        read = torch.full_like(ref, float("nan"))
        sparse_mla_attention_triton(q, kv, garbage, *rest, read, **kw)
        assert rel_err(read.float(), ref.float()) > 1e-3, (i, "the garbage rows change nothing: the check proves nothing")
        print(f"causal rows case {i} {opts}{' fp8' if fp8 else ''}: {err:.2e}")


# Fresh and cached prompts, a 1-token request, lengths off the block sizes; positions up to 70.
_DENSE_LONG = {"prefix_lens": [0, 21, 0, 44], "extend_lens": [19, 13, 1, 27]}  # 60 tokens


def _dense_case_matches_twin(i, heads, rank, rope, topk, ps, dtype, opts, seed, poison=False):
    """One dense-causal case of the interpreter checks: fresh inputs on the ``_DENSE_LONG``
    batch (with ``poison``, NaN in the cache rows no request owns), the Triton kernels with
    ``opts`` against the fp32 twin (fp32: 1e-5; bf16: 2× the output rounding). Returns
    ``(batch, q, kv, tk, rest, kw, out)`` for the caller's further checks."""
    from breakgraph.kernels.sparse_mla import sparse_mla_attention_ref
    from breakgraph.kernels.triton_sparse_mla import sparse_mla_attention_triton

    batch = make_batch(**_DENSE_LONG, page_size=ps, seed=seed)
    q, kv, tk = mla_inputs(batch, heads, rank, rope, topk, dtype, seed=seed)
    if poison:
        kv = _poison_unowned(kv, _DENSE_LONG, batch)
    pos, rest = batch["positions"], (batch["page_table"], batch["token_req"], ps, (rank + rope) ** -0.5)
    ref = torch.empty(q.shape[0], heads, rank)
    sparse_mla_attention_ref(q.float(), kv.float(), tk, *rest, ref)
    kw = dict(positions=pos, dense_below=topk, **opts)
    out = torch.full((q.shape[0], heads, rank), float("nan"), dtype=dtype)
    sparse_mla_attention_triton(q, kv, tk, *rest, out, **kw)
    err = rel_err(out, ref)
    floor = rel_err(ref.to(dtype), ref)
    print(f"dense split case {i} H={heads} ps={ps} {opts}: {err:.2e} (output rounding {floor:.2e})")
    assert err <= (1e-5 if dtype == torch.float32 else 2 * floor), (i, err)
    return batch, q, kv, tk, rest, kw, out


def _interp_dense_mla_split_keys():
    """Key ranges cut into chunks (``dense_chunk_keys``) and merged: on fresh random inputs
    the split kernel equals the twin (fp32: 1e-5; bf16: 2× the output rounding) for chunk
    sizes that do and do not divide the ranges, one- and several-page key blocks, 8, 16 and
    72 heads, and the default chunks; the dense blocks are written without their top-k rows."""
    from breakgraph.kernels.triton_dense_mla import dense_config
    from breakgraph.kernels.triton_sparse_mla import sparse_mla_attention_triton

    cases = [  # (heads, rank, rope, K, page size, dtype, opts)
        (8, 32, 16, 64, 16, torch.float32, {"dense_block_n": 16, "dense_chunk_keys": 16}),
        (8, 32, 16, 64, 4, torch.float32, {"dense_block_n": 16, "dense_chunk_keys": 48}),
        (16, 32, 16, 80, 32, torch.float32, {"dense_block_n": 32, "dense_chunk_keys": 32}),
        (72, 32, 16, 80, 8, torch.float32, {"dense_block_n": 16, "dense_chunk_keys": 32}),
        (8, 64, 16, 80, 16, torch.bfloat16, {"dense_block_n": 16, "dense_chunk_keys": 32}),
        (8, 32, 16, 72, 16, torch.float32, {"dense_block_n": 16}),  # the default chunks
    ]
    for i, (heads, rank, rope, topk, ps, dtype, opts) in enumerate(cases):
        batch, q, kv, tk, rest, kw, out = _dense_case_matches_twin(i, heads, rank, rope, topk, ps, dtype, opts, 60 + i)
        block_t = dense_config(heads)["block_t"]
        dense = dense_tokens(batch, block_t, topk)
        max_keys = min(topk, batch["page_table"].shape[1] * ps)
        cpu = torch.device("cpu")
        chunk = opts.get("dense_chunk_keys") or dense_config(heads, q.shape[0], max_keys, cpu, ps)["chunk_keys"]
        assert chunk > 0 and (batch["positions"][dense] >= chunk).any(), "no block spans two chunks"
        again = torch.full_like(out, float("nan"))
        sparse_mla_attention_triton(q, kv, tk.masked_fill(dense[:, None], -1), *rest, again, **kw)
        assert torch.equal(again, out), "dense blocks were not written densely"


def dense_plan_ref(batch: dict, block_t: int, block_n: int, dense_below: int, programs: int):
    """The balanced split's plan in plain Python: ``(start, first)`` as ``_dense_plan_kernel``
    writes them (key blocks before each token block; each program's first token block)."""
    pos = batch["positions"].tolist()
    owned = dense_tokens(batch, block_t, dense_below).tolist()
    start = [0]
    for t0 in range(0, len(pos), block_t):
        last = max(pos[t0 : t0 + block_t])
        start.append(start[-1] + (-(-(last + 1) // block_n) if owned[t0] else 0))
    per = -(-start[-1] // programs)
    first = [sum(e <= p * per for e in start[1:]) for p in range(programs)]
    return start, first


def _interp_dense_plan():
    """The plan kernel's prefix sums of key blocks equal the plain-Python plan's (several
    requests, a 1-token request, blocks straddling requests and ``dense_below``, plans of one
    step and of several)."""
    from breakgraph.kernels.triton_dense_mla import _dense_plan_kernel

    cases = [(_DENSE, 8, 16, 12, 4), (_DENSE_LONG, 8, 16, 64, 64), (_DENSE_LONG, 2, 32, 50, 16),
             (_DENSE_LONG, 1, 16, 72, 32), ({"prefix_lens": [0] * 9, "extend_lens": [70] * 9}, 1, 16, 64, 128)]  # fmt: skip
    for i, (layout, block_t, block_n, below, chunk) in enumerate(cases):
        batch = make_batch(**layout, page_size=16, seed=80 + i)
        num = batch["positions"].shape[0]
        blocks = -(-num // block_t)
        got = torch.full((blocks + 1,), -7, dtype=torch.int32)
        _dense_plan_kernel[(1,)](batch["token_req"], batch["positions"], got, num, blocks, below,
                                 BLOCK_T=block_t, BLOCK_N=block_n, CHUNK=chunk)  # fmt: skip
        start, _ = dense_plan_ref(batch, block_t, block_n, below, 1)
        assert got.tolist() == start, (i, got.tolist(), start)
        tiles = got.diff()
        assert 0 < start[-1] and (i != 0 or (tiles == 0).any()), (i, tiles.tolist())  # case 0: blocks off the path
        print(f"dense plan case {i}: {blocks} blocks, {start[-1]} key blocks")


def _interp_dense_mla_balanced_split():
    """The balanced split (stream-K over key blocks, partials merged) on fresh random inputs
    equals the twin (fp32: 1e-5; bf16: 2× the output rounding) for pages of 16 and 64 (one
    key block spanning several pages and a page holding several blocks), pages of 4 and 3 (a
    division per key), 8, 16 and 72 heads, ragged requests on cached prefixes, grids with token
    blocks shared by programs and programs spanning token blocks, and the default grid; the
    dense blocks are written without their top-k rows."""
    from breakgraph.kernels.triton_dense_mla import balanced_config
    from breakgraph.kernels.triton_sparse_mla import sparse_mla_attention_triton

    cases = [  # (heads, rank, rope, K, page size, dtype, opts)
        (8, 32, 16, 64, 16, torch.float32, {"dense_balanced": True, "dense_block_n": 32, "dense_programs": 2}),  # a key block, two pages
        (8, 32, 16, 64, 64, torch.float32, {"dense_balanced": True, "dense_block_n": 16, "dense_programs": 7}),
        (8, 32, 16, 72, 16, torch.float32, {"dense_balanced": True, "dense_block_n": 32, "dense_programs": 3}),
        (8, 32, 16, 64, 4, torch.float32, {"dense_balanced": True, "dense_block_n": 16, "dense_programs": 11}),
        (8, 32, 16, 80, 3, torch.float32, {"dense_balanced": True, "dense_block_n": 32, "dense_programs": 4}),  # page not a power of two
        (16, 32, 16, 80, 64, torch.float32, {"dense_balanced": True, "dense_block_n": 32, "dense_programs": 6}),
        (72, 32, 16, 80, 16, torch.float32, {"dense_balanced": True, "dense_block_n": 16, "dense_programs": 9}),  # two head blocks
        (8, 64, 16, 80, 16, torch.bfloat16, {"dense_balanced": True, "dense_block_n": 16, "dense_programs": 5}),
        (8, 64, 16, 72, 64, torch.bfloat16, {"dense_balanced": True}),  # the default tiles and grid
        (8, 64, 16, 80, 16, torch.bfloat16, {"dense_balanced": True, "dense_block_n": 16, "dense_programs": 6,
                                                 "dense_partial_dtype": torch.bfloat16}),  # bf16 partials
    ]
    for i, (heads, rank, rope, topk, ps, dtype, opts) in enumerate(cases):
        batch, q, kv, tk, rest, kw, out = _dense_case_matches_twin(i, heads, rank, rope, topk, ps, dtype, opts, 160 + i,
                                                                   poison=True)  # fmt: skip
        cfg = balanced_config(heads)
        programs = opts.get("dense_programs", cfg["programs"])
        start, first = dense_plan_ref(batch, cfg["block_t"], opts.get("dense_block_n", cfg["block_n"]), topk, programs)
        per = -(-start[-1] // programs)
        if "dense_programs" in opts:  # the split is exercised both ways
            assert any(s // per != (e - 1) // per for s, e in zip(start, start[1:]) if e > s), "no block shared"
            assert any(a < b - 1 for a, b in zip(first, first[1:])), "no program spans token blocks"
        dense = dense_tokens(batch, cfg["block_t"], topk)
        again = torch.full_like(out, float("nan"))
        sparse_mla_attention_triton(q, kv, tk.masked_fill(dense[:, None], -1), *rest, again, **kw)
        assert torch.equal(again, out), "dense blocks were not written densely"


def _interp_indexer_scores():
    """bf16 scores match the twin's fp32 math; FP8 scores match an exact emulation of the
    quantisation; length-true: nothing past a row's position is written, and token blocks
    below ``skip_below`` are not scored at all."""
    from breakgraph.kernels.triton_indexer import default_config, indexer_scores_triton

    cases = [
        (_RAGGED, 4, 8, 32, {}),  # default tiles (bf16 8, FP8 4 tokens): blocks straddle requests
        (_RAGGED, 4, 8, 32, {"block_t": 8, "block_l": 16}),  # blocks spanning three requests
        (_RAGGED, 2, 16, 64, {"block_t": 2, "block_l": 16}),
        (_RAGGED, 6, 12, 48, {"block_t": 4, "block_l": 32, "key_programs": 3}),  # Hi, Di, page not powers of two
        (_DECODE, 4, 8, 32, {"block_l": 16, "key_programs": 2}),  # T ≤ B: one token per block
    ]
    for i, (layout, ps, heads, dim, opts) in enumerate(cases):
        batch = make_batch(**layout, page_size=ps, seed=20 + i)
        q, w, kc = indexer_inputs(batch, heads, dim, torch.bfloat16, seed=20 + i)
        args = (batch["page_table"], batch["token_req"], batch["positions"], ps, dim**-0.5)
        max_len = batch["page_table"].shape[1] * ps
        ref = indexer_scores_ref(q, w, kc, batch, dim**-0.5)
        fin = torch.isfinite(ref)
        for fp8 in (False, True):
            out = torch.full((q.shape[0], max_len + 3), float("nan"))  # row stride > L
            indexer_scores_triton(q, w, kc, *args, out, fp8=fp8, **opts)
            assert torch.isnan(out[:, max_len:]).all() and torch.equal(~torch.isnan(out[:, :max_len]), fin), (
                "written region is not exactly each row's causal range"
            )
            got = out[:, :max_len][fin]
            err = rel_err(got, ref[fin])
            if fp8:
                emu = indexer_scores_ref(q, w, kc, batch, dim**-0.5, fp8=True)
                err_emu = rel_err(got, emu[fin])
                print(f"indexer fp8 case {i}: vs emulation {err_emu:.2e}, vs exact {err:.2e}")
                assert err_emu <= 1e-4 and err <= 6e-2, (i, err_emu, err)
            else:
                print(f"indexer bf16 case {i}: {err:.2e}")
                assert err <= 1e-5, (i, err)
        # Blocks whose positions all sit below skip_below are left alone; the others are scored.
        skip = 12
        out = torch.full((q.shape[0], max_len), float("nan"))
        indexer_scores_triton(q, w, kc, *args, out, skip_below=skip, **opts)
        cfg = default_config(q.shape[0], batch["page_table"].shape[0], heads, max_len, torch.device("cpu"))
        block_t = opts.get("block_t", cfg["block_t"])
        pos = batch["positions"]
        pad = -pos.shape[0] % block_t
        block_max = torch.cat([pos, pos.new_full((pad,), -1)]).view(-1, block_t).amax(1)
        scored = (block_max >= skip).repeat_interleave(block_t)[: pos.shape[0]]
        assert scored.any() and (~scored).any(), "case must mix skipped and scored blocks"
        assert torch.isnan(out[~scored]).all(), "a block below skip_below was scored"
        assert torch.equal(~torch.isnan(out[scored]), fin[scored]), "a scored block lost its rows"


def _interp_topk_select():
    """The select picks exactly torch.topk's set on random rows (no ties at the K-th), reads
    only each row's causal range, and breaks ties at the K-th score towards the lower position."""
    from breakgraph.kernels.triton_indexer import topk_select_triton

    g = torch.Generator().manual_seed(40)
    topk, width = 24, 300
    pos = torch.tensor([0, 5, 23, 24, 25, 70, 150, 299, 180, 3])
    scores = torch.randn(pos.shape[0], width, generator=g) * torch.logspace(-3, 3, pos.shape[0])[:, None]
    scores[1] = -scores[1].abs()  # all negative
    scores[5, :71] = torch.randint(-1, 2, (71,), generator=g).float() * 0.0  # +0.0 and -0.0 tie
    scores[5, [2, 9, 40]] = 5.0
    poisoned = scores.clone()
    for t, p in enumerate(pos.tolist()):
        poisoned[t, p + 1 :] = float("nan")  # must never be read
    got = torch.full((pos.shape[0], topk), -7, dtype=torch.int32)
    topk_select_triton(poisoned, pos, got, block=64)
    for t, p in enumerate(pos.tolist()):
        n = p + 1
        row = got[t]
        if n <= topk:
            assert torch.equal(row, torch.where(torch.arange(topk) < n, torch.arange(topk), -1).int()), t
            continue
        vals = scores[t, :n]
        kth = vals.topk(topk).values[-1]
        above = (vals > kth).nonzero().flatten()
        ties = (vals == kth).nonzero().flatten()
        want = torch.cat([above, ties[: topk - above.numel()]]).sort().values
        assert torch.equal(row.long().sort().values, want), f"row {t}: set differs from the exact top-k (ties to lower)"
        if ties.numel() == 1:
            assert torch.equal(want, vals.topk(topk).indices.sort().values), t
    assert (scores[5, :71] == 0).sum() > topk, "the tie case must tie at the K-th score"


def _interp_indexer_topk():
    """Top-k sets equal the twin's (bf16), or equal within FP8 score error; ``-1`` tails
    when fewer keys than K exist (also K > L); token chunking gives the same result."""
    import breakgraph.kernels.triton_indexer as ti
    from breakgraph.kernels.indexer import indexer_topk_ref

    def as_sets(x):
        return x.sort(dim=1).values

    cases = [(_RAGGED, 4, 12), (_RAGGED, 2, 48), (_DECODE, 4, 20)]  # K = 48 > L = 34
    for i, (layout, ps, topk) in enumerate(cases):
        batch = make_batch(**layout, page_size=ps, seed=30 + i)
        q, w, kc = indexer_inputs(batch, 8, 32, torch.bfloat16, seed=30 + i)
        args = (batch["page_table"], batch["token_req"], batch["positions"], ps, 32**-0.5)
        want = torch.empty(q.shape[0], topk, dtype=torch.int32)
        indexer_topk_ref(q, w, kc, *args, want)
        exact = indexer_scores_ref(q, w, kc, batch, 32**-0.5)
        for fp8, tol in ((False, 1e-5), (True, 0.15)):
            got = torch.full_like(want, -7)
            ti.indexer_topk_triton(q, w, kc, *args, got, fp8=fp8, block_l=16)
            check_topk(got, want, exact, batch["positions"], tol)
            if not fp8:
                assert torch.equal(as_sets(got), as_sets(want)), "bf16 top-k set differs from the twin"
        saved = ti.SCORE_BUFFER_ELEMS
        try:
            ti.SCORE_BUFFER_ELEMS = 3 * batch["page_table"].shape[1] * ps  # 3 tokens per chunk
            got = torch.full_like(want, -7)
            ti.indexer_topk_triton(q, w, kc, *args, got, block_l=16)
            assert torch.equal(as_sets(got), as_sets(want)), "chunked top-k differs"
            got = torch.full_like(want, -7)  # a score buffer only as wide as the longest row
            longest = int(batch["positions"].max()) + 1
            ti.indexer_topk_triton(q, w, kc, *args, got, block_l=16, max_seq_len=longest)
            assert torch.equal(as_sets(got), as_sets(want)), "top-k with max_seq_len differs"
        finally:
            ti.SCORE_BUFFER_ELEMS = saved
        print(f"indexer topk case {i}: ok")


def _interp_gather_rows_sum():
    """The gather-only kernel the bench's floor uses sums exactly the rows it is given."""
    from breakgraph.kernels.triton_gather import gather_rows_sum, gather_rows_sum_ref

    g = torch.Generator().manual_seed(50)
    for width, keys in ((80, 40), (64, 33)):
        cache = torch.randn(300, width, generator=g)
        idx = torch.randint(0, 300, (7, keys), generator=g, dtype=torch.int32)
        out, want = torch.full((7, width), float("nan")), torch.empty(7, width)
        gather_rows_sum(cache, idx, out, block_n=16)
        gather_rows_sum_ref(cache, idx, want)
        assert rel_err(out, want) <= 1e-6, (width, keys)


def _install_interpreter_fixes() -> None:
    """Make Triton 3.6's interpreter compute what the GPU computes, for these kernels:
    bf16/fp8 ``tl.dot`` operands are upcast to fp32 (it would multiply their raw bits as
    integers); float down-casts round to nearest even like the GPU's ``cvt.rn`` (it
    truncates); one-element scalars convert to ``int`` under NumPy ≥ 2. Plus the interpreter's
    shortcuts of :func:`test_kernels_fp8.faster_interpreter` (same results, less time)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as it

    torch_of = {
        tl.bfloat16: torch.bfloat16,
        tl.float16: torch.float16,
        tl.float32: torch.float32,
        tl.float8e4nv: torch.float8_e4m3fn,
        tl.float8e5: torch.float8_e5m2,
    }
    bits = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}

    def to_torch(h):
        return torch.from_numpy(np.ascontiguousarray(h.data)).view(torch_of[h.dtype.scalar])

    def from_torch(x, tl_dtype):
        return it.TensorHandle(
            x.view(bits.get(x.dtype, x.dtype)).numpy().view(it._get_np_dtype(tl_dtype)), tl_dtype
        )

    builder = it.InterpreterBuilder
    orig_cast, orig_dot, orig_patch = builder.cast_impl, builder.create_dot, it._patch_lang_tensor

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if s in torch_of and d in torch_of:
            x = to_torch(src).float()
            if d == tl.float8e4nv:
                x = x.clamp(-448.0, 448.0)  # the GPU's conversion saturates
            return from_torch(x.to(torch_of[d]), d)
        return orig_cast(self, src, dst_type)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar in (tl.bfloat16, tl.float8e4nv, tl.float8e5):
            a, b = from_torch(to_torch(a).float(), tl.float32), from_torch(to_torch(b).float(), tl.float32)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def patch_lang_tensor(tensor, scope):
        orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    builder.cast_impl = cast_impl
    builder.create_fp_ext = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    builder.create_fp_trunc = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    builder.create_fp_to_fp = lambda self, src, dst_type, rounding_mode: self.cast_impl(src, dst_type)
    builder.create_dot = create_dot
    it._patch_lang_tensor = patch_lang_tensor
    from test_kernels_fp8 import faster_interpreter

    faster_interpreter()


def _run_interpreted(check: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(
        [sys.executable, __file__, check], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert r.returncode == 0, f"{check} failed under the Triton interpreter:\n{r.stdout}\n{r.stderr[-6000:]}"


def test_sparse_mla_kernel_matches_twin_in_fp32_interpreted():
    _run_interpreted("_interp_sparse_mla_fp32")


def test_sparse_mla_kernel_bf16_within_output_rounding_interpreted():
    _run_interpreted("_interp_sparse_mla_bf16")


def test_sparse_mla_dense_causal_path_matches_twin_interpreted():
    _run_interpreted("_interp_sparse_mla_dense_path")


def test_sparse_mla_skips_its_launch_when_every_block_is_dense_interpreted():
    _run_interpreted("_interp_sparse_mla_skips_its_launch_when_every_block_is_dense")


def test_sparse_mla_packed_rows_stop_at_their_keys_interpreted():
    _run_interpreted("_interp_sparse_mla_packed_rows_stop_at_their_keys")


def test_sparse_mla_causal_rows_come_from_the_positions_interpreted():
    _run_interpreted("_interp_sparse_mla_causal_rows_come_from_the_positions")


def test_dense_mla_split_keys_match_twin_interpreted():
    _run_interpreted("_interp_dense_mla_split_keys")


def test_dense_plan_matches_python_plan_interpreted():
    _run_interpreted("_interp_dense_plan")


@pytest.mark.slow
def test_dense_mla_balanced_split_matches_twin_interpreted():
    _run_interpreted("_interp_dense_mla_balanced_split")


def test_indexer_scores_match_twin_and_fp8_emulation_interpreted():
    _run_interpreted("_interp_indexer_scores")


def test_indexer_topk_sets_match_twin_interpreted():
    _run_interpreted("_interp_indexer_topk")


def test_topk_select_is_exact_and_length_true_interpreted():
    _run_interpreted("_interp_topk_select")


def test_gather_rows_sum_matches_twin_interpreted():
    _run_interpreted("_interp_gather_rows_sum")


def test_dispatch_uses_twin_for_cpu_tensors():
    """CPU tensors never reach Triton: the dispatchers equal the twins bit for bit."""
    from breakgraph.kernels.indexer import indexer_topk, indexer_topk_ref
    from breakgraph.kernels.sparse_mla import sparse_mla_attention, sparse_mla_attention_ref

    batch = make_batch(**_RAGGED, page_size=4)
    q, kv, tk = mla_inputs(batch, 4, 32, 16, 12, torch.float32)
    args = (tk, batch["page_table"], batch["token_req"], 4, 0.2)
    a, b = torch.empty(q.shape[0], 4, 32), torch.empty(q.shape[0], 4, 32)
    sparse_mla_attention(q, kv, *args, a, positions=batch["positions"], dense_below=12)
    sparse_mla_attention_ref(q, kv, *args, b)
    assert torch.equal(a, b)
    q, w, kc = indexer_inputs(batch, 8, 32, torch.float32)
    args = (batch["page_table"], batch["token_req"], batch["positions"], 4, 0.2)
    a, b = torch.empty(q.shape[0], 8, dtype=torch.int32), torch.empty(q.shape[0], 8, dtype=torch.int32)
    indexer_topk(q, w, kc, *args, a)
    indexer_topk_ref(q, w, kc, *args, b)
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------
# GPU checks: GLM-5 shapes
# ---------------------------------------------------------------------------------------

RANK, ROPE, TOPK, IDX_HEADS, IDX_DIM, PAGE = 512, 64, 2048, 32, 128, 64
GLM5_SCALE = (192 + 64) ** -0.5  # qk_head_dim^-0.5

# name → (prefix_lens, extend_lens)
GPU_LAYOUTS = {
    "prefill1024": ([3072], [1024]),  # 1k new tokens on a 3k prefix: top-k is sparse
    "prefill4096": ([0, 1000], [2999, 1097]),  # two requests, 4096 tokens; a token block straddles them
    "decode64": (
        [int(x) for x in torch.randint(100, 8000, (64,), generator=torch.Generator().manual_seed(5))],
        [1] * 64,
    ),
}


@contextlib.contextmanager
def _fp32_reference():
    """fp32 references must not run their matmuls in TF32 (≈1e-3 error)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _gpu_batch(layout: str, seed: int = 0) -> dict:
    return make_batch(*GPU_LAYOUTS[layout], page_size=PAGE, device="cuda", seed=seed)


@pytest.mark.cuda
@pytest.mark.parametrize("heads", [8, 16, 64])
@pytest.mark.parametrize("layout", list(GPU_LAYOUTS))
def test_sparse_mla_glm5_shapes_on_gpu(heads, layout, monkeypatch):
    import breakgraph.kernels.triton_sparse_mla as tsm
    from breakgraph.kernels.sparse_mla import sparse_mla_attention, sparse_mla_attention_ref

    calls = []
    real = tsm.sparse_mla_attention_triton
    monkeypatch.setattr(tsm, "sparse_mla_attention_triton", lambda *a, **k: (calls.append(1), real(*a, **k)))
    batch = _gpu_batch(layout, seed=heads)
    q, kv, tk = mla_inputs(batch, heads, RANK, ROPE, TOPK, torch.bfloat16, device="cuda", seed=heads)
    args = (tk, batch["page_table"], batch["token_req"], PAGE, GLM5_SCALE)
    out = torch.full((q.shape[0], heads, RANK), float("nan"), dtype=torch.bfloat16, device="cuda")
    sparse_mla_attention(q, kv, *args, out)
    assert calls, "the dispatcher did not take the Triton path on CUDA"
    ref = torch.empty(q.shape[0], heads, RANK, device="cuda")
    with _fp32_reference():
        sparse_mla_attention_ref(q.float(), kv.float(), *args, ref)
    floor, err = rel_err(ref.bfloat16(), ref), rel_err(out, ref)
    assert err <= 2 * floor, f"error {err:.2e} vs bf16 rounding floor {floor:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("heads", [8, 64])
def test_decode_packed_rows_glm5_shapes_on_gpu(heads, kv_dtype):
    """A decode batch of 64 contexts from 100 to 4000 tokens (most shorter than K = 2048), packed
    rows (as the indexer writes them) with wrong positions past each row's last 64-key block,
    ``packed_rows`` through the dispatcher (split-K): within twice the bf16 rounding of the fp32
    twin on the clean rows (the FP8 cache: three times, against the twin on the same cache, as
    ``test_kernels_latent_fp8.py`` bounds it)."""
    from breakgraph.kernels.latent_fp8 import quantize_latent_ref
    from breakgraph.kernels.sparse_mla import sparse_mla_attention, sparse_mla_attention_ref

    prefix = [int(x) for x in torch.randint(100, 4000, (64,), generator=torch.Generator().manual_seed(heads))]
    batch = make_batch(prefix, [1] * 64, page_size=PAGE, device="cuda", seed=heads)
    q, kv, _ = mla_inputs(batch, heads, RANK, ROPE, TOPK, torch.bfloat16, device="cuda", seed=heads)
    if kv_dtype == "fp8":
        kv = quantize_latent_ref(kv, RANK)
    pos = batch["positions"]
    tk = packed_topk(pos.cpu(), TOPK, seed=heads)
    poisoned = tk.clone()
    for t, p in enumerate(pos.tolist()):
        end = -(-min(TOPK, p + 1) // 64) * 64
        poisoned[t, end:] = torch.randint(0, p + 1, (TOPK - end,), dtype=torch.int32)
    rest = (batch["page_table"], batch["token_req"], PAGE, GLM5_SCALE)
    out = torch.full((q.shape[0], heads, RANK), float("nan"), dtype=torch.bfloat16, device="cuda")
    sparse_mla_attention(q, kv, poisoned.cuda(), *rest, out, positions=pos, packed_rows=True)
    ref = torch.empty(q.shape[0], heads, RANK, device="cuda")
    with _fp32_reference():
        sparse_mla_attention_ref(q.float(), kv if kv_dtype == "fp8" else kv.float(), tk.cuda(), *rest, ref)
    floor, err = rel_err(ref.bfloat16(), ref), rel_err(out, ref)
    assert err <= (3 if kv_dtype == "fp8" else 2) * floor, f"error {err:.2e} vs bf16 rounding floor {floor:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("heads", [8, 64])
def test_decode_causal_rows_glm5_shapes_on_gpu(heads, kv_dtype):
    """A decode batch of 64 contexts from 1 to K = 2048 tokens, ``causal_rows`` through the
    dispatcher on a ``topk_pos`` of random wrong positions (which it must not read): within
    twice the bf16 rounding of the fp32 twin on the causal rows (the FP8 cache: three times)."""
    from breakgraph.kernels.causal_topk import causal_topk_ref
    from breakgraph.kernels.latent_fp8 import quantize_latent_ref
    from breakgraph.kernels.sparse_mla import sparse_mla_attention, sparse_mla_attention_ref

    prefix = [int(x) for x in torch.randint(0, TOPK, (64,), generator=torch.Generator().manual_seed(heads + 1))]
    batch = make_batch(prefix, [1] * 64, page_size=PAGE, device="cuda", seed=heads + 1)
    q, kv, _ = mla_inputs(batch, heads, RANK, ROPE, TOPK, torch.bfloat16, device="cuda", seed=heads + 1)
    if kv_dtype == "fp8":
        kv = quantize_latent_ref(kv, RANK)
    pos = batch["positions"]
    causal = torch.empty(q.shape[0], TOPK, dtype=torch.int32, device="cuda")
    causal_topk_ref(pos, causal)
    garbage = torch.stack([torch.randint(0, p + 1, (TOPK,), dtype=torch.int32) for p in pos.tolist()]).cuda()
    rest = (batch["page_table"], batch["token_req"], PAGE, GLM5_SCALE)
    out = torch.full((q.shape[0], heads, RANK), float("nan"), dtype=torch.bfloat16, device="cuda")
    sparse_mla_attention(q, kv, garbage, *rest, out, positions=pos, causal_rows=True)
    ref = torch.empty(q.shape[0], heads, RANK, device="cuda")
    with _fp32_reference():
        sparse_mla_attention_ref(q.float(), kv if kv_dtype == "fp8" else kv.float(), causal, *rest, ref)
    floor, err = rel_err(ref.bfloat16(), ref), rel_err(out, ref)
    assert err <= (3 if kv_dtype == "fp8" else 2) * floor, f"error {err:.2e} vs bf16 rounding floor {floor:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("opts", [{}, {"lean": True, "groups": 1, "lazy": 8.0}, {"block_h": 16}, {"block_n": 64},
                                  {"block_n": 64, "num_warps": 8}])  # fmt: skip
@pytest.mark.parametrize("layout", list(GPU_LAYOUTS))
def test_sparse_mla_variants_glm5_shapes_on_gpu(opts, layout):
    """The column-group kernel (the default at 8 heads: 8-row head blocks; 16-row blocks, 64-key
    blocks on 4 and 8 warps) and the lean loop in one group, with the lazy rescale (prefill and
    split-K decode, rows shorter and longer than K): within 2× the bf16 output rounding of the
    fp32 twin."""
    from breakgraph.kernels.sparse_mla import sparse_mla_attention_ref
    from breakgraph.kernels.triton_sparse_mla import sparse_mla_attention_triton

    batch = _gpu_batch(layout, seed=3)
    q, kv, tk = mla_inputs(batch, 8, RANK, ROPE, TOPK, torch.bfloat16, device="cuda", seed=3)
    args = (tk, batch["page_table"], batch["token_req"], PAGE, GLM5_SCALE)
    out = torch.full((q.shape[0], 8, RANK), float("nan"), dtype=torch.bfloat16, device="cuda")
    sparse_mla_attention_triton(q, kv, *args, out, **opts)
    ref = torch.empty(q.shape[0], 8, RANK, device="cuda")
    with _fp32_reference():
        sparse_mla_attention_ref(q.float(), kv.float(), *args, ref)
    floor, err = rel_err(ref.bfloat16(), ref), rel_err(out, ref)
    assert err <= 2 * floor, f"error {err:.2e} vs bf16 rounding floor {floor:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("heads", [8, 64])
@pytest.mark.parametrize("layout", ["prefill1024_fresh", "prefill1024_on_1000", "prefill4096"])
def test_sparse_mla_dense_causal_path_glm5_shapes_on_gpu(heads, layout):
    """The engine's call (positions, ``dense_below = K``) through the dispatcher: a fresh
    1k prefill (every token dense; at 8 heads its key ranges split into chunks), 1k tokens on
    a 1000-token prefix (all dense, one chunk each) and 4096 tokens of two
    requests, one on a 1k prefix (tokens on both sides of K, a block straddling them). Within
    2× the bf16 rounding of the fp32 twin; the dense blocks ignore their (emptied) top-k rows."""
    from breakgraph.kernels.sparse_mla import sparse_mla_attention, sparse_mla_attention_ref
    from breakgraph.kernels.triton_dense_mla import dense_config

    lens = {"prefill1024_fresh": ([0], [1024]), "prefill1024_on_1000": ([1000], [1024])}.get(layout)
    lens = lens or GPU_LAYOUTS[layout]
    batch = make_batch(*lens, page_size=PAGE, device="cuda", seed=heads)
    q, kv, tk = mla_inputs(batch, heads, RANK, ROPE, TOPK, torch.bfloat16, device="cuda", seed=heads)
    pos, rest = batch["positions"], (batch["page_table"], batch["token_req"], PAGE, GLM5_SCALE)

    def run(topk_pos):
        out = torch.full((q.shape[0], heads, RANK), float("nan"), dtype=torch.bfloat16, device="cuda")
        sparse_mla_attention(q, kv, topk_pos, *rest, out, positions=pos, dense_below=TOPK)
        return out

    out = run(tk)
    ref = torch.empty(q.shape[0], heads, RANK, device="cuda")
    with _fp32_reference():
        sparse_mla_attention_ref(q.float(), kv.float(), tk, *rest, ref)
    floor, err = rel_err(ref.bfloat16(), ref), rel_err(out, ref)
    assert err <= 2 * floor, f"error {err:.2e} vs bf16 rounding floor {floor:.2e}"
    dense = dense_tokens(batch, dense_config(heads)["block_t"], TOPK)
    assert dense.any()
    assert torch.equal(run(tk.masked_fill(dense[:, None], -1)), out), "dense blocks were not written densely"


@pytest.mark.cuda
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("tokens", [1024, 8192])
def test_dense_mla_pages_and_graph_replay_on_gpu(page, tokens):
    """The balanced dense-causal kernel alone at 8 heads on pages of 16 and 64: a fresh prompt (8192
    tokens: the 2048 below K) within 2× the bf16 rounding of the fp32 twin on those rows;
    captured once in a CUDA graph and replayed on another batch of the same shapes (a cached
    prefix shifts every position, so the plan and the shared token blocks change), the replay
    equals an eager call on that batch."""
    from breakgraph.kernels.sparse_mla import sparse_mla_attention_ref
    from breakgraph.kernels.triton_dense_mla import dense_mla_attention_triton

    heads, width = 8, tokens + 512
    first = make_batch([0], [tokens], page_size=page, device="cuda", seed=page)
    second = make_batch([300], [tokens], page_size=page, device="cuda", seed=page + 1)
    for b in (first, second):  # the same shapes: pad the page tables to one width
        pt = torch.zeros(1, -(-width // page), dtype=torch.int32, device="cuda")
        pt[:, : b["page_table"].shape[1]] = b["page_table"]
        b["page_table"] = pt
    slots = max(first["num_slots"], second["num_slots"])
    q, kv, tk = mla_inputs(first | {"num_slots": slots}, heads, RANK, ROPE, TOPK, torch.bfloat16, device="cuda")
    dense = first["positions"] < TOPK
    out = torch.full((tokens, heads, RANK), float("nan"), dtype=torch.bfloat16, device="cuda")
    pt, req, pos = (first[k].clone() for k in ("page_table", "token_req", "positions"))

    def call():
        dense_mla_attention_triton(q, kv, pt, req, pos, page, GLM5_SCALE, out, TOPK, balanced=True)

    call()
    rows = torch.arange(tokens, device="cuda")[dense]
    ref = torch.empty(rows.shape[0], heads, RANK, device="cuda")
    with _fp32_reference():
        sparse_mla_attention_ref(q[rows].float(), kv.float(), tk[rows], pt, req[rows], page, GLM5_SCALE, ref)
    floor, err = rel_err(ref.bfloat16(), ref), rel_err(out[rows], ref)
    assert err <= 2 * floor, f"error {err:.2e} vs bf16 rounding floor {floor:.2e}"

    graph = warmed_graph(call)
    for k, dst in (("page_table", pt), ("token_req", req), ("positions", pos)):
        dst.copy_(second[k])
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    got = out.clone()
    out.fill_(float("nan"))
    call()
    torch.cuda.synchronize()
    owned = dense_tokens(second, 8, TOPK)
    assert owned.any() and torch.equal(got[owned], out[owned]) and not torch.isnan(got[owned]).any()


def test_prefill_with_the_dense_path_does_not_split_k():
    """A 128-token prompt at 8 heads fills fewer programs than SMs: decode-style split-K would
    switch the dense-causal path off, so with ``dense`` asked for it splits only below
    ``DENSE_MIN_TOKENS`` tokens."""
    pytest.importorskip("triton")
    from breakgraph.kernels import triton_sparse_mla as tsm

    cpu = torch.device("cpu")
    assert tsm.default_config(128, 8, TOPK, cpu)["num_splits"] > 1
    assert tsm.default_config(128, 8, TOPK, cpu, dense=True)["num_splits"] == 1
    assert tsm.default_config(tsm.DENSE_MIN_TOKENS - 1, 8, TOPK, cpu, dense=True)["num_splits"] > 1


def test_dense_config_splits_keys_only_when_blocks_cannot_fill_the_gpu():
    """Chunks of half the longest key range (rounded down to the key block, at least two
    blocks) where the token blocks are fewer than the SMs (132 off CUDA) and the triangle is
    lopsided (no long cached prefix: tokens ≥ ⅔ of the longest range); one chunk otherwise.
    The key block is the largest of 64/32/16 dividing the page size."""
    from breakgraph.kernels.triton_dense_mla import dense_config

    cpu = torch.device("cpu")
    tiles = {ps: (dense_config(8, page_size=ps)["block_n"], dense_config(8, page_size=ps)["num_stages"])
             for ps in (128, 64, 32, 16, 8)}  # fmt: skip
    assert tiles == {128: (64, 2), 64: (64, 2), 32: (32, 3), 16: (16, 3), 8: (32, 2)}, tiles
    assert dense_config(20)["block_n"] == 16  # head block not a power of two
    assert dense_config(8, 88, 72, cpu, page_size=16)["chunk_keys"] == 32  # 36 keys, rounded down to 16
    assert dense_config(8, 88, 72, cpu)["chunk_keys"] == 128  # two 64-key blocks at least
    assert dense_config(8, 1024, 1088, cpu)["chunk_keys"] == 512  # fresh 1k (pages for 1088 keys)
    assert dense_config(8, 1024, 600, cpu)["chunk_keys"] == 256  # the page table bounds the keys
    assert dense_config(8, 1024, 2048, cpu)["chunk_keys"] == 0  # on a 1k prefix: every block is long
    assert dense_config(8, 4096, 2048, cpu)["chunk_keys"] == 0  # 512 blocks fill the GPU
    assert dense_config(16, 1024, 1024, cpu)["chunk_keys"] == 0
    assert dense_config(64, 1024, 1024, cpu)["chunk_keys"] == 0
    assert dense_config(8)["chunk_keys"] == 0  # no shape: one chunk


def test_dense_mla_kernel_choice_follows_page_size_and_knob(monkeypatch):
    """By default (``auto``) the balanced kernel at pages under 64 tokens and the chunked one from
    64; BREAKGRAPH_DENSE_MLA_BALANCED=1/0 forces one, an explicit ``balanced`` argument wins over
    the variable, and a bad value names it."""
    from breakgraph.kernels import triton_dense_mla as tdm

    calls = []
    monkeypatch.setattr(tdm, "_balanced", lambda *a: calls.append("balanced") or 8)
    monkeypatch.setattr(tdm, "_chunked", lambda *a: calls.append("chunked") or 8)

    def args(page_size):
        return (None,) * 5 + (page_size, None, None, TOPK)

    monkeypatch.delenv("BREAKGRAPH_DENSE_MLA_BALANCED", raising=False)
    tdm.dense_mla_attention_triton(*args(16))
    tdm.dense_mla_attention_triton(*args(64))
    tdm.dense_mla_attention_triton(*args(64), balanced=True)
    monkeypatch.setenv("BREAKGRAPH_DENSE_MLA_BALANCED", "1")
    tdm.dense_mla_attention_triton(*args(64))
    tdm.dense_mla_attention_triton(*args(16), balanced=False)
    monkeypatch.setenv("BREAKGRAPH_DENSE_MLA_BALANCED", "0")
    tdm.dense_mla_attention_triton(*args(16))
    assert calls == ["balanced", "chunked", "balanced", "balanced", "chunked", "chunked"]
    monkeypatch.setenv("BREAKGRAPH_DENSE_MLA_BALANCED", "yes")
    with pytest.raises(ValueError, match="BREAKGRAPH_DENSE_MLA_BALANCED"):
        tdm.dense_mla_attention_triton(*args(16))


def test_balanced_config_tiles_do_not_depend_on_the_page():
    """The balanced kernel: 64-key blocks whatever the page (16 where the head block is not a power of two), up to 64
    query rows per program, and one forward program per SM (132 off CUDA) over the head blocks."""
    from breakgraph.kernels.triton_dense_mla import balanced_config

    cpu = torch.device("cpu")
    assert balanced_config(8, cpu) == {"block_t": 8, "heads": 8, "block_n": 64, "num_warps": 8, "num_stages": 2,
                                    "programs": 132, "partial_dtype": torch.float32}  # fmt: skip
    assert balanced_config(16, cpu)["block_t"] == 4 and balanced_config(64, cpu)["block_t"] == 1
    assert balanced_config(20, cpu)["block_n"] == 16  # head block not a power of two
    assert balanced_config(128, cpu)["programs"] == 66  # two head blocks


def test_indexer_stacked_tiles_stay_within_256_query_rows():
    """Default stacked tiles hold at most 256 query rows (tokens × padded heads) for every head
    count the kernel takes, and a larger explicit tile is refused before launch (16 × 32 rows
    gave wrong sums on the H200)."""
    from breakgraph.kernels.triton_indexer import default_config, indexer_scores_triton

    cpu = torch.device("cpu")
    for heads in (8, 32, 64, 128):
        for fp8 in (0, 1, 2):
            cfg = default_config(4096, 1, heads, 8192, cpu, fp8)
            assert cfg["stacked"] and 2 <= cfg["block_t"] and cfg["block_t"] * max(16, heads) <= 256, (heads, cfg)
    batch = make_batch(**_RAGGED, page_size=4)
    q, w, kc = indexer_inputs(batch, 32, 32, torch.bfloat16)
    args = (batch["page_table"], batch["token_req"], batch["positions"], 4, 0.2)
    with pytest.raises(ValueError, match="block_t=16"):
        indexer_scores_triton(q, w, kc, *args, torch.empty(q.shape[0], 64), block_t=16)


def test_indexer_scores_compile_for_sm90_without_spills():
    """ptxas for sm_90a at the default prefill (stacked) config, GLM-5 shapes: wgmma, and no
    spills within its register cap (128: two programs of 8 warps per SM)."""
    from test_kernels_fp8 import compile_for_sm90

    from breakgraph.kernels.triton_indexer import _indexer_scores_kernel, default_config

    cfg = default_config(4096, 1, IDX_HEADS, 4096, torch.device("cpu"))
    a = dict(Q="*bf16", W="*fp32", K="*bf16", PAGE_TABLE="*i32", TOKEN_REQ="*i64", POSITIONS="*i64",
             SCORES="*fp32", stride_qt=IDX_HEADS * IDX_DIM, stride_qh=IDX_DIM, stride_wt=IDX_HEADS, stride_k=IDX_DIM,
             stride_pt=37, stride_st=4096, num_tokens=4096, num_heads=IDX_HEADS, head_dim=IDX_DIM, page_size=PAGE,
             skip_below=TOPK, scale=0.088, segments=1)  # fmt: skip
    consts = dict(BLOCK_T=cfg["block_t"], BLOCK_H=IDX_HEADS, BLOCK_D=IDX_DIM, BLOCK_L=cfg["block_l"], FP8=0,
                  STACKED=cfg["stacked"], PAGE_SHIFT=PAGE.bit_length() - 1, ROWS_I32=True)  # fmt: skip
    info = compile_for_sm90(_indexer_scores_kernel, a, consts, cfg["num_warps"], cfg["num_stages"], cfg["maxnreg"])
    print(f"indexer scores {cfg}: {info}")
    assert cfg["stacked"] and info["mma"] == ["HGMMA"], info
    assert info["regs"] <= cfg["maxnreg"] and info["stack"] == 0 and info["local_insts"] == 0, info
    # The power-of-two page takes shifts: no emulated division call in the key loop.
    assert "CALL.REL.NOINC" not in info["loop_ops"], info["loop_ops"]


@pytest.mark.parametrize("heads", [8, 64])
def test_sparse_mla_kernels_compile_for_sm90_without_spills(heads):
    """ptxas for sm_90a (no GPU needed), with the engine's GLM-5 arguments specialised as the
    JIT specialises them: the dense-causal kernel (wgmma, with and without key chunks) at its
    default configs for pages of 64 and 16 tokens, its merge kernel and the sparse kernel
    carrying the dense-block check. The merge kernel spills nothing; the dense kernel at most
    128 bytes (ptxas keeps 80–112 bytes on the stack with the 64-key blocks the H200 sweep
    measured fastest, 0–32 with 16-key blocks); the sparse kernel spills nothing except where
    its default caps the registers (few heads), at most 128 bytes. Under split-K (decode) the
    engine's rows are packed (``PACKED``): the split column-group kernels compile with it."""
    pytest.importorskip("triton")
    from test_kernels_fp8 import compile_for_sm90

    from breakgraph.kernels import triton_dense_mla as tdm
    from breakgraph.kernels import triton_sparse_mla as tsm

    sparse = tsm.default_config(4096, heads, TOPK, torch.device("cpu"))
    a = dict(
        Q="*bf16", KV="*bf16", TOPK="*i32", PAGE_TABLE="*i32", TOKEN_REQ="*i64", POSITIONS="*i64", OUT="*bf16",
        WS_O="*fp32", WS_LSE="*fp32", stride_qt=heads * 576, stride_qh=576, stride_kv=576, stride_tk=TOPK,
        stride_pt=37, stride_ot=heads * RANK, stride_oh=RANK, num_tokens=4095, num_heads=heads, topk=TOPK,
        rank=RANK, rope_dim=ROPE, page_size=64, keys_per_split=TOPK, num_splits=1, dense_below=TOPK, qk_scale=0.1,
        chunk_keys=512, num_chunks=4,
    )  # fmt: skip
    for page in (64, 16):
        dense = tdm.dense_config(heads, page_size=page)
        assert dense["block_n"] == (64 if page == 64 else 16), dense
        block_m = tdm._pow2(dense["block_t"] * dense["heads"])
        for split in (False, True):
            consts = dict(BLOCK_T=dense["block_t"], HEADS=dense["heads"], BLOCK_M=block_m, BLOCK_N=dense["block_n"],
                          BLOCK_R=RANK, BLOCK_PE=ROPE, SPLIT=split, PAGE_BLOCKS=True)  # fmt: skip
            info = compile_for_sm90(tdm._dense_mla_fwd_kernel, a | {"page_size": page}, consts, dense["num_warps"],
                                    dense["num_stages"])  # fmt: skip
            assert info["mma"] == ["HGMMA"], (page, split, info)
            assert info["stack"] <= 128, (page, split, info)
    consts = dict(BLOCK_T=dense["block_t"], HEADS=dense["heads"], BLOCK_M=block_m, BLOCK_R=RANK,
                  BLOCK_C=tdm._MERGE_COLS)  # fmt: skip
    info = compile_for_sm90(tdm._dense_mla_merge_kernel, a, consts, 4, 2)
    assert info["stack"] == 0 and info["local_insts"] == 0, info
    # The slots loop keeps 16-row head blocks (the launcher's fallback where the lean loop does not fit).
    consts = dict(BLOCK_H=max(16, sparse["block_h"]), BLOCK_N=sparse["block_n"], BLOCK_R=RANK, BLOCK_PE=ROPE,
                  SPLIT=False, DENSE_T=dense["block_t"], SLOTS=sparse["slots"], PAGE_SHIFT=6)  # fmt: skip
    info = compile_for_sm90(tsm._sparse_mla_fwd_kernel, a, consts, sparse["num_warps"], sparse["num_stages"],
                            sparse["maxnreg"])  # fmt: skip
    if sparse["maxnreg"]:
        assert info["regs"] <= sparse["maxnreg"] and info["stack"] <= 128, info
    else:
        assert info["stack"] == 0 and info["local_insts"] == 0, info
    decode = tsm.default_config(16, heads, TOPK, torch.device("cpu"))  # split-K, packed rows
    if decode["groups"] != 4:  # 64 heads: the fwd kernel (8 heads: the column-group kernel below)
        consts = dict(BLOCK_H=decode["block_h"], BLOCK_N=decode["block_n"], BLOCK_R=RANK, BLOCK_PE=ROPE, SPLIT=True,
                      DENSE_T=0, SLOTS=decode["slots"] or decode["lean"], LEAN=decode["lean"],
                      LAZY=float(decode["lazy"] or 0), PAGE_SHIFT=6, PACKED=True)  # fmt: skip
        info = compile_for_sm90(tsm._sparse_mla_fwd_kernel, a, consts, decode["num_warps"], decode["num_stages"],
                                decode["maxnreg"])  # fmt: skip
        print(f"decode fwd kernel, {heads} heads, packed: {info['regs']} registers, {info['stack']} bytes of stack")
        assert info["stack"] == 0 and info["local_insts"] == 0, ("decode", info)
        if not consts["SLOTS"]:  # causal rows made in the loop (contexts of at most K tokens)
            info = compile_for_sm90(tsm._sparse_mla_fwd_kernel, a, consts | dict(CAUSAL=True), decode["num_warps"],
                                    decode["num_stages"], decode["maxnreg"])  # fmt: skip
            print(f"decode fwd kernel, {heads} heads, causal rows: {info['regs']} registers")
            assert info["stack"] == 0 and info["local_insts"] == 0, ("decode causal", info)
            # prefill beside the dense path, one split: the causal loop bounded at the row's keys
            info = compile_for_sm90(tsm._sparse_mla_fwd_kernel, a, consts | dict(SPLIT=False, DENSE_T=dense["block_t"],
                                    CAUSAL=True), sparse["num_warps"], sparse["num_stages"], sparse["maxnreg"])  # fmt: skip
            print(f"prefill fwd kernel, {heads} heads, causal rows: {info['regs']} registers")
            assert info["stack"] == 0 and info["local_insts"] == 0, ("prefill causal", info)
    if heads == 8:  # the lean loop with the lazy rescale at the bench's tiles: no spills at all
        for bn, warps, stages, cap in ((32, 4, 2, 168), (64, 8, 2, None), (32, 4, 3, 168)):
            lean = consts | dict(BLOCK_N=bn, SLOTS=True, LEAN=True, LAZY=8.0)
            info = compile_for_sm90(tsm._sparse_mla_fwd_kernel, a, lean, warps, stages, cap)
            assert info["stack"] == 0 and info["local_insts"] == 0, (bn, warps, stages, info)
        groups = dict(BLOCK_R=RANK, BLOCK_PE=ROPE, DENSE_T=dense["block_t"], LAZY=8.0)
        for bh, bn, warps, split in ((8, 32, 4, False), (8, 32, 4, True), (16, 32, 4, False), (16, 32, 4, True),
                                     (8, 64, 4, False), (8, 64, 8, False)):  # fmt: skip
            consts = groups | dict(BLOCK_H=bh, BLOCK_N=bn, SPLIT=split, PACKED=split)  # packed rows: split-K only
            info = compile_for_sm90(tsm._sparse_mla_groups_kernel, a, consts, warps, 2)
            print(f"column groups {bh}×{bn}, {warps} warps, split {split}: {info['regs']} registers")
            assert info["stack"] == 0 and info["local_insts"] == 0, (bh, bn, warps, split, info)
            assert bn != 32 or warps != 4 or split or info["regs"] <= 128, info  # four programs per SM by registers
        # why packed rows are bounded under split-K only: the bound costs this one registers
        info = compile_for_sm90(tsm._sparse_mla_groups_kernel, a, groups | dict(BLOCK_H=16, BLOCK_N=32, SPLIT=False,
                                PACKED=True), 4, 2)  # fmt: skip
        print(f"column groups 16×32, 4 warps, no split, packed (not launched): {info['regs']} registers")


@pytest.mark.parametrize("heads", [8, 64])
def test_dense_mla_balanced_kernels_compile_for_sm90_without_spills(heads):
    """ptxas for sm_90a (no GPU needed), with the engine's GLM-5 arguments specialised as the
    JIT specialises them: the balanced dense-causal kernel at its default config (and the 32-key
    blocks the GPU check sweeps) uses wgmma and 16-byte async copies for its key rows and spills
    nothing inside its key loop (the 255-register program keeps a few hundred bytes on the
    stack across its token-block switches, outside that loop); its plan and merge kernels spill
    nothing."""
    pytest.importorskip("triton")
    from test_kernels_fp8 import compile_for_sm90

    from breakgraph.kernels import triton_dense_mla as tdm

    a = dict(
        Q="*bf16", KV="*bf16", TOPK="*i32", PAGE_TABLE="*i32", TOKEN_REQ="*i64", POSITIONS="*i64", OUT="*bf16",
        WS_O="*fp32", WS_LSE="*fp32", START="*i32", stride_qt=heads * 576, stride_qh=576,
        stride_kv=576, stride_tk=TOPK, stride_pt=37, stride_ot=heads * RANK, stride_oh=RANK, num_tokens=4095,
        num_heads=heads, topk=TOPK, rank=RANK, rope_dim=ROPE, page_size=16, page_shift=4, keys_per_split=TOPK,
        num_splits=1, dense_below=TOPK, qk_scale=0.1, num_blocks=512, num_programs=132,
    )  # fmt: skip
    dense = tdm.balanced_config(heads)
    block_m = tdm._pow2(dense["block_t"] * dense["heads"])
    for bn, stages in ((dense["block_n"], dense["num_stages"]), (32, 3)):
        consts = dict(BLOCK_T=dense["block_t"], HEADS=dense["heads"], BLOCK_M=block_m, BLOCK_N=bn, BLOCK_R=RANK,
                      BLOCK_PE=ROPE, POW2_PAGE=True, ROW32=True)  # fmt: skip
        info = compile_for_sm90(tdm._dense_mla_balanced_kernel, a, consts, dense["num_warps"], stages)
        print(f"dense H={heads} bn={bn} stages={stages}: {info}")
        assert info["mma"] == ["HGMMA"] and info["async_copies_16B"] > 0, (bn, info)
        assert info["mma_loop_spills"] == 0 and info["stack"] <= 512, (bn, info)
    consts = dict(BLOCK_T=dense["block_t"], HEADS=dense["heads"], BLOCK_M=block_m, BLOCK_R=RANK,
                  BLOCK_C=tdm._MERGE_COLS)  # fmt: skip
    info = compile_for_sm90(tdm._dense_mla_balanced_merge_kernel, a, consts, 4, 2)
    assert info["stack"] == 0 and info["local_insts"] == 0, info
    consts = dict(BLOCK_T=dense["block_t"], BLOCK_N=dense["block_n"], CHUNK=tdm._PLAN_TOKENS // dense["block_t"])
    info = compile_for_sm90(tdm._dense_plan_kernel, a, consts, 8, 2)
    assert info["stack"] == 0 and info["local_insts"] == 0, info


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("layout", list(GPU_LAYOUTS))
def test_indexer_glm5_shapes_on_gpu(fp8, layout, monkeypatch):
    import breakgraph.kernels.triton_indexer as ti
    from breakgraph.kernels.indexer import indexer_topk, indexer_topk_ref
    from breakgraph.kernels.triton_indexer import indexer_scores_triton

    monkeypatch.setenv("BREAKGRAPH_INDEXER_FP8", "1" if fp8 else "0")
    calls = []
    real = ti.indexer_topk_triton
    monkeypatch.setattr(ti, "indexer_topk_triton", lambda *a, **k: (calls.append(k["fp8"]), real(*a, **k)))
    batch = _gpu_batch(layout, seed=7)
    q, w, kc = indexer_inputs(batch, IDX_HEADS, IDX_DIM, torch.bfloat16, device="cuda", seed=7)
    args = (batch["page_table"], batch["token_req"], batch["positions"], PAGE, IDX_DIM**-0.5)
    max_len = batch["page_table"].shape[1] * PAGE
    scores = torch.full((q.shape[0], max_len), float("nan"), device="cuda")
    indexer_scores_triton(q, w, kc, *args, scores, fp8=fp8)
    with _fp32_reference():
        exact = indexer_scores_ref(q, w, kc, batch, IDX_DIM**-0.5, dtype=torch.float32)
    fin = torch.isfinite(exact)
    assert torch.equal(~torch.isnan(scores), fin), "written region is not each row's causal range"
    err = rel_err(scores[fin], exact[fin])
    if fp8:
        with _fp32_reference():
            emu = indexer_scores_ref(q, w, kc, batch, IDX_DIM**-0.5, dtype=torch.float32, fp8=True)
        assert rel_err(scores[fin], emu[fin]) <= 1e-3 and err <= 6e-2
    else:
        assert err <= 1e-4
    got = torch.full((q.shape[0], TOPK), -7, dtype=torch.int32, device="cuda")
    want = torch.empty_like(got)
    indexer_topk(q, w, kc, *args, got)
    assert calls == [fp8], "the dispatcher did not take the Triton path with the requested precision"
    with _fp32_reference():
        indexer_topk_ref(q, w, kc, *args, want)
    check_topk(got, want, exact.double(), batch["positions"], 0.15 if fp8 else 1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("row_len", [4096, 16384, 131072])
def test_topk_select_matches_torch_topk_on_gpu(row_len):
    """Long ragged rows (shorter and longer than K): the radix select's set equals
    torch.topk's on random fp32 scores, reading only the causal range."""
    from breakgraph.kernels.triton_indexer import topk_select_triton

    g = torch.Generator(device="cuda").manual_seed(row_len)
    rows = 64
    pos = torch.randint(0, row_len, (rows,), generator=g, device="cuda")
    pos[:4] = torch.tensor([0, TOPK - 1, TOPK, row_len - 1], device="cuda")
    scores = torch.randn(rows, row_len, generator=g, device="cuda")
    j = torch.arange(row_len, device="cuda")
    poisoned = scores.masked_fill(j[None, :] > pos[:, None], float("nan"))
    got = torch.full((rows, TOPK), -7, dtype=torch.int32, device="cuda")
    topk_select_triton(poisoned, pos, got)
    masked = scores.masked_fill(j[None, :] > pos[:, None], float("-inf"))
    vals, idx = masked.topk(TOPK, dim=1)
    want = torch.where(torch.isinf(vals), -1, idx).sort(dim=1).values
    got_sorted = torch.where(got < 0, row_len, got).sort(dim=1).values
    want_sorted = torch.where(want < 0, row_len, want).sort(dim=1).values
    assert torch.equal(got_sorted, want_sorted), "selected set differs from torch.topk"


@pytest.mark.cuda
def test_decode_indexer_is_length_true_in_a_long_context_pool():
    """A short decode sequence costs and selects the same whatever the page table's width:
    the same top-k and the same grid for an 8K- and a 200K-token configured context."""
    import breakgraph.kernels.triton_indexer as ti
    from breakgraph.kernels.indexer import indexer_topk

    lens = [1000 + 500 * i for i in range(4)] + [5000, 6000]  # below and above K
    batch = make_batch(lens, [1] * len(lens), page_size=PAGE, device="cuda", seed=2)
    q, w, kc = indexer_inputs(batch, IDX_HEADS, IDX_DIM, torch.bfloat16, device="cuda", seed=2)
    results, grids = [], []
    for context in (8192, 200_000):
        pages = -(-context // PAGE)
        table = torch.zeros(len(lens), pages, dtype=torch.int32, device="cuda")
        table[:, : batch["page_table"].shape[1]] = batch["page_table"]
        out = torch.full((len(lens), TOPK), -7, dtype=torch.int32, device="cuda")
        indexer_topk(q, w, kc, table, batch["token_req"], batch["positions"], PAGE, IDX_DIM**-0.5, out,
                     max_seq_len=context)  # fmt: skip
        results.append(out.sort(dim=1).values)
        grids.append(ti.default_config(len(lens), len(lens), IDX_HEADS, context, q.device)["key_programs"])
    assert torch.equal(results[0], results[1])
    assert grids[0] == grids[1], f"score grid grows with the configured context: {grids}"


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["prefill1024", "prefill4096", "decode64"])
def test_kernels_replay_in_cuda_graph_with_new_inputs(layout):
    """Capture indexer + sparse MLA once, called as the engine calls them (positions and
    ``dense_below = K``); refill the static inputs; replay equals eager."""
    from breakgraph.kernels.indexer import indexer_topk
    from breakgraph.kernels.sparse_mla import sparse_mla_attention

    batch = _gpu_batch(layout, seed=3)
    heads = 8
    q, kv, _ = mla_inputs(batch, heads, RANK, ROPE, TOPK, torch.bfloat16, device="cuda", seed=3)
    qi, w, kc = indexer_inputs(batch, IDX_HEADS, IDX_DIM, torch.bfloat16, device="cuda", seed=3)
    pt, req, pos = batch["page_table"], batch["token_req"], batch["positions"]
    topk = torch.empty(q.shape[0], TOPK, dtype=torch.int32, device="cuda")
    out = torch.empty(q.shape[0], heads, RANK, dtype=torch.bfloat16, device="cuda")

    def step():
        indexer_topk(qi, w, kc, pt, req, pos, PAGE, IDX_DIM**-0.5, topk)
        sparse_mla_attention(q, kv, topk, pt, req, PAGE, GLM5_SCALE, out, positions=pos, dense_below=TOPK)

    graph = warmed_graph(step)

    q2, kv2, _ = mla_inputs(batch, heads, RANK, ROPE, TOPK, torch.bfloat16, device="cuda", seed=11)
    qi2, w2, kc2 = indexer_inputs(batch, IDX_HEADS, IDX_DIM, torch.bfloat16, device="cuda", seed=11)
    for dst, src in ((q, q2), (kv, kv2), (qi, qi2), (w, w2), (kc, kc2)):
        dst.copy_(src)
    topk.fill_(-7)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    got_topk, got_out = topk.clone(), out.clone()
    step()
    torch.cuda.synchronize()
    assert torch.equal(got_topk, topk)
    assert torch.equal(got_out, out)
    assert not torch.isnan(got_out).any()


if __name__ == "__main__":  # child process of the interpreter checks
    _install_interpreter_fixes()
    globals()[sys.argv[1]]()
