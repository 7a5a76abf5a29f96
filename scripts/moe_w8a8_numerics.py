"""Is W8A8 for the FP8 experts the numerics the engine already accepts for its dense FP8 linears?

    python scripts/moe_w8a8_numerics.py                      # both parts, CPU
    python scripts/moe_w8a8_numerics.py --part kernels       # GEMM level only (GLM-5 TP8-rank shapes)
    python scripts/moe_w8a8_numerics.py --part model --problems 40

The dense FP8 linears quantise their activations per (token, 128 columns) to e4m3 (W8A8) on the
GPU, and their tests hold them to 2e-2 of the quantising oracle and 6e-2 of the bf16-activation
twin (``tests/test_kernels_fp8.py``); the MoE's W8A8 quantises the same way, once per GEMM.

1. ``kernels``: relative deviation from the bf16-activation twins, on random data at the
   GLM-5 TP8-rank shapes, of each dense linear (one quantised GEMM), of the shared expert's MLP
   as the dense path runs it (two chained quantised GEMMs) and of the routed experts (two
   chained quantised GEMMs, 32 of the 256 experts to fit a CPU: the per-GEMM numerics do not
   depend on the expert count).
2. ``model``: the demo checkpoint with its projections and experts in FP8 (64-wide blocks, the
   widths its shapes allow) run greedy by the CPU engine with each GEMM class's activations
   kept (W8A16) or quantised (W8A8) — dense linears × routed experts, the twins patched to
   quantise their inputs exactly as the kernels do — against the all-W8A16 run: the demo
   accuracy, completions identical to that run's, and the prompt logits' relative deviation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path

import torch

from breakgraph.bench.presets import PRESETS, dense_linear_shapes, moe_shape
from breakgraph.kernels import linear as linear_mod
from breakgraph.kernels import moe as moe_mod
from breakgraph.kernels.fp8 import block_quant, fp8_block_linear_ref
from breakgraph.kernels.triton_fp8 import act_dequant, act_quant_ref

DEMO = Path(__file__).resolve().parents[1] / "breakgraph" / "demo" / "assets" / "glm5-tiny-arith"


def qdq(x: torch.Tensor) -> torch.Tensor:
    """``x`` through the W8A8 kernels' activation quantisation (e4m3 per row and 128 columns) and
    back, in ``x``'s dtype."""
    shape = x.shape
    q, s = act_quant_ref(x.reshape(-1, shape[-1]))
    return act_dequant(q, s).to(x.dtype).reshape(shape)


@contextlib.contextmanager
def quantised(dense: bool, experts: bool):
    """Patch the CPU twins so that the dense FP8 linears (the shared expert's included) and/or
    the routed experts' two GEMMs see their inputs as the W8A8 kernels do."""
    saved = (linear_mod.fp8_block_linear_ref, moe_mod.fp8_block_linear_ref, moe_mod.grouped_linear)

    def dense_ref(x, w, s, block, bias=None):
        return fp8_block_linear_ref(qdq(x), w, s, block, bias)

    def grouped(x, w, offsets):
        return saved[2](qdq(x), w, offsets)

    try:
        if dense:
            linear_mod.fp8_block_linear_ref = moe_mod.fp8_block_linear_ref = dense_ref
        if experts:
            moe_mod.grouped_linear = grouped
        yield
    finally:
        linear_mod.fp8_block_linear_ref, moe_mod.fp8_block_linear_ref, moe_mod.grouped_linear = saved


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def kernels_part(tokens: int) -> None:
    torch.manual_seed(0)
    cfg = PRESETS["glm5-tp8-rank"]
    num_e, d, inter, top_k = moe_shape(cfg)
    print(f"GEMM level, {tokens} tokens, bf16 activations, relative deviation of W8A8 from the bf16-activation twin")
    for name, k, n in dense_linear_shapes(cfg):
        w8, ws = block_quant(torch.randn(n, k) / k**0.5)
        x = torch.randn(tokens, k).bfloat16()
        dev = _rel(fp8_block_linear_ref(qdq(x), w8, ws, (128, 128)), fp8_block_linear_ref(x, w8, ws, (128, 128)))
        print(f"  dense {name:<24} K={k:5d} N={n:5d}: {dev:.2e}")
    w13, s13 = block_quant(torch.randn(2 * inter, d) / d**0.5)
    w2, s2 = block_quant(torch.randn(d, inter) / inter**0.5)
    shared = moe_mod.SharedExpert(w13, w2, s13, s2)
    x = torch.randn(tokens, d).bfloat16()
    want = moe_mod.shared_expert_ref(x, shared)
    with quantised(dense=True, experts=False):
        got = moe_mod.shared_expert_ref(x, shared)
    print(f"  dense MLP (the shared expert, two quantised GEMMs): {_rel(got, want):.2e}")
    e = 32
    w13, s13 = block_quant(torch.randn(e, 2 * inter, d) / d**0.5)
    w2, s2 = block_quant(torch.randn(e, d, inter) / inter**0.5)
    tw, ids = moe_mod.route_ref(torch.randn(tokens, e), None, top_k, 1, 1, True, 2.5)
    want = moe_mod.fused_moe_ref(x, w13, w2, tw, ids, s13, s2)
    with quantised(dense=False, experts=True):
        got = moe_mod.fused_moe_ref(x, w13, w2, tw, ids, s13, s2)
    print(f"  routed experts ({e} of {num_e}, top-{top_k}, two quantised GEMMs): {_rel(got, want):.2e}")


