"""Compile every registered CuTe DSL kernel for every arch it claims, on a machine without a GPU.

``python -m cula.compile_check [--kernel NAME] [--arch ARCH]`` imports every kernel module (modules of the cula
package named ``*_sm<digits>``; importing registers them through :func:`cula.runtime.register_kernel`), compiles
each (kernel, arch) with fake tensors, checks its PTX for the expected instructions, prints a table and exits
non-zero on any compile error or missing instruction.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import pkgutil
import re
import struct
import sys
import time
import traceback

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


@dataclasses.dataclass
class Report:
    kernel: str
    arch: str
    ok: bool
    seconds: float
    counts: dict[str, int]
    registers: int | None = None
    error: str = ""


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
    return Report(name, arch, not error, seconds, counts, max(regs) if regs else None, error)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", action="append", help="only these kernels (repeatable)")
    parser.add_argument("--arch", action="append", help="only these archs (repeatable)")
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

    print(f"{'kernel':<32} {'arch':<8} {'status':<6} {'compile s':>9} {'regs':>5}  expected PTX counts")
    for r in reports:
        counts = ", ".join(f"{k}={v}" for k, v in r.counts.items())
        regs = "-" if r.registers is None else str(r.registers)
        print(f"{r.kernel:<32} {r.arch:<8} {'ok' if r.ok else 'FAIL':<6} {r.seconds:>9.1f} {regs:>5}  {counts}")
    for r in reports:
        if not r.ok:
            print(f"\n{r.kernel} [{r.arch}]: {r.error}", file=sys.stderr)
    if not reports:
        print("no kernels registered", file=sys.stderr)
    return 0 if reports and not failed_imports and all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
