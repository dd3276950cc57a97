"""Where a kernel's warps wait, by ncu: a target to profile, and summaries of its per-instruction stall samples.

    ncu --set full --import-source yes --clock-control none -k regex:DeltaChunkBwd --launch-skip 1 --launch-count 1 \\
        -o OUT/gdn_bwd python3 tools/ncu_report.py run --op gdn --mode step
    ncu -i OUT/gdn_bwd.ncu-rep --page source --csv --print-source sass > OUT/gdn_bwd_sass.csv
    python tools/ncu_report.py summary OUT/gdn_bwd_sass.csv
    python tools/ncu_report.py lines "gdn_chunk_bwd_sm90[fixed length]" OUT/gdn_bwd_sass.csv [--top 40]

``run`` calls the op three times on one B x T x H shape (D = 128, bf16): ``--mode fwd`` cuLA's forward,
``step`` a forward + backward served by cuLA's kernels, ``flashinfer`` FlashInfer's fused GDN prefill (GDN only). The
kernel name regexes: ``DeltaChunkBwd``, ``KeyGateChunkBwd``, ``ScalarGateChunkBwd`` (the per-chunk gradient kernels),
``ScalarGateChunkFwd``, ``KDAChunkFwd``, ``GLAChunkFwd`` (the forwards), ``FullyFusedDeltaRule`` (FlashInfer's).
``summary`` prints the share of each stall reason over all samples, then per 4 KB of code the share of the samples
there and how many of them wait for an instruction fetch (``no_inst``) or at a barrier: straight-line code past the
instruction cache shows as stretches where ``no_inst`` dominates. ``lines`` puts the samples and executed
instructions on the kernel's Python source lines: it compiles the registered kernel ``NAME`` (as
``tools/kernel_artifacts.py`` names them; the configuration the profiled call ran) here with line info, and matches
its machine code to the profiled one by opcode runs, since the GPU machine's compiler may schedule it differently
(an instruction left unmatched is counted on the line before it, marked ``~``). Several launches in one report:
export each one's CSV with ``--launch-skip i --launch-count 1``.
"""

import argparse
import collections
import csv
import difflib
import os
import re
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


def source_rows(path: str) -> tuple[list[list[str]], dict[str, int], list[str]]:
    """An ncu source-page CSV (``--print-source sass``): its instruction rows, its column index by name, and its
    stall-reason columns."""
    rows = list(csv.reader(open(path, errors="replace")))
    head_at = next(i for i, row in enumerate(rows) if "Address" in row)
    head, body = rows[head_at], [row for row in rows[head_at + 1 :] if len(row) == len(rows[head_at])]
    col = {name: i for i, name in enumerate(head)}
    reasons = [name for name in head if name.startswith("stall_") and "Not Issued" not in name]
    return body, col, reasons


def summary(path: str) -> None:
    body, col, reasons = source_rows(path)
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


def opcode(instruction: str) -> str:
    """An instruction's opcode without its predicate: ``LDG.E.64`` of ``@!P1 LDG.E.64 R2, desc[UR4][R4.64]``."""
    words = instruction.strip().rstrip(";").split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def line_listing(disassembly: str) -> list[tuple[str, str]]:
    """``(opcode, "package/file.py:line")`` of each instruction of ``nvdisasm -g -c`` output, in address order (``"?"``
    before the first line mark; the file's folder kept: the variants' modules share names)."""
    listing, line = [], "?"
    for text in disassembly.splitlines():
        mark = re.match(r'\s*//## File "(.*?)", line (\d+)', text)
        if mark:
            folder, file = os.path.split(mark.group(1))
            line = f"{os.path.basename(folder)}/{file}:{mark.group(2)}"
            continue
        code = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*)", text)
        if code:
            listing.append((opcode(code.group(1)), line))
    return listing


def align_lines(profiled: list[str], listing: list[tuple[str, str]]) -> list[str]:
    """The source line of each profiled instruction (its opcodes in address order) from ``listing``
    (:func:`line_listing`): through the longest common runs of opcodes; an unmatched instruction takes the line of
    the matched one before it, marked ``~``."""
    matcher = difflib.SequenceMatcher(None, profiled, [op for op, _ in listing], autojunk=False)
    lines = [None] * len(profiled)
    for i, j, n in matcher.get_matching_blocks():
        for x in range(n):
            lines[i + x] = listing[j + x][1]
    last = "?"
    for i, line in enumerate(lines):
        if line is None:
            lines[i] = "~" + last
        else:
            last = line
    return lines


def lines(name: str, path: str, top: int) -> None:
    os.environ["CUTE_DSL_LINEINFO"] = "1"  # before the DSL compiles
    sys.path.insert(0, os.path.dirname(__file__))
    from kernel_artifacts import artifacts, registered

    from cula import compile_check

    kernels = registered([name])
    if name not in kernels:
        sys.exit(f"no registered kernel {name!r}")
    disassembly = compile_check.disassemble(artifacts(kernels[name], "sm_90a").CUBIN, "nvdisasm", "-g", "-c")
    if disassembly is None:
        sys.exit("no nvdisasm here (nor triton's)")
    listing = line_listing(disassembly)
    body, col, reasons = source_rows(path)
    where = align_lines([opcode(row[col["Source"]]) for row in body], listing)
    unmatched = sum(line.startswith("~") for line in where)
    print(f"{len(body)} profiled instructions, {len(listing)} compiled here, {unmatched} placed by a neighbour (~)")
    per_line = collections.defaultdict(collections.Counter)
    for row, line in zip(body, where, strict=True):
        counts = per_line[line]
        counts["sass"] += 1
        counts["executed"] += number(row[col["Instructions Executed"]])
        for reason in reasons:
            counts[reason] += number(row[col[reason]])
            counts["samples"] += number(row[col[reason]])
    samples = sum(c["samples"] for c in per_line.values()) or 1.0
    executed = sum(c["executed"] for c in per_line.values()) or 1.0
    print(f"{'line':36s} {'sass':>5s} {'executed':>8s} {'samples':>8s}  stalls there")
    for line, c in sorted(per_line.items(), key=lambda item: -item[1]["samples"])[:top]:
        worst = sorted(((c[r], r[len("stall_") :]) for r in reasons if c[r]), reverse=True)[:3]
        stalls = " ".join(f"{r} {100 * v / max(c['samples'], 1.0):.0f} %" for v, r in worst)
        print(
            f"{line:36s} {c['sass']:5d} {100 * c['executed'] / executed:7.1f}% {100 * c['samples'] / samples:7.1f}%"
            f"  {stalls}"
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
    by_line = sub.add_parser("lines")
    by_line.add_argument(
        "name", help="the registered kernel the profiled launch ran, e.g. gla_chunk_fwd_sm90[states walk]"
    )
    by_line.add_argument("csv")
    by_line.add_argument("--top", type=int, default=40)
    opts = parser.parse_args()
    if opts.command == "run":
        run(opts.op, opts.mode, opts.shape)
    elif opts.command == "lines":
        lines(opts.name, opts.csv, opts.top)
    else:
        summary(opts.csv)


if __name__ == "__main__":
    main()
