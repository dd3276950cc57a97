"""Compile every registered CuTe DSL kernel for every arch it claims, on a machine without a GPU.

``python -m cula.compile_check [--kernel NAME] [--arch ARCH]`` imports every kernel module (modules of the cula
package named ``*_sm<digits>``; importing registers them through :func:`cula.runtime.register_kernel`), compiles
each (kernel, arch) with fake tensors, checks its PTX for the expected instructions and its machine code (SASS,
through the ``cuobjdump`` that ships with triton) for local memory and ptxas-injected ``warpgroup.arrive``, prints a
table and exits non-zero on any compile error, missing instruction, mbarrier wait of a fixed phase inside a loop
(:func:`fixed_phase_waits`), or unclean SASS of a kernel registered with
``clean_sass``. With ``--roles`` it also breaks each kernel's SASS down by warp role (:func:`sass_roles`): where the
spills are, and how long each role's chunk loop is.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import pkgutil
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from cula import runtime

_KERNEL_MODULE = re.compile(r"_sm\d+$")


def import_kernel_modules() -> list[str]:
    """Import every ``cula`` module whose name ends in ``_sm<digits>``; returns the names that failed."""
    import cula

    failed = []
    for info in pkgutil.walk_packages(cula.__path__, "cula."):
        if _KERNEL_MODULE.search(info.name):
            try:
                importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 - reported, and the check fails
                failed.append(f"{info.name}: {traceback.format_exc(limit=3)}")
    return failed


def cubin_registers(cubin: bytes) -> list[int]:
    """Registers per thread of each kernel in a cubin: the EIATTR_REGCOUNT records of its ``.nv.info`` section."""
    if not cubin or cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        return []
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    str_off = headers[shstrndx][4]
    regs = []
    for h in headers:
        name_end = cubin.index(b"\0", str_off + h[0])
        if cubin[str_off + h[0] : name_end] != b".nv.info":
            continue
        data, i = cubin[h[4] : h[4] + h[5]], 0
        while i + 4 <= len(data):
            fmt, attr = data[i], data[i + 1]
            if fmt == 0x04:  # EIFMT_SVAL: u16 size, then the value
                (size,) = struct.unpack_from("<H", data, i + 2)
                if attr == 0x2F and size >= 8:  # EIATTR_REGCOUNT: (function symbol, count)
                    regs.append(struct.unpack_from("<II", data, i + 4)[1])
                i += 4 + size
            else:
                i += 4
    return regs


def cuda_tool(name: str) -> str | None:
    """CUDA's binary tool ``name`` (``cuobjdump``, ``nvdisasm``) on PATH, else the one triton ships."""
    exe = shutil.which(name)
    if exe:
        return exe
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(bundled) if bundled.exists() else None


def disassemble(cubin: bytes, tool: str, *flags: str) -> str | None:
    """A cubin through CUDA's binary tool ``tool`` (:func:`cuda_tool`) with ``flags``: its output, or None without
    the tool or the cubin."""
    exe = cuda_tool(tool)
    if exe is None or not cubin:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([exe, *flags, f.name], capture_output=True, text=True, check=True).stdout


def sass_of(cubin: bytes) -> str | None:
    """The disassembled machine code of a cubin, or None without a ``cuobjdump``."""
    return disassemble(cubin, "cuobjdump", "-sass")


def sass_counts(sass: str, ptx: str) -> tuple[int, int]:
    """(local-memory instructions: STL/LDL, i.e. spills; ``warpgroup.arrive`` that ptxas injected: SASS
    WARPGROUP.ARRIVE beyond the PTX's ``wgmma.fence``, each one a wgmma that waits for register writes)."""
    local = len(re.findall(r"\b(?:STL|LDL)(?:\.\w+)*\b", sass))
    injected = max(0, sass.count("WARPGROUP.ARRIVE") - ptx.count("wgmma.fence"))
    return local, injected


def fixed_phase_waits(ptx: str) -> list[str]:
    """The mbarrier waits inside a loop (other than a wait's own retry loop) whose phase is a constant. A chunk loop
    waits the phase its ring positions hold, which changes from chunk to chunk: a constant there is a position the
    loop does not carry (a ``PipelineState`` moved on inside a function it was passed to and never rebound by the
    loop: the DSL carries only the names a loop rebinds or calls methods on), and such a kernel reads stale stages
    and hangs. A producer's first acquire before its loop rightly waits a constant phase."""
    lines = ptx.splitlines()
    labels = {m[1]: i for i, line in enumerate(lines) if (m := re.match(r"(\$L__\w+):", line.strip()))}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", line)
        if m and labels.get(m[1], i) < i - 20:
            loops.append((labels[m[1]], i))
    return [
        line.strip()
        for i, line in enumerate(lines)
        if re.search(r"mbarrier\.try_wait\.parity[^;]*\], \d+,", line) and any(a < i < b for a, b in loops)
    ]


_SASS_LINE = re.compile(r"/\*([0-9a-f]+)\*/\s+(.+?)\s*;")


@dataclasses.dataclass
class RoleCounts:
    """One warp role's part of a kernel's SASS (:func:`sass_roles`)."""

    start: str  # the setmaxnreg that opens it (USETMAXREG...), or "prologue"
    instructions: int
    local_mem: int  # STL / LDL
    arrives: int  # WARPGROUP.ARRIVE (the PTX's wgmma.fence and what ptxas injected)
    ex2: int  # MUFU.EX2
    longest_loop: int  # instructions between the target and the source of its longest backward branch


