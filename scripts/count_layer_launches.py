"""Count the kernels one decoder layer of ``glm5-tp8-rank`` launches, by name, on the CPU.

    TRITON_INTERPRET=1 python scripts/count_layer_launches.py --tokens 1 1024
    TRITON_INTERPRET=1 python scripts/count_layer_launches.py --tokens 1 --decode-batch 1 16 64

The layer runs on meta tensors (shapes and dtypes, no data) that say they are CUDA tensors, so
every dispatcher takes the branch it takes on the H200: Triton launches are recorded and not
run (``TRITON_INTERPRET=1``), PyTorch ops that launch a kernel on a GPU are counted by a
dispatch mode (views, allocation and metadata ops launch nothing and are not counted). FP8
linears take the path the H200's start-up timing chose for their shape and row count (the
table in docs/benchmarks.md, "Short prompts and decode"; ``_scaled_mm`` as one cuBLAS kernel).
One token is a decode step (full CUDA graph: no breaks) of ``--decode-batch`` requests (1 by
default); more tokens are one prefill request of that length (breakable graphs: the fused BMM +
attention break). The context is ``--context`` tokens before the step (decode) or the prompt
itself (prefill).

Counted per layer kind: a dense layer (layers below ``first_k_dense_replace``) and a MoE layer
(with its own indexer); "per layer" is their mean over the preset's 78 layers.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from contextlib import ExitStack
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from breakgraph.bench.presets import PRESETS

# ops that launch nothing on a GPU (allocation, views, metadata; scalar_tensor: a CPU-wrapped number)
_FREE = {
    "empty", "empty_like", "empty_strided", "new_empty", "view", "reshape", "_unsafe_view", "split", "split_with_sizes",
    "chunk", "slice", "select", "t", "transpose", "detach", "alias", "as_strided", "expand", "permute", "unsqueeze",
    "squeeze", "lift_fresh", "unbind", "narrow", "view_as_real", "_to_copy_noop", "unflatten", "flatten",
    "_reshape_alias", "lift_fresh_copy", "scalar_tensor",
}  # fmt: skip
# The H200's FP8 GEMM choice as its start-up timing logged it ("fp8 linear K=… N=…" lines of
# `breakgraph bench ttft --preset glm5-tp8-rank`, 2026-12-03): (K, N) -> ((bucket, path), ...).
# q_b ‖ wq_b is one (2048, 6144) linear, o_proj's shape.
H200_FP8_TABLE = {
    (256, 6144): ((1, "triton_gemv"), (128, "triton_w8a16"), (512, "triton")),
    (1536, 6144): ((1, "triton_gemv"), (16, "triton"), (64, "scaled_mm")),
    (2048, 6144): ((1, "triton_gemv"), (16, "triton"), (64, "scaled_mm")),
    (6144, 512): ((1, "triton_gemv"), (16, "triton"), (64, "scaled_mm")),
    (6144, 2752): ((1, "triton_gemv"), (64, "triton"), (128, "scaled_mm")),
    (6144, 3072): ((1, "triton_gemv"), (64, "triton"), (128, "scaled_mm")),
}
# Shapes the H200's timing has not logged yet, counted with the paths of a logged shape of the
# same K (an assumption, printed with the table): q_b alone, which batches of sequences up to
# index_topk run without the indexer's wq_b rows.
ASSUMED_FP8_TABLE = {(2048, 2048): (2048, 6144)}
DEVICE = torch.device("meta")


class Launches(TorchDispatchMode):
    """Records the name of every kernel launch: aten ops here, Triton grids by :func:`record_triton`."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        if name not in _FREE and not _is_noop(name, args, kwargs or {}):
            self.kernels.append(f"aten.{name}")
        return func(*args, **(kwargs or {}))


def _is_noop(name: str, args: tuple, kwargs: dict) -> bool:
    """Ops that launch nothing for these operands: empty tensors, same-dtype casts."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if tensors and all(t.numel() == 0 for t in tensors[:1]):
        return True
    if name in ("to", "_to_copy") and tensors:  # a cast to the tensor's own dtype returns it
        dtypes = [a for a in args[1:] if isinstance(a, torch.dtype)] + [kwargs.get("dtype", tensors[0].dtype)]
        return dtypes[0] == tensors[0].dtype
    return False


def record_triton(mode: Launches) -> None:
    """Make every Triton launch record its kernel's name in ``mode`` instead of running."""
    import triton.runtime.interpreter as interp

    def getitem(self, grid):
        def launch(*args, **kwargs):
            mode.kernels.append(self.fn.__name__)

        return launch

    interp.InterpretedFunction.__getitem__ = getitem


def patches(stack: ExitStack, prefill: bool) -> None:
    """Make the dispatchers see the H200: CUDA tensors take Triton, FP8 paths from the table."""
    from breakgraph.kernels import fp8_gemm_choice, triton_fp8
    from breakgraph.layers import attention, dsa

    stack.enter_context(mock.patch.object(torch.Tensor, "is_cuda", property(lambda self: True)))
    stack.enter_context(mock.patch.object(triton_fp8, "device_index", lambda device: 0))
    stack.enter_context(mock.patch.object(triton_fp8, "scaled_mm_blockwise_mode", lambda device: "any"))
    for (k, n), table in H200_FP8_TABLE.items():
        fp8_gemm_choice.set_table(0, k, n, table)
    for (k, n), like in ASSUMED_FP8_TABLE.items():
        fp8_gemm_choice.set_table(0, k, n, H200_FP8_TABLE[like])
    stack.enter_context(mock.patch.object(attention, "logits_head_gate", dsa._logits_head_gate_impl))
    stack.enter_context(mock.patch.object(attention, "_can_fuse_bmm_into_attention", lambda w: prefill))
    stack.callback(fp8_gemm_choice.clear_tables)


