"""A/B of the SM90 chunk kernels: the earlier ones against the family's (``CULA_SM90_FAMILY``), in one process on
the same inputs (the benchmark's, :mod:`benchmarks.run`), the kernel forced (``CULA_BACKEND=cute``).

    python tools/ab_family.py [--ops gdn,kda] [--grid core,varlen,long] [--rounds 3] [--out DIR]

Per shape: each side's median ms (``triton.testing.do_bench``'s median, the two sides alternating for ``--rounds`` rounds,
the median of the rounds), family / earlier, the output and final state of each side against cuLA's fp32 reference
on the first heads, and the family's against the earlier's. Prints a table; ``--out`` also gets ``ab_family.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIDES = ("earlier", "family")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default="gdn,kda")
    parser.add_argument("--grid", default="core,varlen,long")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    from benchmarks import run as bench
    from benchmarks import shapes
    from cula.sm90.entry import FAMILY_SWITCH

    rows = []
    for case in shapes.cases(args.ops.split(","), args.grid.split(","), 128):
        inputs = bench.make_inputs(case, "cuda", torch.bfloat16, requires_grad=False)
        fn, _ = bench.entry_points(case.op)
        outs, times = {}, {s: [] for s in SIDES}
        row = {"op": case.op, "shape": case.name}
        try:
            with bench.forced_backend("cute"):
                for side in SIDES:
                    os.environ[FAMILY_SWITCH] = "1" if side == "family" else "0"
                    outs[side] = fn(**inputs)  # compiles
                for _ in range(args.rounds):
                    for side in SIDES:
                        os.environ[FAMILY_SWITCH] = "1" if side == "family" else "0"
                        times[side].append(bench.bench(lambda fn=fn, inputs=inputs: fn(**inputs))[1])
            reference = bench.reference_outputs(case.op, inputs)
            for side in SIDES:
                row[f"{side}_ms"] = statistics.median(times[side])
                row[f"{side}_vs_ref"] = bench.ref_rmse(*outs[side], reference, bench.REF_HEADS)
            row["family_over_earlier"] = row["family_ms"] / row["earlier_ms"]
            row["family_vs_earlier"] = [
                bench.rel_rmse(f, e) for f, e in zip(outs["family"], outs["earlier"], strict=True)
            ]
        except Exception as error:  # recorded, the other shapes still timed
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        finally:
            os.environ.pop(FAMILY_SWITCH, None)
        rows.append(row)
        print(json.dumps(row), flush=True)

    print(
        f"\n{'op':<4} {'shape':<36} {'earlier ms':>10} {'family ms':>10} {'ratio':>6}  vs ref (o, state) earlier / family"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['op']:<4} {r['shape']:<36} {r['error']}")
            continue
        e, f = r["earlier_vs_ref"], r["family_vs_ref"]
        print(
            f"{r['op']:<4} {r['shape']:<36} {r['earlier_ms']:>10.3f} {r['family_ms']:>10.3f} "
            f"{r['family_over_earlier']:>6.3f}  {e[0]:.4f} {e[1]:.4f} / {f[0]:.4f} {f[1]:.4f}"
        )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "ab_family.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
