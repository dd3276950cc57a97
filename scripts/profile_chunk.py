"""Where a chunk's time goes in an SM90 chunk kernel: clock64 stamps between its steps, on a GPU.

    python scripts/profile_chunk.py [--op gdn|gdn_roles|kda] [--B 2 --T 16384 --H 64] [--out stamps.json]
        [--module PATH]

The kernel module's source is patched in memory (the package is left as it is): after each anchor line of a chunk
loop, every warp's lane 0 of CTA (0, 0) writes the cycles since its loop began into the final-state tensor of that
CTA (whose own state store is skipped). The report gives, per warp, the mean cycles of each segment between the
anchors that warp passes (in a warp-specialised kernel each role has its own chain) over chunks 4 .. N, and the
kernel's wall time per chunk from CUDA events. The stamps add a few instructions per segment; the outputs of the
patched kernel are not checked.
"""

import argparse
import importlib.util
import json
import math
import re
import sys
import tempfile
from pathlib import Path

import torch

STAMPS = 128 * 128  # floats of ht[0, 0]: chunks x markers x warps

# both kernels: the chunk loop's first line, the final-state store, and the lines most anchors are (stripped)
LOOP = "for c in cutlass.range(n_chunks, unroll=1):"
STATE_STORE = "blocks.store_state(acc_s, cST, mHt, n, hv, row0)"
BARRIER = "cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)"
WAIT = "warpgroup.wait_group(0)"
AUX_BARRIER = "cute.arch.barrier(barrier_id=_AUX_BARRIER, number_of_threads=128)"
KDA_MATH_BARRIER = "cute.arch.barrier(barrier_id=_MATH_BARRIER, number_of_threads=nt)"
KDA_PREP_BARRIER = "cute.arch.barrier(barrier_id=_PREP_BARRIER, number_of_threads=self.prep_threads)"

