"""Where a kernel's warps wait, by ncu: a target to profile, and a summary of its per-instruction stall samples.

    ncu --set full --import-source yes --clock-control none -k regex:DeltaChunkBwd --launch-skip 1 --launch-count 1 \\
        -o OUT/gdn_bwd python3 tools/ncu_report.py run --op gdn --mode step
    ncu -i OUT/gdn_bwd.ncu-rep --page source --csv --print-source sass > OUT/gdn_bwd_sass.csv
    python tools/ncu_report.py summary OUT/gdn_bwd_sass.csv

``run`` calls the op three times on one B x T x H shape (D = 128, bf16): ``--mode fwd`` cuLA's forward,
``step`` a forward + backward served by cuLA's kernels, ``flashinfer`` FlashInfer's fused GDN prefill (GDN only). The
kernel name regexes: ``DeltaChunkBwd``, ``KeyGateChunkBwd``, ``ScalarGateChunkBwd`` (the per-chunk gradient kernels),
``ScalarGateChunkFwd``, ``KDAChunkFwd``, ``GLAChunkFwd`` (the forwards), ``FullyFusedDeltaRule`` (FlashInfer's).
``summary`` prints the share of each stall reason over all samples, then per 4 KB of code the share of the samples
there and how many of them wait for an instruction fetch (``no_inst``) or at a barrier: straight-line code past the
instruction cache shows as stretches where ``no_inst`` dominates.
"""

import argparse
import csv
import os
import sys


def run(op: str, mode: str, shape: str) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    from backward_pass_times import entry_point, inputs, training_step

    B, T, H = (int(x) for x in shape.split("x"))
    args, do = inputs(op, B, T, H, "g")
    if mode == "flashinfer":
        from benchmarks.peers import FlashInferGDN

        peer = FlashInferGDN.load()
        converted = peer.convert(args)
        calls = [lambda: peer.call(converted, "fused")] * 3
    else:
        os.environ.setdefault("CULA_BACKEND", "cute")
        fn = entry_point(op)
        if mode == "step":
            calls = [training_step(fn, args, do, os.environ["CULA_BACKEND"])] * 3
        else:
            calls = [lambda: fn(**args)] * 3
    for call in calls:
        call()
        torch.cuda.synchronize()


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def summary(path: str) -> None:
    rows = list(csv.reader(open(path, errors="replace")))
    head_at = next(i for i, row in enumerate(rows) if "Address" in row)
    head, body = rows[head_at], [row for row in rows[head_at + 1 :] if len(row) == len(rows[head_at])]
    col = {name: i for i, name in enumerate(head)}
    reasons = [name for name in head if name.startswith("stall_") and "Not Issued" not in name]
    totals = {name: sum(number(row[col[name]]) for row in body) for name in reasons}
    all_samples = sum(totals.values()) or 1.0
    for name, value in sorted(totals.items(), key=lambda item: -item[1])[:8]:
        print(f"{name:24s} {100 * value / all_samples:5.1f} %")
    regions = {}
    for row in body:
        region = regions.setdefault(int(row[col["Address"]], 16) // 4096, [0.0, 0.0, 0.0])
        region[0] += sum(number(row[col[name]]) for name in reasons)
        region[1] += number(row[col["stall_no_inst"]])
        region[2] += number(row[col["stall_barrier"]])
    first = min(regions)
    print("code from   samples  no_inst  barrier")
    for region, (samples, no_inst, barrier) in sorted(regions.items()):
        share = max(samples, 1.0)
        print(
            f"{(region - first) * 4096:#8x}  {100 * samples / all_samples:6.1f} %"
            f"  {100 * no_inst / share:5.0f} %  {100 * barrier / share:5.0f} %"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    target = sub.add_parser("run")
    target.add_argument("--op", choices=("simple_gla", "gdn", "gla", "kda"), default="gdn")
    target.add_argument("--mode", choices=("fwd", "step", "flashinfer"), default="step")
    target.add_argument("--shape", default="1x8192x64")
    report = sub.add_parser("summary")
    report.add_argument("csv")
    opts = parser.parse_args()
    if opts.command == "run":
        run(opts.op, opts.mode, opts.shape)
    else:
        summary(opts.csv)


if __name__ == "__main__":
    main()