def sass_roles(sass: str) -> list[RoleCounts]:
    """Split a warp-specialised kernel's SASS where a ``setmaxnreg`` (USETMAXREG) starts a role's code, and count per
    part what tells a role's cost apart: spills, arrives, exponentials and its longest loop (the chunk loop, with any
    inner loop unrolled or not). Parts follow the code's layout: a role's code is the part its setmaxnreg opens, up to
    its unconditional EXIT."""
    lines = [(int(m[1], 16), m[2]) for m in _SASS_LINE.finditer(sass)]
    parts: list[list[tuple[int, str]]] = [[]]
    starts = ["prologue"]
    for addr, text in lines:
        if "USETMAXREG" in text:
            parts.append([])
            starts.append(" ".join(t for t in text.split() if not t.startswith("UP")))
            continue
        parts[-1].append((addr, text))
    roles = []
    for start, part in zip(starts, parts, strict=True):
        # a role's code ends at its EXIT: after the last one sit the out-of-line retry loops of mbarrier waits
        part = part[: next((i + 1 for i, (_, t) in enumerate(part) if t == "EXIT"), len(part))]
        ops = [t.split()[1] if t.startswith("@") else t.split()[0] for _, t in part]
        index = {a: i for i, (a, _) in enumerate(part)}
        longest = 0
        for i, (addr, text) in enumerate(part):
            m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
            if m and int(m[1], 16) < addr and int(m[1], 16) in index:
                longest = max(longest, i - index[int(m[1], 16)] + 1)
        roles.append(
            RoleCounts(
                start,
                len(part),
                sum(o.startswith(("STL", "LDL")) for o in ops),
                sum(o.startswith("WARPGROUP.ARRIVE") for o in ops),
                sum(o.startswith("MUFU.EX2") for o in ops),
                longest,
            )
        )
    return [r for r in roles if r.instructions]


@dataclasses.dataclass
class Report:
    kernel: str
    arch: str
    ok: bool
    seconds: float
    counts: dict[str, int]
    registers: int | None = None
    error: str = ""
    local_mem: int | None = None
    injected_arrives: int | None = None
    roles: list[RoleCounts] = dataclasses.field(default_factory=list)


def check_kernel(name: str, arch: str) -> Report:
    """Compile one registered kernel for ``arch`` and check its PTX."""
    import_kernel_modules()
    spec = runtime.registered_kernels()[name]
    t0 = time.perf_counter()
    try:
        with runtime.keeping_artifacts():
            compiled = spec.compile_fn(arch)
    except Exception:  # noqa: BLE001 - reported as a failed check
        return Report(name, arch, False, time.perf_counter() - t0, {}, None, traceback.format_exc(limit=5))
    seconds = time.perf_counter() - t0
    ptx = compiled.artifacts.PTX or ""
    counts = {s: ptx.count(s) for s in spec.expected_ptx}
    regs = cubin_registers(compiled.artifacts.CUBIN or b"")
    missing = [s for s, c in counts.items() if c == 0]
    error = f"missing in PTX: {missing}" if missing else ("" if ptx else "no PTX produced")
    fixed = fixed_phase_waits(ptx)
    if fixed and not error:
        error = f"mbarrier waits of a fixed phase inside a loop (a ring position the loop does not carry): {fixed[:3]}"
    sass = sass_of(compiled.artifacts.CUBIN or b"")
    local = injected = None
    if sass is not None:
        local, injected = sass_counts(sass, ptx)
    if spec.clean_sass and not error:
        if sass is None:
            error = "cannot check the SASS: no cuobjdump (it ships with triton)"
        elif local > spec.sass_allowed[0] or injected > spec.sass_allowed[1]:
            error = (
                f"SASS not clean: {local} local-memory instructions (spills), {injected} warpgroup.arrive injected"
                f" (allowed: {spec.sass_allowed[0]}, {spec.sass_allowed[1]})"
            )
    roles = sass_roles(sass) if sass else []
    return Report(name, arch, not error, seconds, counts, max(regs) if regs else None, error, local, injected, roles)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", action="append", help="only these kernels (repeatable)")
    parser.add_argument("--arch", action="append", help="only these archs (repeatable)")
    parser.add_argument("--roles", action="store_true", help="each kernel's SASS by warp role (sass_roles)")
    args = parser.parse_args(argv)

    failed_imports = import_kernel_modules()
    for f in failed_imports:
        print(f"IMPORT FAILED {f}", file=sys.stderr)
    specs = runtime.registered_kernels()
    reports = []
    for name, spec in sorted(specs.items()):
        if args.kernel and name not in args.kernel:
            continue
        for arch in spec.archs:
            if args.arch and arch not in args.arch:
                continue
            reports.append(check_kernel(name, arch))

    head = f"{'kernel':<32} {'arch':<8} {'status':<6} {'compile s':>9} {'regs':>5} {'lmem':>5} {'arrive+':>7}"
    print(f"{head}  expected PTX counts")
    for r in reports:
        counts = ", ".join(f"{k}={v}" for k, v in r.counts.items())
        regs, lmem, arrive = ("-" if x is None else str(x) for x in (r.registers, r.local_mem, r.injected_arrives))
        row = f"{r.kernel:<32} {r.arch:<8} {'ok' if r.ok else 'FAIL':<6} {r.seconds:>9.1f} {regs:>5} {lmem:>5} {arrive:>7}"
        print(f"{row}  {counts}")
        for role in r.roles if args.roles else []:
            print(
                f"    {role.start:<40} instructions {role.instructions:>6}  longest loop {role.longest_loop:>5}  "
                f"local {role.local_mem:>4}  arrives {role.arrives:>3}  ex2 {role.ex2:>4}"
            )
    for r in reports:
        if not r.ok:
            print(f"\n{r.kernel} [{r.arch}]: {r.error}", file=sys.stderr)
    if not reports:
        print("no kernels registered", file=sys.stderr)
    return 0 if reports and not failed_imports and all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
