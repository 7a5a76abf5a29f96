"""The DSA/MLA prefill surface: what runs eagerly at graph breaks, and how it is cut.

Two split ops (``graph_break_op``: breaks under breakable graphs, split points under
piecewise graphs, plain calls when eager) carry everything that depends on per-batch
lengths and pages:

* :func:`dsa_indexer_graph_dispatch` — the whole DSA indexer for a layer: store the new
  indexer keys (unless the rotary kernel did: :func:`rotary_cache_store`), score, write the
  causal top-k into a preallocated ``topk_result``. Its core
  is :func:`k_cache_and_topk_result`; when every sequence is at most ``index_topk`` long the
  top-k is simply every causal key: nothing is scored or written
  (:func:`_should_skip_logits_computation`), the attention makes those rows from the token
  positions itself (``causal_rows``), and the layer skips the indexer's queries and head
  weights where its code may rely on it (:func:`indexer_rows_are_causal`: eager batches, decode
  graphs and prefill graphs captured for such batches).
* :func:`prefill_mla_attention` — a prefill batch's whole attention (:func:`prefill_mla_form`),
  ``w_vc`` included: its tokens below ``index_topk`` see every causal key and attend, where it
  pays, in MHA form (:mod:`breakgraph.kernels.dense_mha`); the others in the absorbed form.
* :func:`mla_bmm_then_unified_attention` — the absorbed query's ``q_nope · w_kc`` BMM *and*
  the sparse attention in one op, planned by :class:`MlaBmmFusionPlan`, so the lone BMM never
  becomes a one-kernel graph segment; :func:`sparse_mla_attention` is the attention alone.

:func:`logits_head_gate` (the indexer head-weight projection) is a custom op with a fake
implementation, so it stays one traceable node inside a graph piece.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from breakgraph import env
from breakgraph.forward_context import ForwardBatch, ForwardMode, get_forward_batch
from breakgraph.graphs import graph_break_op, is_in_breakable_cuda_graph, register_custom_op
from breakgraph.kernels.dense_mha import dense_causal_mha, mha_form_pays
from breakgraph.kernels.indexer import indexer_topk
from breakgraph.kernels.latent_fp8 import dequantize_latent_ref, is_fp8_latent, store_latent
from breakgraph.kernels.linear import bmm_into, linear_fp32_out
from breakgraph.kernels.sparse_mla import sparse_mla_attention as sparse_mla_kernel


def is_graph_dsa_split_op_surface() -> bool:
    """True while the model body is being captured or traced for a prefill graph backend
    (breakable capture/replay, or the piecewise backend's torch.compile trace). Both backends
    capture extend batches only, and breakgraph has no speculative decoding. Decode graphs are
    full graphs (no breaks), so this is False there and in eager runs."""
    return torch.compiler.is_compiling() or is_in_breakable_cuda_graph()


def _logits_head_gate_impl(x: torch.Tensor, weight: torch.Tensor, scale: float) -> torch.Tensor:
    return linear_fp32_out(x, weight, scale)


def _logits_head_gate_fake(x: torch.Tensor, weight: torch.Tensor, scale: float) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


logits_head_gate = register_custom_op(
    _logits_head_gate_impl, name="logits_head_gate", mutates_args=(), fake_impl=_logits_head_gate_fake
)
logits_head_gate.__doc__ = """Indexer head weights ``w = (x · W_proj^T) · scale`` in fp32: ``x [T, D]``,
``weight [Hi, D]`` (fp32, or its exact bf16 copy for the tensor cores: see
:func:`~breakgraph.kernels.linear.linear_fp32_out`) → ``[T, Hi]``. A custom op
(``torch.ops.breakgraph.logits_head_gate``)."""


def _should_skip_logits_computation(fb: ForwardBatch, index_topk: int) -> bool:
    """When no sequence in the batch is longer than ``index_topk``, the causal top-k is every
    key up to each token's position: the scores cannot change the selection."""
    return fb.max_seq_len <= index_topk


def indexer_rows_are_causal(index_topk: int) -> bool:
    """Whether the layer code may skip what only the indexer's scores need (its queries and head
    weights; the keys still go to the cache): every sequence the code runs on is at most
    ``index_topk`` long (:attr:`~breakgraph.forward_context.ForwardBatch.seq_len_bound`), not
    traced by ``torch.compile`` (a traced piece replays any batch). Graphs hold the answer of
    their capture: decode graphs are captured per length bound on static batches as long as
    their bound, prefill graphs on a stand-in batch that states its bound (the runner's graphs
    for any batch state the context length), and each replays only batches within it."""
    if torch.compiler.is_compiling():
        return False
    return get_forward_batch().seq_len_bound <= index_topk


def rotary_cache_store(
    cache_name: str, layer_id: int, rows_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where the rotary step that makes a batch's new rows for layer ``layer_id``'s cache
    ``cache_name`` (``"latent"`` or ``"indexer_k"`` of the forward batch's KV cache) writes them
    itself (the ``store`` of :func:`~breakgraph.kernels.rope.mla_rope_kv` and
    :func:`~breakgraph.kernels.rope.indexer_rope_qk`): ``(cache, out_cache_loc)`` when the
    cache is plain and of ``rows_dtype``, else None. A captured graph reads the slots it was
    captured with: decode graphs capture on their static batch, prefill graphs on the model
    runner's static slot buffer (``ModelRunner.capture_context``), both loaded before each
    replay; padded rows write to the reserved page 0. A forward traced by ``torch.compile``
    stores at the split op instead (this returns None there: a traced piece may replay on
    other slots), so does an FP8 cache, which quantises in its own store kernel. The layer
    tells the split op whether the rows were stored (its ``k_stored``/``kv_stored``), so each
    row is written once."""
    if torch.compiler.is_compiling():
        return None
    fb = get_forward_batch()
    cache = getattr(fb.kv_cache, cache_name)[layer_id]
    if is_fp8_latent(cache) or cache.dtype != rows_dtype:
        return None
    return cache, fb.out_cache_loc


def k_cache_and_topk_result(
    q_fp8: torch.Tensor | None, k: torch.Tensor, weights: torch.Tensor | None, topk_result: torch.Tensor, layer_id: int,
    scale: float, k_stored: bool = False,
) -> bool:  # fmt: skip
    """Core of the indexer split op for the first ``n`` (real) rows: store ``k [n, Di]`` in the
    layer's key cache (unless ``k_stored``: the rotary kernel wrote them, see
    :func:`rotary_cache_store`), then fill ``topk_result [n, K]`` (int32 positions, ``-1``
    unused) — unless every sequence is at most ``K`` long: each row would be all of its causal
    positions, which the attention makes itself (``causal_rows``), so nothing is written and
    ``weights`` may be None. Returns whether ``topk_result`` was written."""
    fb = get_forward_batch()
    n = fb.num_tokens
    cache = fb.kv_cache.indexer_k[layer_id]
    if not k_stored:
        store_latent(cache, fb.out_cache_loc, k[:n], k.shape[-1])  # FP8 key rows: codes + scale, no RoPE part
    if _should_skip_logits_computation(fb, topk_result.shape[1]):
        return False
    if weights is None or q_fp8 is None:
        raise ValueError(
            f"layer {layer_id}: the indexer's queries and head weights are needed, a sequence is longer than index_topk"
        )
    indexer_topk(
        q_fp8[:n], weights[:n], cache, fb.page_table, fb.token_req, fb.positions, fb.kv_cache.page_size, scale,
        topk_result[:n], max_seq_len=fb.max_seq_len,
    )  # fmt: skip
    return True


@graph_break_op(mutates_args=("topk_result",))
def dsa_indexer_graph_dispatch(
    q_fp8: torch.Tensor | None, k: torch.Tensor, weights: torch.Tensor | None, topk_result: torch.Tensor, layer_id: int,
    scale: float, k_stored: bool = False,
) -> None:  # fmt: skip
    """Split op: the DSA indexer of layer ``layer_id``. ``q_fp8 [T, Hi, Di]`` (queries; FP8 when
    the indexer kernel quantises them), ``k [T, Di]``, ``weights [T, Hi]`` fp32 (both None where
    :func:`indexer_rows_are_causal`); writes ``topk_result [T, K]`` (rows past the real tokens
    set to ``-1``) unless every sequence is at most ``K`` long (then nothing: see
    :func:`k_cache_and_topk_result`). ``T`` may be a padded bucket: queries and head weights are
    sliced to the same real length. ``k_stored``: the keys are in the cache already
    (:func:`rotary_cache_store`)."""
    if weights is not None and q_fp8 is not None and q_fp8.shape[0] != weights.shape[0]:
        raise ValueError(f"indexer queries ({q_fp8.shape[0]} rows) and head weights ({weights.shape[0]} rows) differ")
    if k_cache_and_topk_result(q_fp8, k, weights, topk_result, layer_id, scale, k_stored):
        topk_result[get_forward_batch().num_tokens :] = -1


bcg_dsa_indexer_graph_dispatch = dsa_indexer_graph_dispatch.bcg


def _attend(
    q: torch.Tensor, kv: torch.Tensor, topk: torch.Tensor, out: torch.Tensor, layer_id: int, scale: float,
    kv_stored: bool, dense_elsewhere: bool = False,
) -> None:  # fmt: skip
    """Store the new latent entries (unless ``kv_stored``: the rotary kernel wrote them), then
    attend. ``topk`` comes from the DSA indexer (this
    layer's, or the previous layer's for shared-indexer layers: same batch, same tokens),
    whose row for a token at ``pos < K`` is every causal position ``0…pos`` (``torch.topk`` over
    ``pos + 1 ≤ K`` finite scores picks them all), so the kernel may attend densely below
    ``dense_below = K`` (in prefill/extend batches: a decode batch has one token per request,
    which the dense path cannot share keys across). When no sequence reaches past ``K`` the
    indexer wrote no rows (:func:`k_cache_and_topk_result`): the kernel makes them from the
    positions (``causal_rows``) and, in prefill, is told each request's token count, so it can
    skip its sparse launch where every token block is dense. The indexer's rows are packed (a
    token's ``min(K, pos + 1)`` keys first, ``-1`` after them: the select and the twin's ``topk``
    write them so), so the kernel stops each row at its keys (``packed_rows``).
    ``dense_elsewhere``: the caller attends every token below ``K`` itself and overwrites their
    rows (:func:`prefill_mla_attention`): the kernel skips its dense-causal blocks."""
    fb = get_forward_batch()
    n = fb.num_tokens
    cache = fb.kv_cache.latent[layer_id]
    if not kv_stored:
        store_latent(cache, fb.out_cache_loc, kv[:n], out.shape[-1])  # quantises into an FP8 cache
    decode = fb.mode is ForwardMode.DECODE
    causal = _should_skip_logits_computation(fb, topk.shape[1])  # every position < K
    sparse_mla_kernel(
        q[:n], cache, topk[:n], fb.page_table, fb.token_req, fb.kv_cache.page_size, scale, out[:n],
        positions=fb.positions[:n], dense_below=0 if decode else topk.shape[1],
        request_tokens=fb.extend_lens_cpu if causal and not decode else None, packed_rows=True, causal_rows=causal,
        dense_elsewhere=dense_elsewhere and not decode,
    )  # fmt: skip
    out[n:].zero_()


@graph_break_op(mutates_args=("out",))
def sparse_mla_attention(
    q: torch.Tensor, kv: torch.Tensor, topk: torch.Tensor, out: torch.Tensor, layer_id: int, scale: float,
    kv_stored: bool = False,
) -> None:  # fmt: skip
    """Split op: store the new latent entries ``kv [T, r+dr]`` in layer ``layer_id``'s cache
    (quantised when it is the FP8 cache; not when ``kv_stored``: :func:`rotary_cache_store`), then
    attend ``q [T, H, r+dr]`` to each token's top-k positions ``topk [T, K]``, writing the latent
    output into ``out [T, H, r]`` (rows past the real tokens are zeroed)."""
    _attend(q, kv, topk, out, layer_id, scale, kv_stored)


@dataclass(frozen=True)
class MlaBmmFusionPlan:
    """Buffers for :func:`mla_bmm_then_unified_attention`, allocated by the layer (inside the
    graph segment, so they live in the graph pool):

    ``q_nope_t [H, T, dn]`` — the non-rotary query, heads first; ``q_nope_out_buf [T, H, r+dr]``
    — the full latent query; ``q_nope_out_view [H, T, r]`` — its first ``r`` columns, heads
    first, where the BMM writes; ``attn_output_buf [T, H, r]`` — the latent attention output."""

    q_nope_t: torch.Tensor
    q_nope_out_buf: torch.Tensor
    q_nope_out_view: torch.Tensor
    attn_output_buf: torch.Tensor


@graph_break_op(mutates_args=("q_nope_out_buf", "attn_output_buf"))
def mla_bmm_then_unified_attention(
    q_nope_t: torch.Tensor,
    w_kc: torch.Tensor,
    q_nope_out_buf: torch.Tensor,
    kv: torch.Tensor,
    topk: torch.Tensor,
    attn_output_buf: torch.Tensor,
    layer_id: int,
    scale: float,
    kv_stored: bool = False,
) -> None:
    """Split op: ``q_nope_t · w_kc`` (``[H, T, dn] × [H, dn, r]``) into the first ``r`` columns of
    the latent query ``q_nope_out_buf [T, H, r+dr]`` (the plan's ``q_nope_out_view``), then the
    sparse attention of that query into ``attn_output_buf [T, H, r]`` — one op, so no graph
    segment holds the BMM alone. Only the real rows are computed; ``kv`` is stored as by
    :func:`sparse_mla_attention`."""
    n = get_forward_batch().num_tokens
    rank = attn_output_buf.shape[-1]
    bmm_into(q_nope_t[:, :n], w_kc, q_nope_out_buf[:n, :, :rank].transpose(0, 1))
    _attend(q_nope_out_buf, kv, topk, attn_output_buf, layer_id, scale, kv_stored)


def prefill_mla_form() -> bool:
    """Whether the layer hands its whole attention to :func:`prefill_mla_attention`: a prefill
    (extend) step, not traced by ``torch.compile`` (a traced piece replays any batch), unless
    ``BREAKGRAPH_DENSE_MHA=0``. Decode keeps the absorbed form (one query a request: the latent
    keys are shared by all heads), and so do the traced pieces."""
    if env.read("BREAKGRAPH_DENSE_MHA") == "0" or torch.compiler.is_compiling():
        return False
    return get_forward_batch().mode is ForwardMode.EXTEND


@dataclass(frozen=True)
class MhaRowsLayout:
    """Which tokens of a prefill batch attend in MHA form and where their keys are: the tokens
    at positions below ``index_topk`` (every causal key selected: dense causal attention).

    ``pays``: the MHA form takes fewer FLOPs for them than the absorbed form
    (:func:`~breakgraph.kernels.dense_mha.mha_form_pays`) under ``BREAKGRAPH_DENSE_MHA=auto``,
    always under ``1`` (where there are such tokens), never under ``0`` (a graph captured before
    the knob changed replays the absorbed form then). ``rows``: those tokens' batch rows — a
    ``slice`` where they are consecutive (one long prompt's first ``index_topk`` tokens; every
    token, ``every_token``, when no sequence reaches past ``index_topk``), else an int64 index
    tensor. ``slots [Tk]`` int64: the cache slots of each of their requests' positions
    ``0…min(seq_len, index_topk) − 1``, request by request (None: no such request has a cached
    prefix and the cache holds the rows as the layer makes them — the keys are the tokens' own
    new latent rows, ``kv[rows]``). ``key_rows [Td]`` int64: each token's own key in that order
    (None: the ``j``-th token's key is the ``j``-th, as without prefixes)."""

    pays: bool
    every_token: bool
    rows: slice | torch.Tensor
    slots: torch.Tensor | None
    key_rows: torch.Tensor | None


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``, through pinned memory without a wait on CUDA."""
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def mha_rows_layout(
    fb: ForwardBatch, index_topk: int, rank: int, dn: int, dr: int, dv: int, keys_from_cache: bool
) -> MhaRowsLayout:
    """The batch's :class:`MhaRowsLayout`, built at the first layer's call from the host lengths
    and kept in ``fb.derived`` for the others (at most one host-to-device copy a forward: the
    keys' requests and positions and the tokens' key rows, or the tokens' rows, in one pinned
    transfer). The FLOP comparison counts the key projections and the attention of the tokens
    below ``index_topk`` against the absorbed form's attention of them, plus its query-side
    products where every token is such a token (else the other tokens need those products
    anyway). ``keys_from_cache``: the cache holds other values than the rows the layer makes (FP8,
    or another dtype): the keys are read back from it even without a prefix — its slots are then
    the tokens' own — so a prompt attends to the same keys whether it is prefilled at once or in
    chunks."""
    name = f"mha_rows/{index_topk}/{rank}/{dn}/{dr}/{dv}/{keys_from_cache}"
    layout = fb.derived.get(name)
    if layout is not None:
        return layout
    prefix, extend = fb.prefix_lens_cpu, fb.extend_lens_cpu
    dense = [max(0, min(p + e, index_topk) - p) for p, e in zip(prefix, extend)]  # tokens below index_topk
    keys = [p + d if d else 0 for p, d in zip(prefix, dense)]  # the positions those tokens see
    tokens = sum(dense)
    every_token = tokens == fb.num_tokens
    pairs = sum(d * p + d * (d + 1) // 2 for p, d in zip(prefix, dense))
    mode = env.read("BREAKGRAPH_DENSE_MHA")
    flops = mha_form_pays(tokens if every_token else 0, sum(keys), pairs, rank, dn, dr, dv)
    pays = tokens > 0 and (mode == "1" or (mode == "auto" and flops))
    reqs = [i for i, d in enumerate(dense) if d]
    batch_start = list(accumulate(extend, initial=0))
    spans = [(batch_start[i], batch_start[i] + dense[i]) for i in reqs]
    consecutive = all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    rows: slice | torch.Tensor = slice(spans[0][0], spans[-1][1]) if spans and consecutive else slice(0, 0)
    apart = pays and not consecutive  # the rows as an index: built on the host, sent with the keys' layout
    host_rows = [torch.cat([torch.arange(*span) for span in spans])] if apart else []
    slots = key_rows = None
    dev = fb.page_table.device
    if pays and any(prefix[i] for i in reqs):
        key_start = list(accumulate(keys, initial=0))
        parts = [
            torch.repeat_interleave(torch.tensor(reqs), torch.tensor([keys[i] for i in reqs])),  # keys' requests
            torch.cat([torch.arange(keys[i]) for i in reqs]),  # keys' positions
            torch.cat([torch.arange(dense[i]) + key_start[i] + prefix[i] for i in reqs]),  # tokens' own keys
            *host_rows,
        ]
        n_keys = sum(keys)
        on_dev = _to_device(torch.cat(parts), dev)
        req, pos = on_dev[:n_keys], on_dev[n_keys : 2 * n_keys]
        key_rows = on_dev[2 * n_keys : 2 * n_keys + tokens]
        if apart:
            rows = on_dev[2 * n_keys + tokens :]
        page = fb.kv_cache.page_size
        slots = fb.page_table[req, pos // page].long() * page + pos % page
    elif pays:
        if apart:
            rows = _to_device(host_rows[0], dev)
        if keys_from_cache:  # no prefix: the keys are the tokens' own new rows, read back from the cache
            slots = fb.out_cache_loc[rows]
    layout = MhaRowsLayout(pays, every_token, rows, slots, key_rows)
    fb.derived[name] = layout
    return layout


@graph_break_op(mutates_args=("q_full", "out"))
def prefill_mla_attention(
    q: torch.Tensor, q_full: torch.Tensor, kv: torch.Tensor, topk: torch.Tensor, w_kv: torch.Tensor,
    out: torch.Tensor, layer_id: int, scale: float, kv_stored: bool = False,
) -> None:  # fmt: skip
    """Split op: the whole attention of a prefill batch (:func:`prefill_mla_form`), from the
    queries to the per-head values.

    ``q [T, H, dn + dr]`` (the query, ``q_nope`` first), ``q_full [T, H, r + dr]`` (its rotary
    columns hold ``rope(q_pe)``; the absorbed form writes ``q_nope·w_kc`` into the first ``r``),
    ``kv [T, r + dr]`` the new latent rows (stored first unless ``kv_stored``), ``topk [T, K]``
    (the indexer's rows; only its shape where no sequence is longer than ``K``), ``w_kv
    [H·dn + H·dv, r]`` the key halves ``w_kc [H, dn, r]`` then the value halves ``w_vc [H, dv,
    r]`` of the heads' ``kv_b`` rows; writes ``out [T, H, dv]`` (rows past the real tokens zeroed).

    The tokens at positions below ``K`` see every causal key: where the MHA form pays for them
    (:func:`mha_rows_layout`) their keys' latent is projected to ``k_nope ‖ v`` (one GEMM) and
    they attend in MHA form (:func:`~breakgraph.kernels.dense_mha.dense_causal_mha`). The other
    tokens — all of them where it does not pay — take the absorbed form: ``q_nope·w_kc``, the
    sparse attention over their top-k rows (whose dense-causal blocks are then left to the MHA
    form) and ``·w_vc``."""
    fb = get_forward_batch()
    n = fb.num_tokens
    heads, rank, dv = q.shape[1], w_kv.shape[1], out.shape[-1]
    dr = q_full.shape[-1] - rank
    dn = q.shape[-1] - dr
    w_kc, w_vc = w_kv[: heads * dn].view(heads, dn, rank), w_kv[heads * dn :].view(heads, dv, rank)
    cache = fb.kv_cache.latent[layer_id]
    layout = mha_rows_layout(fb, topk.shape[1], rank, dn, dr, dv, is_fp8_latent(cache) or cache.dtype != kv.dtype)
    if not (layout.pays and layout.every_token):  # the absorbed form: every token, or those past K
        attn = q_full.new_empty(n, heads, rank)
        bmm_into(q[:n, :, :dn].transpose(0, 1), w_kc, q_full[:n, :, :rank].transpose(0, 1))
        _attend(q_full, kv, topk, attn, layer_id, scale, kv_stored, dense_elsewhere=layout.pays)
        bmm_into(attn.transpose(0, 1), w_vc.transpose(1, 2), out[:n].transpose(0, 1))
        kv_stored = True
    if layout.pays:
        if not kv_stored:
            store_latent(cache, fb.out_cache_loc, kv[:n], rank)
        rows = layout.rows
        if layout.slots is None:
            keys = kv[rows]
        else:
            keys = cache[layout.slots]
            keys = dequantize_latent_ref(keys, rank, kv.dtype) if is_fp8_latent(cache) else keys.to(kv.dtype)
        projected = torch.matmul(keys[:, :rank], w_kv.t())  # [Tk, H·dn ‖ H·dv]: k_nope ‖ v
        k_nope = projected[:, : heads * dn].view(-1, heads, dn)
        v = projected[:, heads * dn :].view(-1, heads, dv)
        q_nope = q[rows, :, :dn]
        dense = out[rows] if isinstance(rows, slice) else out.new_empty(q_nope.shape[0], heads, dv)
        dense_causal_mha(
            q_nope, q_full[rows, :, rank:], k_nope, keys[:, rank:], v, fb.positions[rows], layout.key_rows, scale,
            dense,
        )  # fmt: skip
        if not isinstance(rows, slice):
            out[rows] = dense
    out[n:].zero_()