# per op: the module, its entry, and the loop's anchors (stripped line text, occurrence after the loop start)
OPS = {
    "gdn": {
        "module": "cula/gdn/chunk_fwd_sm90.py",
        "entry": "chunk_gated_delta_rule_fwd_sm90",
        # the two-warpgroup kernel (D = 64, qk_l2norm's split passes), kept at D = 128: the four-role kernel that runs
        # there otherwise is not stamped by this script
        "replace": {"if uses_roles(head_dim, mode, intra):": "if False:"},
        "anchors": [
            ("gates issued", "nxt = gates_sm90.load_gates(gG, gBeta, tok0, seqlen, c + 1, lane, self.C)", 1),
            ("tiles landed", "cute.arch.mbarrier_wait(full + stage, (c // self.stages) % 2)", 1),
            ("KK^T / QK^T done", WAIT, 1),
            ("masks stored", BARRIER, 2),
            ("diagonal blocks", BARRIER, 3),
            ("merge", BARRIER, 4),
            ("S^T K^T / S^T Q^T waited", WAIT, 2),
            ("V_new waited", WAIT, 3),
            ("O / S products waited", WAIT, 4),
            ("O staged, chunk barrier", BARRIER, 5),
        ],
    },
    "gdn_roles": {
        "module": "cula/gdn/chunk_fwd_roles_sm90.py",
        # the entry stays in its own module, whose call of this module's compile function is pointed at the patched
        # module's
        "hook": "compile_gdn_fwd_roles_sm90",
        "entry_module": "cula.gdn.chunk_fwd_sm90",
        "entry": "chunk_gated_delta_rule_fwd_sm90",
        "warps": 16,
        # the aux role gets the stamps' tensor
        "replace": {
            (
                "self.aux_role(mma_ss, sQK, sA, sTP, gates, bars, scale, seqlen, n_chunks, tidx - 128, warp - 4,"
                " w_tiles)"
            ): (
                "self.aux_role(mma_ss, sQK, sA, sTP, gates, bars, scale, seqlen, n_chunks, tidx - 128, warp - 4,"
                " w_tiles, mHt)"
            ),
            "def aux_role(self, mma_ss, sQK, sA, sTP, gates, bars, scale, seqlen, n_chunks, atid, awarp, w_tiles):": (
                "def aux_role(self, mma_ss, sQK, sA, sTP, gates, bars, scale, seqlen, n_chunks, atid, awarp, w_tiles,"
                " mHt):"
            ),
        },
        "anchors": [
            ("aux: tiles, gates landed", "cute.arch.mbarrier_wait(g_full + s, (c // self.qk_stages) % 2)", 1),
            ("aux: K K^T waited", WAIT, 1),
            ("aux: sA free (barrier)", AUX_BARRIER, 1),
            ("aux: A masks stored", "warpgroup.fence()", 2),
            ("aux: Q K^T waited", WAIT, 2),
            ("aux: P stored", "cute.arch.mbarrier_arrive(qk_empty + s)", 1),
            ("aux: barrier", AUX_BARRIER, 2),
            ("aux: diagonal blocks", AUX_BARRIER, 3),
            ("aux: merge, Tinv published", "cute.arch.mbarrier_arrive(tp_full + ts)", 1),
            ("state: tiles, gates landed", "cute.arch.mbarrier_wait(v_full + vs, (c // self.v_stages) % 2)", 1),
            ("state: S^T K^T / S^T Q^T waited", WAIT, 3),
            ("state: Tinv waited", "cute.arch.mbarrier_wait(tp_full + ts, (c // self.tp_stages) % 2)", 1),
            ("state: V_new waited", WAIT, 4),
            ("state: O / S products waited", WAIT, 5),
            ("state: O staged, barrier", "cute.arch.barrier(barrier_id=_STATE_BARRIER, number_of_threads=256)", 1),
        ],
    },
    "kda": {
        "module": "cula/kda/chunk_fwd_sm90.py",
        "entry": "chunk_kda_fwd_sm90",
        "warps": 12,
        # the prep role gets the stamps' tensor
        "replace": {
            "seqlen, n_chunks, tidx - self.math_threads, warp - 2 * 4,": (
                "seqlen, n_chunks, tidx - self.math_threads, warp - 2 * 4, mHt,"
            ),
            "n_chunks, t, pwarp,": "n_chunks, t, pwarp, mHt,",
        },
        "anchors": [
            ("prep: q/k/g landed", "cute.arch.mbarrier_wait(bar_qkg, c % 2)", 1),
            ("prep: gate scan", "self.scan_gates(sGin, sG, sPart, sGl, sDec, slot, L, t, gate)", 1),
            ("prep: norms, barrier", KDA_PREP_BARRIER, 1),
            (
                "prep: R published",
                "cute.arch.barrier_arrive(barrier_id=_GR_FULL_BARRIER, number_of_threads=self.threads)",
                1,
            ),
            (
                "prep: B tiles published",
                "cute.arch.barrier_arrive(barrier_id=_B_FULL_BARRIER, number_of_threads=self.threads)",
                1,
            ),
            (
                "prep: AP_DONE waited",
                "cute.arch.barrier(barrier_id=_AP_DONE_BARRIER, number_of_threads=self.threads)",
                1,
            ),
            ("math: R waited", "cute.arch.mbarrier_wait(bar_qkg, c % 2)", 2),
            ("math: left operands, KR / QR waited", WAIT, 1),
            ("math: A / P stored", KDA_MATH_BARRIER, 1),
            ("math: diagonal blocks", KDA_MATH_BARRIER, 2),
            ("math: merge", KDA_MATH_BARRIER, 3),
            (
                "math: B tiles waited",
                "cute.arch.barrier(barrier_id=_B_FULL_BARRIER, number_of_threads=self.threads)",
                1,
            ),
            ("math: S^T K^T / S^T Q^T waited", WAIT, 2),
            ("math: V_new waited", WAIT, 3),
            ("math: O / S products waited", WAIT, 4),
            ("math: O staged, chunk barrier", KDA_MATH_BARRIER, 4),
        ],
    },
}

STAMP_FN = """

@cute.jit
def _stamp(mHt, t0, c, m: cutlass.Constexpr):
    hv, n, _ = cute.arch.block_idx()
    warp = cute.arch.warp_idx()
    if n == 0 and hv == 0 and cute.arch.lane_idx() == 0 and c < {n_chunks}:
        t = cute.arch.clock64()
        i = (c * {n_markers} + m) * {warps} + warp
        V = mHt.shape[3]
        mHt[0, 0, i // V, i % V] = (t - t0).to(cutlass.Float32)
"""


def stamped_chunks(spec: dict) -> int:
    return STAMPS // (len(spec["anchors"]) * spec.get("warps", 8))


def patched_source(spec: dict, root: Path, module: str | None = None) -> str:
    lines = (root / (module or spec["module"])).read_text().splitlines()
    loop = next(i for i, s in enumerate(lines) if s.strip() == LOOP)
    inserts = {}
    for m, (_, text, occurrence) in enumerate(spec["anchors"]):
        hits = [i for i in range(loop + 1, len(lines)) if lines[i].strip() == text]
        at = hits[occurrence - 1]
        indent = re.match(r"\s*", lines[at]).group(0)
        inserts.setdefault(at, []).append(f"{indent}_stamp(mHt, _t0, c, {m})")
    out = []
    for i, s in enumerate(lines):
        if s.strip() == LOOP:  # every chunk loop (one per role in a warp-specialised kernel) starts its own clock
            out.append(re.match(r"\s*", s).group(0) + "_t0 = cute.arch.clock64()")
        for text, repl in spec.get("replace", {}).items():
            if s.strip() == text:
                s = s.replace(text, repl)
        if s.strip() == STATE_STORE:
            indent = re.match(r"\s*", s).group(0)
            out += [f"{indent}if n + hv > 0:", f"{indent}    {s.strip()}"]
            continue
        out.append(s)
        out += inserts.get(i, [])
    stamp = STAMP_FN.format(n_chunks=stamped_chunks(spec), n_markers=len(spec["anchors"]), warps=spec.get("warps", 8))
    return "\n".join(out) + stamp


