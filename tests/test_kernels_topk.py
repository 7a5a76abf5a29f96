"""The DSA top-k select (``breakgraph.kernels.triton_topk``) against an exact torch reference.

CPU: every method (range, split, radix) with its defaults and with small blocks, few bins and
several programs per row (rows span many blocks and parts) runs under Triton's interpreter in a
child process on rows built to break a select: all-negative rows, ``+0.0``/``-0.0`` ties, many
ties at the K-th score, ties in the lowest key bits, constant rows, outliers far and less far
above the rest, a range wider than fp32's ``max − min``, consecutive floats; NaN past each row's
position proves it uses only the causal range. The rows take each of the range select's ways
(threshold bin listed after one or two histogram levels, or the radix select over the row),
checked by predicting each row's way in torch.
The sm_90a compiles of the default launches are checked for spills and vectorised loads.
GPU (``-m cuda``): the methods (:data:`GPU_VARIANTS`) on ragged rows up to 128K keys (shorter and
longer than K, the hard rows stretched to thousands of keys); all rows of an 8192-token prefill;
the indexer's own score distribution on a ragged batch with cached prefixes, also through
``indexer_topk_triton``; replay in a CUDA graph.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TOPK = 2048


def exact_topk(scores: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """The contract, row by row in plain torch: the ``topk`` positions ``j ≤ positions[t]`` with
    the largest scores, the lowest positions among ties at the ``topk``-th, ascending; rows with
    fewer keys give ``0…positions[t]`` then ``-1``."""
    out = torch.full((scores.shape[0], topk), -1, dtype=torch.int32, device=scores.device)
    for t, p in enumerate(positions.tolist()):
        vals = scores[t, : p + 1]
        if p + 1 <= topk:
            out[t, : p + 1] = torch.arange(p + 1, device=scores.device, dtype=torch.int32)
            continue
        kth = vals.topk(topk).values[-1]
        above = (vals > kth).nonzero().flatten()
        ties = (vals == kth).nonzero().flatten()
        out[t] = torch.cat([above, ties[: topk - above.numel()]]).sort().values.int()
    return out


def assert_packed(rows: torch.Tensor, positions: torch.Tensor, topk: int, what: str) -> None:
    """The packing the sparse attention relies on (``packed_rows``): each row's first
    ``min(topk, pos + 1)`` columns hold keys (``≥ 0``), the rest ``-1``."""
    count = (positions.to(rows.device) + 1).clamp(max=topk)
    cols = torch.arange(rows.shape[1], device=rows.device)
    want_key = cols[None, :] < count[:, None]
    bad = ((rows >= 0) != want_key) | (~want_key & (rows != -1))
    assert not bad.any(), f"{what}: rows {bad.any(1).nonzero().flatten().tolist()} are not packed"


def canonical(rows: torch.Tensor) -> torch.Tensor:
    """Each row's positions in ascending order, its ``-1`` padding last: the select writes a
    row's keys above the threshold bin first, then the bin's selected ones (each part ascending),
    so rows compare as sets through this."""
    big = torch.iinfo(rows.dtype).max
    ordered = torch.where(rows < 0, big, rows).sort(dim=-1).values
    return torch.where(ordered == big, -1, ordered)


def hard_rows(topk: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores ``[18, width]``, positions ``[18]``): random rows across six decades of scale, and
    one row per way to break a select (module docstring), their lengths ``topk / 24`` times those
    of the ``topk = 24``, ``width = 300`` original (so the pattern rows stay longer than K)."""
    g = torch.Generator().manual_seed(seed)
    s = topk / 24

    def n(x):
        return round(x * s)

    lens = [1, 6, topk, topk + 1, topk + 2, n(70), n(150), width, n(180), 4, n(120), n(200), width, n(250), n(260),
            n(280), n(270), n(290)]  # fmt: skip
    assert max(lens) <= width
    pos = torch.tensor(lens) - 1
    scores = torch.randn(pos.shape[0], width, generator=g) * torch.logspace(-3, 3, pos.shape[0])[:, None]
    scores[1] = -scores[1].abs()
    scores[5, : n(71)] = torch.randint(-1, 2, (n(71),), generator=g).float() * 0.0  # +0.0 and -0.0 tie
    scores[5, [2, 9, 40]] = 5.0
    scores[10, : n(121)] = torch.randint(0, 3, (n(121),), generator=g).float()  # many ties at the K-th
    scores[11, : n(201)] = 1.0 + torch.randint(0, 2, (n(201),), generator=g).float() * 2**-20  # low-bit ties
    scores[12] = 0.75  # constant
    scores[13, : n(251)] = torch.rand(n(251), generator=g)
    scores[13, 7] = 1e6  # an outlier far above the rest
    scores[14, : n(261)] = torch.randn(n(261), generator=g) * 1e37
    scores[14, 3], scores[14, 4] = 3e38, -3e38  # max − min overflows fp32
    scores[15, : n(281)] = 1.0 + torch.arange(n(281)).float() * 2**-23  # consecutive floats
    for t, sink in ((16, 5.0), (17, 50.0)):  # a sink-like outlier over uniform scores
        scores[t, : n(291)] = torch.rand(n(291), generator=g)
        scores[t, 3] = sink
    return scores, pos