def fp8_demo(dst: Path, block: int = 64) -> Path:
    """The demo checkpoint with every projection matrix (experts and shared expert included) in
    FP8 ``block``-wide tiles; embeddings, LM head, norms and the router as they are."""
    from safetensors.torch import load_file, save_file

    config = json.loads((DEMO / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}  # fmt: skip
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config))
    for f in DEMO.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (dst / f.name).write_bytes(f.read_bytes())
    out = {}
    for name, t in load_file(DEMO / "model.safetensors").items():
        keep = any(k in name for k in ("embed_tokens", "lm_head", "norm", "weights_proj", "mlp.gate.")) or t.dim() != 2
        if keep:
            out[name] = t
        else:
            out[name], out[name[: -len("weight")] + "weight_scale_inv"] = block_quant(t, (block, block))
    save_file(out, dst / "model.safetensors")
    return dst


def model_part(problems: int, dtype: str) -> None:
    from breakgraph import Engine
    from breakgraph.demo.evaluate import complete, format_prompt, score, split_problems

    probs = (split_problems("examples") + split_problems("dev") + split_problems("templates", 200))[:problems]
    with tempfile.TemporaryDirectory() as tmp:
        folder = fp8_demo(Path(tmp) / "demo-fp8")
        engine = Engine(folder, device="cpu", dtype=dtype, page_size=16)
        ids = [engine.tokenizer.encode(format_prompt(p.question)) for p in probs[:8]]
        runs = {}
        for dense, experts in ((False, False), (True, False), (False, True), (True, True)):
            t0 = time.perf_counter()
            with quantised(dense, experts):
                texts = complete(folder, [p.question for p in probs], dtype=dtype)
                logits = engine.prompt_logits(ids)
            runs[dense, experts] = (score(probs, texts), texts, logits, time.perf_counter() - t0)
    base = runs[False, False]
    print(f"\nModel level: demo checkpoint in FP8 (64-wide blocks), {len(probs)} problems, greedy, CPU {dtype}")
    print(f"{'dense linears':<14} {'routed experts':<15} {'accuracy':>9} {'same text':>10} {'logits vs W8A16':>16}")
    for (dense, experts), (res, texts, logits, secs) in runs.items():
        same = sum(a == b for a, b in zip(texts, base[1]))
        dev = max(_rel(a, b) for a, b in zip(logits, base[2]))
        print(f"{'W8A8' if dense else 'W8A16':<14} {'W8A8' if experts else 'W8A16':<15} "
              f"{res.accuracy:9.3f} {same:5d}/{len(texts):<4} {dev:16.2e}   ({secs:.0f} s)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["kernels", "model", "both"], default="both")
    ap.add_argument("--tokens", type=int, default=64, help="rows of the GEMM-level comparison")
    ap.add_argument("--problems", type=int, default=70, help="demo problems of the model-level comparison")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    if args.part in ("kernels", "both"):
        kernels_part(args.tokens)
    if args.part in ("model", "both"):
        model_part(args.problems, args.dtype)


if __name__ == "__main__":
    main()