def build_layers(tokens: int, context: int, batch_size: int = 1):
    """The dense layer 0 and MoE layer 3 of the preset (meta tensors), cos/sin rows,
    a KV cache and the forward batch: one prefill request of ``tokens``, or (``tokens == 1``) a
    decode step of ``batch_size`` requests of ``context`` cached tokens each."""
    from breakgraph.engine.kv_cache import KVCache
    from breakgraph.forward_context import ForwardBatch, ForwardMode
    from breakgraph.layers import attention, mlp
    from breakgraph.models.config import ModelConfig
    from breakgraph.models.glm5 import DecoderLayer

    cfg = ModelConfig.from_dict(dict(PRESETS["glm5-tp8-rank"], num_hidden_layers=4))
    dtype = torch.bfloat16
    with torch.device(DEVICE):
        moe = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
        layers = [DecoderLayer(cfg, i, dtype) for i in (0, moe)]
        # meta weights hold no values to test for an exact bf16 copy: keep the copies, as the
        # engine does for the preset's bf16-exact router and indexer weights
        with mock.patch.object(attention, "exact_bf16_weight", lambda w: w.to(dtype)), \
                mock.patch.object(mlp, "exact_bf16_weight", lambda w: w.to(dtype)):  # fmt: skip
            for layer in layers:
                layer.process_weights_after_loading()
        seq = context + tokens if tokens == 1 else tokens
        page = 64
        pages = -(-seq // page)
        rows = batch_size if tokens == 1 else 1
        n = tokens * rows  # tokens in the batch
        cache = KVCache(cfg, rows * pages + 2, page, dtype, DEVICE)
        positions = torch.arange(seq - tokens, seq).repeat(rows)
        page_table = torch.arange(1, rows * pages + 1, dtype=torch.int32).view(rows, pages)
        batch = ForwardBatch(
            mode=ForwardMode.DECODE if tokens == 1 else ForwardMode.EXTEND,
            input_ids=torch.zeros(n, dtype=torch.int64), positions=positions,
            token_req=torch.arange(rows).repeat_interleave(tokens), out_cache_loc=positions + page,
            page_table=page_table, seq_lens=torch.full((rows,), seq, dtype=torch.int32), seq_lens_cpu=[seq] * rows,
            prefix_lens_cpu=[seq - tokens] * rows, extend_lens_cpu=[tokens] * rows, kv_cache=cache,
        )  # fmt: skip
        cos, sin = (torch.empty(n, cfg.qk_rope_head_dim // 2, dtype=dtype) for _ in range(2))
        h = torch.randn(n, cfg.hidden_size, dtype=dtype)
    return cfg, layers, batch, h, cos, sin


def count(tokens: int, context: int, batch_size: int = 1) -> dict[str, Counter]:
    """``{"dense": Counter(name -> launches), "moe": ...}`` for one layer of each kind."""
    from breakgraph.forward_context import forward_batch_context

    with ExitStack() as stack:
        patches(stack, prefill=tokens > 1)
        cfg, layers, batch, h, cos, sin = build_layers(tokens, context, batch_size)
        stack.enter_context(forward_batch_context(batch))
        stack.enter_context(torch.inference_mode())
        out = {}
        for kind, layer in zip(("dense", "moe"), layers):
            mode = Launches()
            record_triton(mode)
            layer(h, cos, sin, None)  # once before counting: one-time allocations (split-K counters) stay out
            mode.kernels.clear()
            with mode:
                layer(h, cos, sin, None)
            out[kind] = Counter(mode.kernels)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--tokens", type=int, nargs="+", default=[1, 1024], help="1 = decode step; more = prefill"
    )
    ap.add_argument("--context", type=int, default=1024, help="tokens cached before a decode step")
    ap.add_argument(
        "--decode-batch",
        type=int,
        nargs="+",
        default=[1],
        help="requests in a decode step (with --tokens 1), each with --context cached tokens",
    )
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (kernels are recorded, not run)")
    cfg = PRESETS["glm5-tp8-rank"]
    n_dense, n_layers = cfg["first_k_dense_replace"], cfg["num_hidden_layers"]
    summary = []
    runs = [(t, b) for t in args.tokens for b in (args.decode_batch if t == 1 else [1])]
    for t, b in runs:
        label = f"decode bs {b}, context {args.context}" if t == 1 else f"prefill {t} tokens"
        counts = count(t, args.context, b)
        print(f"== {label}")
        for kind, c in counts.items():
            print(f"  {kind} layer: {sum(c.values())} launches")
            for name, k in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])):
                print(f"    {k:3d}  {name}")
        dense, moe = (sum(c.values()) for c in counts.values())
        mean = (n_dense * dense + (n_layers - n_dense) * moe) / n_layers
        summary.append((label, dense, moe, mean))
    print(f"\n| run | dense layer | MoE layer | per layer ({n_layers} layers) |\n|---|---|---|---|")
    for label, dense, moe, mean in summary:
        print(f"| {label} | {dense} | {moe} | {mean:.1f} |")
    for (k, n), like in ASSUMED_FP8_TABLE.items():
        print(f"(FP8 linear K={k} N={n}, not yet timed on the H200: counted with the paths of K={like[0]} N={like[1]})")


if __name__ == "__main__":
    main()