def _variants() -> list[dict]:
    """Options of the interpreter check: each method's defaults, and blocks of 16–64 keys, 16–64
    bins and 4–16 programs per row so the rows span many blocks and parts; lists of more than 8
    candidates finished by the radix select."""
    return [
        dict(method="range"), dict(method="range", block=64, bins=16, list_sort=8), dict(method="range", block=32,
        bins=64, num_warps=2), dict(method="split"), dict(method="split", block=32, bins=16, splits=4, list_sort=8),
        dict(method="split", block=16, bins=64, splits=16), dict(method="radix"), dict(method="radix", block=64),
    ]  # fmt: skip


def select_ways(scores: torch.Tensor, positions: torch.Tensor, topk: int, bins: int) -> list[tuple[str, int]]:
    """Per row longer than ``topk``, the range select's way and how many candidates it lists,
    computed as the kernel computes it (fp32): ``"list"`` (threshold bin listed), ``"list2"``
    (listed after a second level) or ``"radix"`` (the radix select over the row, 0 listed)."""

    def binned(x, lo, scale):
        return ((x - lo) * scale).to(torch.int32).clamp(0, bins - 1)

    def cut(b, need):
        at_least = torch.bincount(b, minlength=bins).flip(0).cumsum(0).flip(0)
        c = int((at_least >= need).sum()) - 1
        return c, need - int((b > c).sum()), int((b == c).sum())

    ways = []
    for t, p in enumerate(positions.tolist()):
        if p + 1 <= topk:
            continue
        x = scores[t, : p + 1].float()
        lo = x.min()
        scale = torch.tensor(float(bins)) / (x.max() - lo)
        if not (0 < scale < float("inf")):
            ways.append(("radix", 0))
            continue
        b = binned(x, lo, scale)
        c, need, num = cut(b, topk)
        if num <= topk:
            ways.append(("list", num))
            continue
        scale2 = scale * bins
        if not scale2 < float("inf"):
            ways.append(("radix", 0))
            continue
        inside = x[b == c]
        _, _, num = cut(binned(inside, lo + torch.tensor(float(c)) / scale, scale2), need)
        ways.append(("list2", num) if num <= topk else ("radix", 0))
    return ways


def _interp_select_variants():
    from test_kernels_attention import _install_interpreter_fixes

    _install_interpreter_fixes()
    from breakgraph.kernels.triton_topk import topk_select_triton

    topk = 24
    scores, pos = hard_rows(topk, 300, seed=40)
    poisoned = scores.clone()
    for t, p in enumerate(pos.tolist()):
        poisoned[t, p + 1 :] = float("nan")  # must never be read
    want = exact_topk(scores, pos, topk)
    for bins in (16, 64):
        ways = select_ways(scores, pos, topk, bins)
        assert {"list", "list2", "radix"} <= {w for w, _ in ways}, (
            f"{bins} bins: rows must take every way: {ways}"
        )
    listed = [num for w, num in select_ways(scores, pos, topk, 16) if w != "radix"]
    assert min(listed) <= 2 and max(listed) > 8, f"lists must span the sorts and the radix finish: {listed}"
    for opts in _variants():
        got = torch.full((pos.shape[0], topk), -7, dtype=torch.int32)
        topk_select_triton(poisoned, pos, got, **opts)
        assert_packed(got, pos, topk, str(opts))
        got = canonical(got)
        bad = [t for t in range(pos.shape[0]) if not torch.equal(got[t], want[t])]
        assert not bad, f"{opts}: rows {bad} differ from the exact top-k (ties to the lower position)"
        print(f"select {opts}: ok")
    assert (scores[5, :71] == 0).sum() > topk and (scores[10, :121] == 1).sum() > topk, "tie rows must tie"


