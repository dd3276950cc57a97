"""What the compiler made of the registered kernels (``cula.runtime.register_kernel``), on any machine:

    python tools/kernel_artifacts.py fingerprint [NAME ...] [--arch sm_90a]
    python tools/kernel_artifacts.py sass NAME [--at PC ...] [--context 12] [--arch sm_90a]

``fingerprint``: the md5 of each kernel's PTX without its comment lines (whose names contain one of the NAMEs; all
without one), one line each: a refactor that should change nothing shows the same lines before and after (run it
in both trees and diff). ``sass NAME``: that kernel's machine code (``cuobjdump -sass``), whole, or the ``--context``
instructions either side of each ``--at`` PC (hex, as compute-sanitizer reports it: ``kernel+0x6910`` is 6910).
Compile with ``CUTE_DSL_LINEINFO=1`` as the report's run did, and on the machine that ran it: another machine's DSL
build may schedule the code differently.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys


def registered(names: list[str]) -> dict:
    from cula import compile_check, runtime

    failed = compile_check.import_kernel_modules()
    if failed:
        sys.exit("\n".join(failed))
    kernels = runtime.registered_kernels()
    return {n: k for n, k in sorted(kernels.items()) if not names or any(s in n for s in names)}


def artifacts(kernel, arch: str):
    from cula import runtime

    with runtime.keeping_artifacts():
        return kernel.compile_fn(arch).artifacts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    fp = sub.add_parser("fingerprint")
    fp.add_argument("names", nargs="*")
    fp.add_argument("--arch", default="sm_90a")
    sa = sub.add_parser("sass")
    sa.add_argument("name")
    sa.add_argument("--at", nargs="*", default=[])
    sa.add_argument("--context", type=int, default=12)
    sa.add_argument("--arch", default="sm_90a")
    args = ap.parse_args()

    if args.command == "fingerprint":
        for name, kernel in registered(args.names).items():
            if args.arch not in kernel.archs:
                continue
            ptx = artifacts(kernel, args.arch).PTX
            body = "\n".join(line for line in ptx.splitlines() if not line.lstrip().startswith("//"))
            print(hashlib.md5(body.encode()).hexdigest(), name, flush=True)
        return

    from cula import compile_check

    kernels = registered([])
    if args.name not in kernels:
        sys.exit(f"no registered kernel {args.name!r}; registered: {', '.join(kernels)}")
    sass = compile_check.sass_of(artifacts(kernels[args.name], args.arch).CUBIN)
    if sass is None:
        sys.exit("no cuobjdump here (nor triton's)")
    if not args.at:
        print(sass)
        return
    lines = sass.splitlines()
    where = {int(m.group(1), 16): i for i, line in enumerate(lines) if (m := re.search(r"/\*([0-9a-f]{4,})\*/", line))}
    for pc in args.at:
        i = where.get(int(pc, 16))
        if i is None:
            print(f"PC {pc}: not an instruction of this build")
            continue
        print(f"---- PC {pc}")
        print("\n".join(lines[max(0, i - args.context) : i + args.context + 1]))


if __name__ == "__main__":
    main()