def load_patched(op: str, module: str | None = None):
    root = Path(__file__).resolve().parent.parent
    spec = OPS[op]
    src = patched_source(spec, root, module)
    # the DSL reads a kernel's source from its file: the patched module is a real file
    name = f"_cula_profiled_{op}"
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(src)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
    sys.modules[name] = module
    module.__spec__.loader.exec_module(module)
    if "hook" in spec:
        installed = importlib.import_module(spec["module"].removesuffix(".py").replace("/", "."))
        setattr(installed, spec["hook"], getattr(module, spec["hook"]))
        module = importlib.import_module(spec["entry_module"])
    return module, spec


def inputs(op: str, B: int, T: int, H: int, D: int = 128):
    dev = "cuda"
    q = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).bfloat16()
    v = torch.randn(B, T, H, D, device=dev).bfloat16()
    gate_shape = (B, T, H, D) if op == "kda" else (B, T, H)  # gdn, gdn_roles: one gate per head
    g = (torch.nn.functional.logsigmoid(torch.randn(gate_shape, device=dev) + 3) / 2).clamp(min=-5)
    beta = torch.rand(B, T, H, device=dev).sigmoid()
    return q, k, v, g.float(), beta.float()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="gdn", choices=sorted(OPS))
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--H", type=int, default=64)
    p.add_argument("--out", default=None)
    p.add_argument("--gate-in-kernel", action="store_true", help="kda: a raw bf16 gate, activated by the kernel")
    p.add_argument("--module", default=None, help="a variant of the op's module (same anchors), path from the root")
    a = p.parse_args()
    module, spec = load_patched(a.op, a.module)
    entry = getattr(module, spec["entry"])
    args = inputs(a.op, a.B, a.T, a.H)
    options = {}
    if a.gate_in_kernel:
        args = (*args[:3], torch.randn_like(args[3]).bfloat16(), args[4])
        options["gate"] = (None, None, -5.0)
    n_chunks = math.ceil(a.T / 64)
    N = stamped_chunks(spec)
    assert n_chunks >= N, f"the sequence must have at least {N} chunks"

    ht0 = torch.zeros(args[0].shape[0], args[2].shape[2], args[0].shape[3], args[2].shape[3], device="cuda")

    def run():  # into zeros: the stamped CTA does not store its state, and the markers a warp skips stay 0
        return entry(*args, scale=None, output_final_state=True, split=False, final_state_out=ht0, **options)

    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        _, ht = run()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / 5
    names = [n for n, _, _ in spec["anchors"]]
    M, W = len(names), spec.get("warps", 8)
    t = ht[0, 0].flatten()[: N * M * W].double().view(N, M, W).cpu()
    report = {"op": a.op, "shape": [a.B, a.T, a.H], "kernel_ms": ms, "us_per_chunk_wall": ms * 1e3 / n_chunks}
    print(f"{a.op} B{a.B} T{a.T} H{a.H}: {ms:.3f} ms, {report['us_per_chunk_wall']:.2f} us per chunk")
    # per warp, the anchors it passed; segment m: from its previous anchor (the previous chunk's last for its first)
    warps = {}
    for w in range(W):
        mine = [m for m in range(M) if bool((t[1:, m, w] > 0).all())]
        if not mine:
            continue
        tw = t[:, mine, w]
        prev = torch.cat([tw[:-1, -1:], tw[1:, :-1]], dim=1)
        seg = (tw[1:] - prev)[3:].mean(0)
        warps[w] = {
            "cycles_per_chunk": (tw[4:, -1] - tw[3:-1, -1]).mean().item(),
            "segments": {names[m]: round(seg[k].item(), 1) for k, m in enumerate(mine)},
        }
    report["warps"] = warps
    for n in names:
        row = [f"{w}:{v['segments'][n]:.0f}" for w, v in warps.items() if n in v["segments"]]
        print(f"  {n:34s} " + " ".join(row))
    print("  cycles per chunk " + " ".join(f"{w}:{v['cycles_per_chunk']:.0f}" for w, v in warps.items()))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