@pytest.mark.slow
def test_select_variants_are_exact_interpreted():
    """:func:`_interp_select_variants` in a child process under Triton's interpreter."""
    import os

    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, __file__, "_interp_select_variants"], env=env, capture_output=True, text=True,
                       timeout=900, check=False)  # fmt: skip
    assert r.returncode == 0, f"failed under the Triton interpreter:\n{r.stdout}\n{r.stderr[-6000:]}"


def test_the_twins_write_packed_rows():
    """``causal_topk_ref`` and ``indexer_topk_ref`` (the CPU paths of the rows the attention
    reads) write each token's ``min(K, pos + 1)`` keys first and ``-1`` after them, rows shorter
    and longer than K, also where a row's causal scores are ``+inf`` (keys like any other) or NaN."""
    from test_kernels_attention import indexer_inputs, make_batch

    from breakgraph.kernels.causal_topk import causal_topk_ref
    from breakgraph.kernels.indexer import indexer_topk_ref

    topk = 16
    batch = make_batch([0, 5, 30], [9, 12, 4], page_size=4, seed=3)
    pos = batch["positions"]
    rows = torch.empty(pos.shape[0], topk, dtype=torch.int32)
    causal_topk_ref(pos, rows)
    assert_packed(rows, pos, topk, "causal_topk_ref")
    q, w, k_cache = indexer_inputs(batch, 4, 32, torch.float32, seed=3)
    args = (q, w, k_cache, batch["page_table"], batch["token_req"], pos, 4, 0.2)
    indexer_topk_ref(*args, rows)
    assert_packed(rows, pos, topk, "indexer_topk_ref")
    assert (pos + 1 > topk).any() and (pos + 1 < topk).any()
    for t, nan in ((int(pos.argmax()), False), (int((pos == 8).nonzero()[0]), True)):  # a long row, a short one
        q[t] = q[t].abs()  # every key's head scores > 0 (the keys too): w = +inf makes the row's scores +inf
        k_cache.abs_()
        w[t] = float("inf")
        if nan:  # head 0's scores < 0, relu'd to 0: inf · 0 makes the row's scores NaN
            q[t, 0] = -q[t, 0]
        indexer_topk_ref(*args, rows)
        assert_packed(rows, pos, topk, f"indexer_topk_ref with {'NaN' if nan else '+inf'} scores")


def _sm90_compiles() -> dict:
    """Name → (kernel, argument types, constexprs) of each default launch at GLM-5 shapes."""
    import breakgraph.kernels.triton_topk as tk

    row = dict(SCORES="*fp32", POSITIONS="*i64", stride_st=16384, topk=TOPK)
    full = dict(row, SPAN="*fp32", HIST="*i32", OUT="*i32", stride_ot=TOPK)
    part = dict(CHUNK=16384, SPLITS=8, BLOCK=2048, VEC=4)
    return {
        "radix": (tk._topk_select_kernel, dict(row, OUT="*i32", stride_ot=TOPK), dict(BLOCK=512, BLOCK_K=1024)),
        "range": (tk._range_select_kernel, dict(row, OUT="*i32", CAND="*i32", stride_ot=TOPK, stride_ct=TOPK),
                  dict(BLOCK=tk.RANGE_BLOCK, BLOCK_K=1024, BINS=128, VEC=4, LIST_SORT=1024)),
        "split span": (tk._split_span_kernel, dict(row, SPAN="*fp32"), part),
        "split hist": (tk._split_hist_kernel, dict(row, SPAN="*fp32", HIST="*i32"), dict(part, BINS=128)),
        "split refine": (tk._split_refine_kernel, dict(row, SPAN="*fp32", HIST="*i32"), dict(part, BINS=128)),
        "split list": (tk._split_list_kernel, full, dict(part, BINS=128)),
        "split finish": (tk._split_finish_kernel, full, dict(SPLITS=8, BINS=128, BLOCK=2048, BLOCK_K=1024, VEC=4, LIST_SORT=1024)),
    }  # fmt: skip


