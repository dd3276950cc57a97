"""Time one op's SM90 entry in several source trees of cuLA, side by side on the same GPU, and compare their outputs.

    python tools/ab_trees.py [--op gdn|kda|gla|simple_gla] [--shapes 2x16384x64,8x2048x32,skewed10] [--split] [--l2norm]
        [--gate-in-kernel] [--profile] [--seg auto,24,32] TREE[@NAME=VALUE,...] [TREE[@...] ...]

A tree is a folder holding a ``cula`` package: this checkout (``.``) or another revision extracted into the
repository, optionally with environment settings for its process after an ``@`` (an opt-in switch against its default
in one checkout: ``. .@NAME=1``), for instance ``mkdir -p dev_trees/merge && git archive gdn-merge-registers cula |
tar -x -C dev_trees/merge`` (plain files travel with the working tree to the GPU machine; a ``git worktree`` would be
a nested repository, sent without its files). Each tree runs in its own subprocess, in the order given, on inputs made
from one seed, and times the op's public SM90 entry with ``triton.testing.do_bench``; the first tree's outputs are the
reference for the largest absolute difference of the others' (o and final state). Trees are timed in turn, the first
again at the end, so drift between calls shows. A shape is B x T x H, or one of the benchmark's varlen mixes at H = 32
by kind and count: ``uniform10``, ``random20``, ``skewed10`` (N = 10 over T = 16384, N = 20 over T = 32768; ``random``
draws its lengths from ``random.Random(0)``). ``--profile`` adds each call's CUDA kernel times (``torch.profiler``,
mean of 5 calls): what a split call spends outside the chunk kernel; and the host's time to issue one call
(``host_ms``, 20 calls unwaited: near ``ms``, the call is bound by its host path). ``--seg`` times each shape once per
entry: ``auto`` as the planner cuts, a number N cuts every sequence longer than N chunks every N chunks (the planner's
choice against its neighbours: a skewed mix's long sequence of 128 chunks is in 4 pieces at 32). A cut call runs one
CTA per value head unless ``CULA_VALUE_BLOCKS=2`` is in the tree's settings (``TREE@CULA_VALUE_BLOCKS=2``), which
times value blocks where the planner would not choose them.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = r"""
import json, sys, torch
from triton.testing import do_bench
tree, op, shapes, split, l2norm, layer_gate, profile, out_dir, tag, segs = sys.argv[1:11]
sys.path.insert(0, tree)
import random, re
import cula
assert cula.__file__.startswith(tree.rstrip("/")), cula.__file__
from benchmarks.run import host_issue_ms, varlen_lengths
sys.path.append("tools")  # the inputs' helper from this checkout (the working directory), whatever the tree holds
from chunk_inputs import chunk_inputs
if op == "gdn":
    from cula.gdn.chunk_fwd_sm90 import chunk_gated_delta_rule_fwd_sm90 as entry
elif op == "kda":
    from cula.kda.chunk_fwd_sm90 import chunk_kda_fwd_sm90 as entry
elif op == "gla":
    from cula.gla.chunk_fwd_sm90 import chunk_gla_fwd_sm90
    def entry(q, k, v, g, beta, **kw):  # no beta: the per-key gate g alone
        return chunk_gla_fwd_sm90(q, k, v, g, **kw)
else:
    from cula.lightning.chunk_fwd_sm90 import chunk_simple_gla_fwd_sm90
    def entry(q, k, v, g, beta, **kw):  # no beta: the per-token gate g alone
        return chunk_simple_gla_fwd_sm90(q, k, v, g=g, **kw)
