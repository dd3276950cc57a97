"""Every SM90 chunk kernel once on each awkward shape, through the public entry points with the kernel forced
(``CULA_BACKEND=cute``): the workload that ``scripts/gpu_check.sh`` runs under compute-sanitizer (``SANITIZE=1``).

    python scripts/sanitize_kernels.py [--list]

Shapes: odd lengths (1, 63, 65, 130), varlen with 0- and 1-token sequences, GVA, initial states, state_v_first,
D = 64 and 128, long sequences split across CTAs. Each call's outputs are checked finite; the sanitizer judges the
memory accesses. Prints one line per call and exits non-zero if an output was not finite.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (name, B, T, H, HV, D, varlen lengths or None, initial state, state_v_first)
SHAPES = [
    ("T=1", 1, 1, 2, 2, 128, None, False, False),
    ("T=63 GVA h0", 2, 63, 1, 2, 128, None, True, False),
    ("T=65 D=64", 2, 65, 2, 2, 64, None, True, True),
    ("T=130", 1, 130, 2, 2, 128, None, False, False),
    ("varlen 0,1,64,0,129,1", 1, None, 2, 4, 128, [0, 1, 64, 0, 129, 1], True, True),
    ("varlen D=64", 1, None, 2, 2, 64, [1, 0, 200, 65], True, False),
    ("split 2100+1+3000", 1, None, 1, 2, 128, [2100, 1, 3000], True, False),
]


def inputs(op: str, B, T, H, HV, D, lengths, h0, device):
    import torch
    import torch.nn.functional as F

    if lengths is not None:
        T = sum(lengths)
    args = {
        "q": F.normalize(torch.randn(B, T, H, D, device=device), dim=-1).bfloat16(),
        "k": F.normalize(torch.randn(B, T, H, D, device=device), dim=-1).bfloat16(),
        "v": torch.randn(B, T, HV, D, device=device).bfloat16(),
        "output_final_state": True,
    }
    if lengths is not None:
        cu = torch.tensor([0, *lengths], device=device).cumsum(0)
        args["cu_seqlens"] = cu
        args["cu_seqlens_cpu"] = cu.cpu()
    N = B if lengths is None else len(lengths)
    if op == "gdn":
        args["g"] = F.logsigmoid(torch.randn(B, T, HV, device=device) + 3.0)
        args["beta"] = torch.rand(B, T, HV, device=device)
    elif op == "kda":
        args["g"] = torch.rand(B, T, HV, D, device=device) * -5.0
        args["beta"] = torch.rand(B, T, HV, device=device)
        args.update(safe_gate=True, lower_bound=-5.0)
    else:  # simple GLA: one value head per q/k head
        args["v"] = torch.randn(B, T, H, D, device=device).bfloat16()
        args["g"] = F.logsigmoid(torch.randn(B, T, H, device=device) + 3.0)
        HV = H
    if h0:
        args["initial_state"] = torch.randn(N, HV, D, D, device=device) * 0.1
    return args


def calls(device: str):
    """``(op, shape name, entry point, keyword arguments)`` for every kernel and shape."""
    from benchmarks.run import entry_points

    for op in ("gdn", "kda", "simple_gla"):
        fn = entry_points(op)[0]
        for name, B, T, H, HV, D, lengths, h0, state_v_first in SHAPES:
            call = inputs(op, B, T, H, HV, D, lengths, h0, device)
            if state_v_first:
                call["state_v_first"] = True
                if h0:
                    call["initial_state"] = call["initial_state"].transpose(-1, -2).contiguous()
            yield op, name, fn, call


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the shapes and exit")
    args = parser.parse_args()
    if args.list:
        for shape in SHAPES:
            print(shape[0])
        return 0

    import torch

    os.environ["CULA_BACKEND"] = "cute"
    bad = 0
    for op, name, fn, call in calls("cuda"):
        o, ht = fn(**call)
        torch.cuda.synchronize()
        finite = bool(torch.isfinite(o).all()) and bool(torch.isfinite(ht).all())
        bad += not finite
        print(f"{op:<10} {name:<24} {'finite' if finite else 'NOT FINITE'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