@pytest.mark.parametrize("name", list(_sm90_compiles()))
def test_default_launches_compile_without_spills_for_sm90(name):
    """Each kernel's default launch (4 warps): no spill to local memory (the range select: none
    inside its loops; at 512 keys a step ptxas keeps it to 48 registers and parks one value of the
    prologue in 8 bytes of stack); the row loads of every kernel but the radix select (whose key
    loads are scalar, ``BLOCK`` keys a step) are 128-bit."""
    from breakgraph.kernels import aot

    if not aot.tools_available():
        pytest.skip("this triton has no bundled ptxas/cuobjdump")
    fn, args, consts = _sm90_compiles()[name]
    info = aot.compile_for_sm90(fn, args, consts, 4, 1)
    print(info)
    if name == "range":
        assert info["loop_local_insts"] == 0 and info["stack"] <= 8, info
    else:
        assert info["stack"] == 0 and info["local_insts"] == 0, info
    if name != "radix":
        assert info["vector_loads"] > 0, info


# ---------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------


GPU_VARIANTS = {
    "default": {},
    "range": dict(method="range"),
    "range bins 32": dict(method="range", bins=32),
    "split": dict(method="split"),
    "split 64 parts": dict(method="split", splits=64),
    "radix": dict(method="radix"),
}


def exact_sets(got: torch.Tensor, scores: torch.Tensor, pos: torch.Tensor, topk: int) -> list[int]:
    """Rows of ``got`` that are not :func:`exact_topk`'s as sets (computed for all rows at once)."""
    got = canonical(got)
    j = torch.arange(scores.shape[1], device=scores.device)
    causal = j[None, :] <= pos[:, None]
    masked = scores.masked_fill(~causal, float("-inf"))
    kth = masked.topk(topk, dim=1).values[:, -1:]
    ties = (masked == kth) & causal
    want = ((masked > kth) & causal) | (
        ties & (ties.cumsum(1) <= topk - ((masked > kth) & causal).sum(1, keepdim=True))
    )
    short = pos < topk
    want[short] = causal[short]
    rank = want.cumsum(1) - 1  # slot of each wanted position in ascending order
    expect = torch.full_like(got, -1)
    rows, cols = want.nonzero(as_tuple=True)
    expect[rows, rank[rows, cols]] = cols.int()
    return (got != expect).any(1).nonzero().flatten().tolist()


