"""RMSNorm with and without the fused FP8 quantisation of its output, beside the separate
quantisation kernel, at glm5-tp8-rank widths (CUDA): µs per call (``triton.testing.do_bench``)
per ``num_warps``. ``q0``: the norm with the residual add; ``q1``: the same kernel also writing the
e4m3 codes and per-128 scales; ``act_quant``: the quantisation kernel the linears run otherwise.

    python scripts/bench_norm_quant.py
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from breakgraph.kernels import triton_norm  # noqa: E402
from breakgraph.kernels.triton_fp8 import QUANT_GROUP, act_quant  # noqa: E402

SHAPES = ((8192, 6144), (1024, 6144), (8192, 2048), (1, 6144))


def launch(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, quant: bool, num_warps: int) -> None:
    """One ``_rms_norm_kernel`` launch over ``x [M, N]`` with the residual add, as the engine
    launches it (fresh outputs) but with ``num_warps`` given."""
    triton_norm._launch(x, res, w, 1e-6, quant_pad_rows=1 if quant else 0, num_warps=num_warps)


def main() -> None:
    for m, n in SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        r, w = torch.randn_like(x), torch.randn(n, device="cuda", dtype=torch.bfloat16)
        row = [f"{m}x{n}"]
        for quant in (False, True):
            for warps in (4, 8, 16):
                t = triton.testing.do_bench(partial(launch, x, r, w, quant, warps), warmup=20, rep=100)
                row.append(f"q{int(quant)}w{warps}={t * 1e3:.1f}us")
        t = triton.testing.do_bench(
            partial(act_quant, x, QUANT_GROUP, column_major_scale=True), warmup=20, rep=100
        )
        row.append(f"act_quant={t * 1e3:.1f}us")
        print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
