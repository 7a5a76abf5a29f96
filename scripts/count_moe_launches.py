"""Count the kernel launches and programs of one MoE layer at decode sizes (GLM-5 TP8 rank,
FP8), before and after the decode kernels, on the CPU: Triton kernels are recorded and not run
(``TRITON_INTERPRET=1``), PyTorch ops that launch a kernel on a GPU are counted by a dispatch
mode. Routing (router GEMM, sigmoid, top-k kernel) is the same on both paths and not counted.

    TRITON_INTERPRET=1 python scripts/count_moe_launches.py --tokens 1 16 64

"separate": the routed experts' grouped GEMMs (``fused_moe_triton``), the shared expert's two FP8
linears (Triton: activation quantisation, GEMM, split-K sum where it splits) with SiLU and
multiply between, ``routed + shared`` and the residual add. "grouped": the grouped GEMMs with the
shared expert as one more expert and the residual in the combine (the path above
``DECODE_MAX_TOKENS`` tokens). "decode": ``fused_moe_decode`` with the shared expert and the
residual folded in (the path up to it).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from breakgraph.bench.presets import PRESETS, moe_shape

E, D, INTER, TOP_K = moe_shape(PRESETS["glm5-tp8-rank"])
# ops that launch nothing on a GPU (allocation, views, metadata)
_FREE = ("empty", "view", "reshape", "_unsafe_view", "split", "chunk", "slice", "select", "t.", "transpose",
         "detach", "alias", "as_strided", "expand", "permute", "unsqueeze", "squeeze", "lift_fresh")  # fmt: skip


class Launches(TorchDispatchMode):
    """Records ``(name, programs)`` per kernel: Triton grids while ``triton_active`` is off."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: list[tuple[str, int]] = []
        self.inside_triton = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        if not self.inside_triton and not any(name.startswith(f.rstrip(".")) for f in _FREE):
            self.kernels.append((f"aten.{name}", 0))
        return func(*args, **(kwargs or {}))


def record_triton(mode: Launches) -> None:
    """Make every Triton launch record its grid in ``mode`` instead of running."""
    import triton.runtime.interpreter as interp

    def getitem(self, grid):
        def launch(*args, **kwargs):
            g = grid(kwargs) if callable(grid) else grid
            programs = 1
            for n in g:
                programs *= int(n)
            mode.kernels.append((self.fn.__name__, programs))

        return launch

    interp.InterpretedFunction.__getitem__ = getitem


def operands(t: int) -> dict:
    from breakgraph.kernels.fp8 import FP8_DTYPE
    from breakgraph.kernels.moe import SharedExpert

    def w(*shape):
        return torch.empty(*shape, dtype=torch.uint8).view(FP8_DTYPE)

    def s(*shape):
        return torch.ones(*shape)

    ids = torch.stack([torch.randperm(E)[:TOP_K] for _ in range(t)])
    return {
        "x": torch.randn(t, D).bfloat16(), "res": torch.randn(t, D).bfloat16(), "tw": torch.rand(t, TOP_K),
        "ids": ids, "w13": w(E, 2 * INTER, D), "s13": s(E, 2 * INTER // 128, D // 128), "w2": w(E, D, INTER),
        "s2": s(E, D // 128, INTER // 128),
        "shared": SharedExpert(w(2 * INTER, D), w(D, INTER), s(2 * INTER // 128, D // 128), s(D // 128, INTER // 128)),
    }  # fmt: skip


def separate(o: dict) -> None:
    from breakgraph.kernels.triton_fp8 import fp8_linear
    from breakgraph.kernels.triton_moe import fused_moe_triton

    sh = o["shared"]
    out = fused_moe_triton(o["x"], o["w13"], o["w2"], o["tw"], o["ids"], o["s13"], o["s2"])
    gate, up = fp8_linear(o["x"], sh.w13, sh.w13_scale, (128, 128), path="triton").chunk(2, dim=-1)
    out = out + fp8_linear(F.silu(gate) * up, sh.w2, sh.w2_scale, (128, 128), path="triton")
    o["res"] + out


def grouped(o: dict) -> None:
    from breakgraph.kernels.triton_moe import fused_moe_triton

    fused_moe_triton(o["x"], o["w13"], o["w2"], o["tw"], o["ids"], o["s13"], o["s2"], shared=o["shared"],
                     residual=o["res"])  # fmt: skip


def decode(o: dict) -> None:
    from breakgraph.kernels.triton_moe import fused_moe_decode

    fused_moe_decode(o["x"], o["w13"], o["w2"], o["tw"], o["ids"], o["s13"], o["s2"], shared=o["shared"],
                     residual=o["res"])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (kernels are recorded, not run)")
    print(f"one MoE layer, E={E} D={D} I={INTER} top-{TOP_K} + shared expert, FP8; routing not counted")
    for t in args.tokens:
        o = operands(t)
        for label, fn in (("separate", separate), ("grouped", grouped), ("decode", decode)):
            mode = Launches()
            record_triton(mode)
            with mode:
                fn(o)
            names = Counter(name for name, _ in mode.kernels)
            grids = ", ".join(f"{n}:{p}" for n, p in mode.kernels if p)
            print(f"T={t:3d} {label:8s} {len(mode.kernels):2d} launches  [{', '.join(f'{n}×{c}' for n, c in names.items())}]")
            print(f"{'':20s}programs per Triton launch: {grids}")


if __name__ == "__main__":
    main()
