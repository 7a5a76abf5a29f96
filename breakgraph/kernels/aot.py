"""Compile a Triton kernel for sm_90a without a GPU and read its resource use.

Triton ships ``ptxas`` and ``cuobjdump``, so register counts, spills and the matrix
instructions a kernel gets can be checked on any machine (tests, ``scripts/bench_kernels_*``).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any


def tools_available() -> bool:
    """Whether the installed Triton bundles the NVIDIA tools :func:`compile_for_sm90` needs."""
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return (tools / "ptxas").exists() and (tools / "cuobjdump").exists()


def _specialise(name: str, value: Any, constexprs: dict) -> tuple[str, bool]:
    """(signature type, 16-divisible) of one argument, as the JIT would specialise it."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"argument {name!r}: give a type string or an example int/float, got {value!r}")
    if isinstance(value, float):
        return "fp32", False
    if isinstance(value, int):
        if value == 1:
            constexprs[name] = 1
            return "constexpr", False
        return "i32", value % 16 == 0
    # A type string: pointers, and ints whose name says they are row strides or GEMM sizes,
    # get the 16-divisibility the JIT infers for real tensors.
    aligned = name.startswith("stride") and not name.endswith(("sg", "sk"))
    return value, value.startswith("*") or (value == "i32" and (aligned or name in ("K", "N", "UP_OFF")))


def _opcodes(sass: str) -> list[str]:
    """Opcodes of a SASS listing in order, predicates dropped."""
    return [re.sub(r"^@!?U?P\w+\s+", "", m.group(1).strip()).split()[0]
            for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]  # fmt: skip


def _largest_loop(sass: str) -> list[str]:
    """Opcodes of the largest backward-branch range of a SASS listing (a kernel's main loop
    body; empty without a loop), predicates dropped."""
    insts, best = [], []
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass):
        addr = int(m.group(1), 16)
        insts.append((addr, re.sub(r"^@!?U?P\w+\s+", "", m.group(2).strip()).split()[0]))
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", m.group(2))
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            body = [op for a, op in insts if lo <= a <= addr]
            best = body if len(body) > len(best) else best
    return best


def compile_for_sm90(
    fn, args: dict[str, Any], constexprs: dict, num_warps: int = 4, num_stages: int = 3, maxnreg: int | None = None
) -> dict:
    """Compile ``fn`` for sm_90a and return ``{"regs", "stack", "local_insts", "mma", "smem_B",
    "async_copies", "async_copies_16B", "loop_insts", "loop_ops", "ops", "narrow_stores",
    "vector_loads"}`` (``mma``: the matrix instructions in the SASS, e.g. ``["HGMMA"]`` for wgmma;
    ``async_copies``: its ``LDGSTS`` instructions, the cp.async loads software pipelining issues,
    ``async_copies_16B`` those of them that move 16 bytes per thread;
    ``loop_insts``: the instructions per trip of its largest loop, per warp, ``loop_ops`` their
    opcodes with counts (``{"HGMMA.64x16x16.F32.BF16": 16, ...}``), ``ops`` those of the whole
    kernel; ``narrow_stores``:
    its 1- and 2-byte global stores, which an uncoalesced byte store of e4m3 codes compiles to;
    ``vector_loads``: its 128-bit global loads, ``LDG.E.128``).

    ``args`` gives each non-constexpr argument a type string (``"*bf16"``, ``"fp32"``, ``"i32"``)
    or an example value (an int, specialised like the JIT: 1 becomes a constant, multiples of 16
    are marked divisible; a float is fp32); unnamed arguments are i32, unnamed constexprs with a
    default take it; ``maxnreg`` caps the
    registers per thread as the launch option of that name does. Raises RuntimeError when
    the installed Triton has no bundled ``ptxas``/``cuobjdump`` (:func:`tools_available`).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not tools_available():
        raise RuntimeError("this triton has no bundled ptxas/cuobjdump")
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    consts = dict(constexprs)
    for param in fn.params:  # constexprs left out take their defaults, as at a launch
        if param.is_constexpr and param.has_default and param.name not in consts:
            consts[param.name] = param.default
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        sig[name], divisible = _specialise(name, args.get(name, "i32"), consts)
        if divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(
        ASTSource(fn, sig, constexprs=consts, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})},
    )
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])

        def dump(flag: str) -> str:
            return subprocess.run([tools / "cuobjdump", flag, cubin], capture_output=True, text=True, check=True).stdout

        sass, res = dump("-sass"), dump("-res-usage")
    return {
        "regs": int(re.search(r"REG:(\d+)", res).group(1)),
        "stack": int(re.search(r"STACK:(\d+)", res).group(1)),
        "local_insts": len(re.findall(r"\b(?:LDL|STL)\b", sass)),
        "mma": sorted(set(re.findall(r"\b(HGMMA|QGMMA|HMMA)\b", sass))),
        "smem_B": kernel.metadata.shared,
        "async_copies": len(re.findall(r"\bLDGSTS\b", sass)),
        "async_copies_16B": len(re.findall(r"\bLDGSTS(?:\.\w+)*\.128\b", sass)),
        "loop_insts": len(loop := _largest_loop(sass)),
        "loop_ops": dict(Counter(loop)),
        "ops": dict(Counter(_opcodes(sass))),
        "narrow_stores": len(re.findall(r"\bSTG\.E\.[US](?:8|16)\b", sass)),
        "vector_loads": len(re.findall(r"\bLDG\.E\.128\b", sass)),
    }
