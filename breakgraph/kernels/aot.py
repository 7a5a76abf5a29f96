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


def _loops(sass: str) -> list[tuple[str, ...]]:
    """Every backward-branch range of a SASS listing as the tuple of its instructions
    (``OPCODE.MODIFIERS operands``), in program order: a kernel's loop bodies."""
    insts, loops = [], []
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass):
        addr = int(m.group(1), 16)
        insts.append((addr, m.group(2).strip()))
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", m.group(2))
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            first = next(i for i, (a, _) in enumerate(insts) if a >= lo)
            loops.append(tuple(text for _, text in insts[first:]))
    return loops


# Shared-memory instructions of sm_90 SASS: loads (``LDSM``: ldmatrix), stores, the asynchronous
# global → shared copies.
_SHARED_OPS = ("LDS", "LDSM", "STS", "LDGSTS")


def _opcode(inst: str) -> str:
    """``LDS.U.128 R4, [R2]`` → ``LDS`` (a leading predicate ``@P0`` dropped)."""
    return re.sub(r"^@!?U?P\w+\s+", "", inst).split()[0].split(".")[0]


def _mma_loop(sass: str) -> tuple[int, int]:
    """(instructions, local-memory loads and stores) of the smallest backward-branch range of a
    SASS listing that holds a matrix instruction (a kernel's innermost dot loop; 0s without one)."""
    insts = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = None
    for addr, text in insts:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            body = [t for a, t in insts if int(target.group(1), 16) <= a <= addr]
            if any(re.search(r"\b(HGMMA|QGMMA|HMMA)\b", t) for t in body) and (best is None or len(body) < len(best)):
                best = body
    body = best or []
    return len(body), sum(bool(re.search(r"\b(?:LDL|STL)\b", t)) for t in body)


def _opcodes(sass: str) -> list[str]:
    """Opcodes with their modifiers (``HGMMA.64x16x16.F32.BF16``) of a SASS listing in order,
    predicates dropped."""
    return [re.sub(r"^@!?U?P\w+\s+", "", m.group(1).strip()).split()[0]
            for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]  # fmt: skip


def _before_gdc_wait(ops: list[str]) -> dict[str, int] | None:
    """Opcodes (with counts) ahead of the first ``griddepcontrol.wait`` (SASS ``ACQBULK``) in
    program order; None when the kernel has no wait."""
    if "ACQBULK" not in ops:
        return None
    return dict(Counter(ops[: ops.index("ACQBULK")]))


def compile_for_sm90(
    fn, args: dict[str, Any], constexprs: dict, num_warps: int = 4, num_stages: int = 3, maxnreg: int | None = None
) -> dict:
    """Compile ``fn`` for sm_90a and return ``{"regs", "stack", "local_insts", "loop_local_insts", "mma", "smem_B",
    "async_copies", "async_copies_16B", "loop_insts", "loop_sizes", "loop_ops", "loop_shared", "ops", "narrow_stores",
    "vector_loads", "mma_loop_insts", "mma_loop_spills", "before_gdc_wait"}`` (``mma``: the matrix instructions in the SASS, e.g. ``["HGMMA"]`` for wgmma;
    ``async_copies``: its ``LDGSTS`` instructions, the cp.async loads software pipelining issues,
    ``async_copies_16B`` those of them that move 16 bytes per thread; ``loop_local_insts``: the
    local-memory (spill) loads and stores inside its loops (``local_insts``: in all of it);
    ``loop_insts``: the instructions per trip of its largest loop, per warp (``loop_sizes``: of
    every loop, in program order), ``loop_ops`` their
    opcodes with counts (``{"HGMMA.64x16x16.F32.BF16": 16, ...}``), ``ops`` those of the whole
    kernel; ``loop_shared``: the loop's shared-memory instructions by opcode (``LDS``, ``LDSM``,
    ``STS``, ``LDGSTS``); ``narrow_stores``:
    its 1- and 2-byte global stores, which an uncoalesced byte store of e4m3 codes compiles to;
    ``vector_loads``: its 128-bit global loads, ``LDG.E.128``; ``mma_loop_insts`` and
    ``mma_loop_spills``: the instructions and the spill loads and stores of its innermost loop
    with a matrix instruction, per warp and trip; ``before_gdc_wait``: the opcodes ahead of its
    programmatic-dependent-launch wait, None without one).

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
    loops = _loops(sass)
    loop = max(loops, key=len, default=())  # the main loop body (empty without a loop)
    mma_insts, mma_spills = _mma_loop(sass)
    return {
        "regs": int(re.search(r"REG:(\d+)", res).group(1)),
        "stack": int(re.search(r"STACK:(\d+)", res).group(1)),
        "local_insts": len(re.findall(r"\b(?:LDL|STL)\b", sass)),
        "loop_local_insts": sum(bool(re.search(r"\b(?:LDL|STL)\b", i)) for body in loops for i in body),
        "mma": sorted(set(re.findall(r"\b(HGMMA|QGMMA|HMMA)\b", sass))),
        "smem_B": kernel.metadata.shared,
        "async_copies": len(re.findall(r"\bLDGSTS\b", sass)),
        "async_copies_16B": len(re.findall(r"\bLDGSTS(?:\.\w+)*\.128\b", sass)),
        "loop_insts": len(loop),
        "loop_sizes": [len(body) for body in loops],
        "loop_ops": dict(Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0] for i in loop)),
        "loop_shared": {op: sum(_opcode(i) == op for i in loop) for op in _SHARED_OPS},
        "ops": dict(Counter(_opcodes(sass))),
        "before_gdc_wait": _before_gdc_wait(_opcodes(sass)),
        "narrow_stores": len(re.findall(r"\bSTG\.E\.[US](?:8|16)\b", sass)),
        "vector_loads": len(re.findall(r"\bLDG\.E\.128\b", sass)),
        "mma_loop_insts": mma_insts,
        "mma_loop_spills": mma_spills,
    }