split = {"auto": None, "on": True, "off": False}[split]
from cula.ops import segment_split
planner = segment_split.plan_segments
rows = []
for shape, seg in ((s, c) for s in shapes.split(",") for c in segs.split(",")):
    segment_split.plan_segments = planner if seg == "auto" else (
        lambda lengths, *_a, n=int(seg) * segment_split.CHUNK, **_k: [list(range(n, m, n)) for m in lengths]
    )
    cut_plans = getattr(sys.modules.get("cula.sm90.entry"), "_cut_plan", None)
    if cut_plans is not None:  # the plans are cached per layout: made again under this planner
        cut_plans.cache_clear()
    name = shape if seg == "auto" else f"{shape}/seg{seg}"
    mix = re.fullmatch(r"(uniform|random|skewed)(\d+)", shape)
    cu = None
    if mix:
        n = int(mix[2])
        B, T, H = 1, 16384 if n <= 10 else 32768, 32
        lengths = varlen_lengths(mix[1], n, T, random.Random(0))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    else:
        B, T, H = (int(x) for x in shape.split("x"))
    g = torch.Generator(device="cuda").manual_seed(B * 1000003 + T * 101 + H)
    q, k, v, gl, beta, kw = chunk_inputs(
        op, B, T, H, l2norm == "1", layer_gate == "1",
        lambda *s: torch.randn(*s, device="cuda", generator=g), lambda *s: torch.rand(*s, device="cuda", generator=g),
    )
    def run():
        return entry(q, k, v, gl, beta, output_final_state=True, cu_seqlens=cu, split=split, **kw)
    o, ht = run()
    torch.cuda.synchronize()
    torch.save((o.cpu(), ht.cpu()), f"{out_dir}/{name.replace('/', '_')}.{tag}.pt")
    row = {"shape": name, "ms": do_bench(run, warmup=50, rep=300), "nan": bool(o.isnan().any() or ht.isnan().any())}
    if profile == "1":
        from torch.profiler import ProfilerActivity
        with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run()
            torch.cuda.synchronize()
        times = {e.key[:70]: e.device_time_total / 5e3 for e in prof.key_averages() if e.device_time_total > 0}
        row["kernels_ms"] = dict(sorted(times.items(), key=lambda kv: -kv[1])[:6])
        # the host's time to issue a call (its launches queue up unwaited): near "ms", the call is host-bound
        row["host_ms"] = host_issue_ms(run)
    rows.append(row)
print(json.dumps(rows))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", default="gdn", choices=["gdn", "kda", "gla", "simple_gla"])
    p.add_argument("--shapes", default="2x16384x64,8x2048x32,1x8192x64", help="comma list of BxTxH")
    p.add_argument("--split", default="auto", choices=["auto", "on", "off"], help="the entry's split argument")
    p.add_argument("--l2norm", action="store_true", help="raw q / k normalised by the kernel (qk_l2norm)")
    p.add_argument(
        "--gate-in-kernel", action="store_true", help="kda: a raw bf16 gate activated by the kernel, bf16 beta"
    )
    p.add_argument(
        "--profile", action="store_true", help="add each call's CUDA kernel times (torch.profiler) and host time"
    )
    p.add_argument("--seg", default="auto", help="comma list: auto (the planner's cuts) or a cut length in chunks")
    p.add_argument("--out", default=None, help="write the table as JSON here")
    p.add_argument("trees", nargs="+")
    a = p.parse_args()
    import torch

    order = [*a.trees, a.trees[0]] if len(a.trees) > 1 else a.trees
    results = []
    with tempfile.TemporaryDirectory() as out_dir:
        for i, spec in enumerate(order):
            tree, _, settings = spec.partition("@")
            env = {**os.environ, **dict(kv.split("=", 1) for kv in settings.split(",") if kv)}
            root = str(Path(tree).resolve())
            flags = ["1" if x else "0" for x in (a.l2norm, a.gate_in_kernel, a.profile)]
            args = [root, a.op, a.shapes, a.split, *flags, out_dir, str(i), a.seg]
            done = subprocess.run(
                [sys.executable, "-c", WORKER, *args],
                capture_output=True,
                text=True,
                cwd=Path(__file__).resolve().parent.parent,
                env=env,
            )
            if done.returncode != 0:
                print(f"{spec}: failed\n{done.stderr[-3000:]}", flush=True)
                results.append({"tree": spec, "rows": None})
                continue
            rows = json.loads(done.stdout.strip().splitlines()[-1])
            for row in rows:
                if i > 0 and results[0]["rows"] is not None:
                    saved = f"{out_dir}/{row['shape'].replace('/', '_')}"
                    o0, h0 = torch.load(f"{saved}.0.pt")
                    o1, h1 = torch.load(f"{saved}.{i}.pt")
                    row["max_diff_o"] = (o1.float() - o0.float()).abs().max().item()
                    row["max_diff_state"] = (h1 - h0).abs().max().item()
                print(f"{spec:40s} {row['shape']:14s} {row['ms']:.4f} ms  " + json.dumps(row), flush=True)
            results.append({"tree": spec, "rows": rows})
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
