"""Compile the decode step's small Triton kernels for sm_90a on the CPU and print their resource
report: registers, spills, SASS instructions, warp shuffles and block barriers.

    python scripts/aot_decode_kernels.py

No GPU needed (Triton ships ptxas; :func:`breakgraph.kernels.aot.compile_for_sm90`). The
constexprs are those the dispatchers choose at one decode token of ``glm5-tp8-rank``: the
indexer's RoPE + LayerNorm (32 heads of 128, 64 rotated, with and without the cache store),
MLA's RoPE + kv norm (8 heads, latent 512 + 64) and the router's top-8 of 256 experts in both
launch shapes of ``route_select`` (one single-warp program per row up to 64 rows; blocks of 8
rows on 4 warps above). Fewer instructions and barriers on a one-program kernel is what a
latency-bound decode launch pays for; the time itself comes from ``breakgraph bench decode``.
"""

from __future__ import annotations


def main() -> int:
    from breakgraph.kernels import aot, triton_moe, triton_rope

    if not aot.tools_available():
        print("this triton has no bundled ptxas/cuobjdump")
        return 1
    bf16 = "*bf16"
    rope_i = {p: bf16 for p in ("q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "w_ptr", "b_ptr", "q_out_ptr", "k_out_ptr", "cache_ptr")}
    rope_i |= {"slots_ptr": "*i64", "inv_d": "fp32", "eps": "fp32"}
    rope_m = {p: bf16 for p in ("q_ptr", "kva_ptr", "cos_ptr", "sin_ptr", "w_ptr", "q_out_ptr", "kv_ptr", "cache_ptr")}
    rope_m |= {"slots_ptr": "*i64", "inv_r": "fp32", "eps": "fp32"}
    route = {"scores_ptr": "*fp32", "bias_ptr": "*fp32", "w_out_ptr": "*fp32", "id_out_ptr": "*i64", "scaling": "fp32"}
    route_c = {"TOP_K": 8, "K_P2": 8, "N_GROUP": 1, "G_P2": 1, "TOPK_GROUP": 1, "HAS_BIAS": True, "NORM": True,
               "E_P2": 256, "LOGITS": True, "INTERP": False}  # fmt: skip
    idx_c = {"INTERLEAVED": True, "BLOCK_H": 32, "BLOCK_D": 128, "BLOCK_HALF": 32, "INTERP": False}
    mla_c = {"INTERLEAVED": True, "BLOCK_R": 512, "BLOCK_H": 8, "BLOCK_HALF": 32, "INTERP": False}
    cases = [  # (name, launch, kernel, argument types, constexprs, warps)
        ("indexer RoPE + LayerNorm", "1 token", triton_rope._indexer_rope_qk_kernel, rope_i, idx_c | {"STORE": False}, 4),
        ("indexer RoPE + LayerNorm", "1 token, cache store", triton_rope._indexer_rope_qk_kernel, rope_i,
         idx_c | {"STORE": True}, 4),
        ("MLA RoPE + kv norm", "1 token, cache store", triton_rope._mla_rope_kv_kernel, rope_m, mla_c | {"STORE": True}, 4),
        ("route, top-8 of 256", f"1 row a program, 1 warp (≤ {triton_moe.ROUTE_ONE_WARP_ROWS} rows)",
         triton_moe._route_kernel, route, route_c | {"BLOCK_T": 1}, 1),
        ("route, top-8 of 256", "8 rows a program, 4 warps (more rows)", triton_moe._route_kernel, route,
         route_c | {"BLOCK_T": 8}, 4),
    ]  # fmt: skip
    print("| kernel | launch | registers | spill stack B | instructions | warp shuffles | barriers |")
    print("|---|---|---|---|---|---|---|")
    for name, launch, fn, types, consts, warps in cases:
        r = aot.compile_for_sm90(fn, types, consts, warps, 1)
        ops = r["ops"]
        print(f"| {name} | {launch} | {r['regs']} | {r['stack']} | {sum(ops.values())} | "
              f"{ops.get('SHFL.BFLY', 0)} | {ops.get('BAR.SYNC.DEFER_BLOCKING', 0)} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