def _long_rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of 1 to 128K keys on the GPU: the lengths around K and powers of two, random
    lengths, and the hard rows of the CPU check stretched to thousands of keys; 64 rows, so the
    kernels specialise as in the bench (row counts and widths multiples of 16) and compile once."""
    width = 131072
    g = torch.Generator(device="cuda").manual_seed(seed)
    special = [
        0,
        TOPK - 1,
        TOPK,
        TOPK + 1,
        4095,
        4096,
        4097,
        8191,
        8192,
        8193,
        16383,
        16384,
        16385,
        width - 1,
    ]
    pos = torch.cat(
        [torch.tensor(special, device="cuda"), torch.randint(0, width, (34,), generator=g, device="cuda")]
    )
    scores = torch.randn(pos.shape[0], width, generator=g, device="cuda")
    scores *= torch.logspace(-3, 3, pos.shape[0], device="cuda")[:, None]
    hard, hard_pos = hard_rows(TOPK, 300 * TOPK // 24, seed)  # the CPU rows' width, stretched alike
    hard = torch.nn.functional.pad(hard, (0, width - hard.shape[1]))
    return torch.cat([scores, hard.cuda()]), torch.cat([pos, hard_pos.cuda()])


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(GPU_VARIANTS))
def test_select_variants_are_exact_on_gpu(name):
    from breakgraph.kernels.triton_topk import topk_select_triton

    scores, pos = _long_rows(seed=3)
    j = torch.arange(scores.shape[1], device="cuda")
    poisoned = scores.masked_fill(j[None, :] > pos[:, None], float("nan"))
    got = torch.full((pos.shape[0], TOPK), -7, dtype=torch.int32, device="cuda")
    topk_select_triton(poisoned, pos, got, **GPU_VARIANTS[name])
    want = exact_topk(scores, pos, TOPK)
    got = canonical(got)
    bad = [(t, int(pos[t])) for t in range(pos.shape[0]) if not torch.equal(got[t], want[t])]
    assert not bad, f"rows (index, position) {bad} differ from the exact top-k"


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["default", "range", "split", "radix"])
def test_select_on_indexer_scores_with_cached_prefixes_on_gpu(name):
    """The indexer's own score distribution, ragged requests with cached prefixes (rows shorter
    and longer than K): exact, and ``indexer_topk_triton`` (the
    engine's call) selects the same."""
    from test_kernels_attention import IDX_DIM, IDX_HEADS, PAGE, indexer_inputs, make_batch

    from breakgraph.kernels.triton_indexer import indexer_scores_triton, indexer_topk_triton
    from breakgraph.kernels.triton_topk import topk_select_triton

    batch = make_batch([3000, 0, 20000, 1500], [700, 2500, 300, 4], page_size=PAGE, device="cuda", seed=5)
    q, w, kc = indexer_inputs(batch, IDX_HEADS, IDX_DIM, torch.bfloat16, device="cuda", seed=5)
    args = (batch["page_table"], batch["token_req"], batch["positions"], PAGE, IDX_DIM**-0.5)
    pos = batch["positions"]
    scores = torch.empty(pos.shape[0], batch["page_table"].shape[1] * PAGE, device="cuda")
    indexer_scores_triton(q, w, kc, *args, scores)
    got = torch.full((pos.shape[0], TOPK), -7, dtype=torch.int32, device="cuda")
    topk_select_triton(scores, pos, got, **GPU_VARIANTS[name])
    assert torch.equal(canonical(got), exact_topk(scores, pos, TOPK)), "select differs from the exact top-k"
    engine = torch.full_like(got, -7)
    indexer_topk_triton(q, w, kc, *args, engine)
    # as sets: the engine's call goes in chunks of the score buffer, and a short last chunk of
    # long rows takes the split select, whose rows are in plain ascending order
    assert torch.equal(canonical(engine), canonical(got)), (
        "the engine's call selects differently from the select on the same scores"
    )


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["range", "split"])
def test_select_is_exact_on_all_rows_of_an_8k_prefill_on_gpu(name):
    """GLM-5 shapes: the 8192 causal rows of one prefill (row ``t`` has ``t + 1`` keys), random
    normal scores plus a sink-like outlier at position 0 in every fourth row (a wide range, so
    rows take both ways of the range select)."""
    from breakgraph.kernels.triton_topk import topk_select_triton

    n = 8192
    g = torch.Generator(device="cuda").manual_seed(6)
    scores = torch.randn(n, n, generator=g, device="cuda")
    scores[::4, 0] += 1000.0
    pos = torch.arange(n, device="cuda")
    got = torch.full((n, TOPK), -7, dtype=torch.int32, device="cuda")
    topk_select_triton(scores, pos, got, **GPU_VARIANTS[name])
    bad = exact_sets(got, scores, pos, TOPK)
    assert not bad, f"{len(bad)} rows differ from the exact top-k, first {bad[:8]}"


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["range", "split"])
def test_select_replays_in_cuda_graph_with_new_inputs(name):
    """Captured once with one set of rows, replayed after the scores and positions are refilled
    (other lengths): equals an eager call."""
    from breakgraph.kernels.triton_topk import topk_select_triton

    scores, pos = _long_rows(seed=4)
    out = torch.empty(pos.shape[0], TOPK, dtype=torch.int32, device="cuda")
    opts = GPU_VARIANTS[name]
    topk_select_triton(scores, pos, out, **opts)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk_select_triton(scores, pos, out, **opts)
    new_scores, new_pos = _long_rows(seed=5)
    scores.copy_(new_scores)
    pos.copy_(new_pos.flip(0))
    graph.replay()
    want = torch.empty_like(out)
    topk_select_triton(scores, pos, want, **opts)
    assert torch.equal(out, want) and torch.equal(canonical(out), exact_topk(scores, pos, TOPK))


if __name__ == "__main__":  # child process of the interpreter check
    globals()[sys.argv[1]]()
