"""Instructions per k-block of the FP8 MoE GEMMs' main loops in the sm_90a compile (no GPU).

    python scripts/moe_dequant_sass.py

For each W8A16 tile of the decode and prefill defaults and each dequantisation mode
(``DEQUANT`` 0: every weight scaled to bf16 in registers; 1: exact widening, the block scale on
the k-block's fp32 product; 2: the bf16 bit rebuild, the same with 2¹²⁰ folded into the scale),
and W8A8 beside them: instructions per trip of the largest loop per warp, those on the float
conversion units (``F2F``, ``F2FP``, ``I2F``, ``F2I``), the integer bit operations (``PRMT``,
``LOP3``, ``SHF``) and the total per weight byte a thread converts.
"""

from __future__ import annotations

from breakgraph.kernels import triton_moe as tm
from breakgraph.kernels.aot import compile_for_sm90

CONVERSIONS = ("F2F", "F2FP", "I2F", "F2I")
BITS = ("PRMT", "LOP3", "SHF")

TILES = [  # (label, kernel, silu, BLOCK_M, BLOCK_N, TILES_N, swap, warps, stages)
    ("gate/up decode", "grouped", True, 16, 64, 1, True, 4, 4),
    ("down decode", "stream", False, 16, 128, 4, True, 4, 4),
    ("gate/up prefill", "grouped", True, 64, 64, 1, False, 4, 4),
    ("down prefill", "grouped", False, 64, 128, 1, False, 4, 3),
]


def loop_counts(kernel: str, silu: bool, bm: int, bn: int, tiles: int, swap: bool, warps: int, stages: int,
                mode: int | None) -> dict:
    """sm_90a loop figures of one tile; ``mode`` None: W8A8 (e4m3 activations)."""
    a8 = mode is None
    types = {"a_ptr": "*fp8e4nv" if a8 else "*bf16", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
             "c_ptr": "*bf16", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_blocks_ptr": "*i32"}
    consts = {"GATHER": silu, "SILU": silu, "W_FP8": True, "A_FP8": a8, "BLOCK_M": bm, "BLOCK_N": bn,
              "BLOCK_K": 128, "SCALE_BN": 128, "SCALE_BK": 128, "INTERP": False, "DEQUANT": mode or 0}
    if kernel == "stream":
        fn = tm._moe_stream_kernel
        consts |= {"EVEN": True, "TILES_N": tiles}
    else:
        fn = tm._moe_gemm_kernel
        consts["SWAP_AB"] = swap
    info = compile_for_sm90(fn, types, consts, warps, stages)
    ops = info["loop_ops"]
    weights = (2 if silu else 1) * bn * 128 / (32 * warps)  # weight bytes per thread and k-block
    return {
        "loop": info["loop_insts"],
        "conv": sum(n for op, n in ops.items() if op.split(".")[0] in CONVERSIONS),
        "bits": sum(n for op, n in ops.items() if op.split(".")[0] in BITS),
        "per_byte": info["loop_insts"] / weights,
        "regs": info["regs"],
        "spills": info["local_insts"],
    }  # fmt: skip


def main() -> None:
    print(f"{'tile':<16} {'mode':<8} {'loop':>5} {'conv':>5} {'bits':>5} {'/byte':>6} {'regs':>5} spills")
    for label, kernel, silu, bm, bn, tiles, swap, warps, stages in TILES:
        for mode in (0, 1, 2, None):
            r = loop_counts(kernel, silu, bm, bn, tiles, swap, warps, stages, mode)
            name = "W8A8" if mode is None else f"W8A16 {mode}"
            print(f"{label:<16} {name:<8} {r['loop']:5d} {r['conv']:5d} {r['bits']:5d} {r['per_byte']:6.2f} "
                  f"{r['regs']:5d} {r['spills']}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
