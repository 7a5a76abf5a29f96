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
from breakgraph.kernels.fp8 import FP8_DTYPE  # noqa: E402
from breakgraph.kernels.triton_fp8 import QUANT_GROUP, act_quant  # noqa: E402

SHAPES = ((8192, 6144), (1024, 6144), (8192, 2048), (1, 6144))


def launch(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, quant: bool, num_warps: int) -> None:
    """One ``_rms_norm_kernel`` launch over ``x [M, N]`` with the residual add, fresh outputs."""
    m, n = x.shape
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    q = torch.empty(m, n, dtype=FP8_DTYPE, device=x.device) if quant else None
    s = torch.empty(n // QUANT_GROUP, m, dtype=torch.float32, device=x.device).t() if quant else None
    triton_norm._rms_norm_kernel[(m,)](
        x, res, w, out, res_out, q, s, m, n, x.stride(0), res.stride(0), *(s.stride() if quant else (0, 0)),
        1.0 / n, 1e-6, HAS_RESIDUAL=True, QUANT=quant, GROUP=QUANT_GROUP, BLOCK=triton.next_power_of_2(n),
        INTERP=False, num_warps=num_warps,
    )  # fmt: skip


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
