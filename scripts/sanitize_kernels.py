"""Every SM90 chunk kernel once on each awkward shape, through the public entry points with the kernel forced
(``CULA_BACKEND=cute``): the workload that ``scripts/gpu_check.sh`` runs under compute-sanitizer (``SANITIZE=1``).
The backwards too (ops ``<variant>_train``: forward and backward, the kernels' state walks and, with
``_train_kernel``, the per-chunk gradient kernel), their gradients checked finite.

    python scripts/sanitize_kernels.py [--list] [--op gla gla_decode ...] [--shape "T=1" "varlen D=64" ...]

Shapes: odd lengths (1, 63, 65, 130), varlen with 0- and 1-token sequences, GVA, initial states, state_v_first,
D = 64 and 128, long sequences split across CTAs; and the token-by-token kernel on pools (padding, verify slots),
varlen and both state layouts. Each call's outputs are checked finite; the sanitizer judges the
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
    elif op == "gla":  # one value head per q/k head, a per-key gate with a reset (the direct scores) mid-call
        args["v"] = torch.randn(B, T, H, D, device=device).bfloat16()
        args["g"] = F.logsigmoid(torch.randn(B, T, H, D, device=device) + 3.0)
        args["g"][:, T // 2] = float("-inf")
        HV = H
    else:  # simple GLA: one value head per q/k head
        args["v"] = torch.randn(B, T, H, D, device=device).bfloat16()
        args["g"] = F.logsigmoid(torch.randn(B, T, H, device=device) + 3.0)
        HV = H
    if h0:
        args["initial_state"] = torch.randn(N, HV, D, D, device=device) * 0.1
    return args


def calls(device: str):
    """``(op, shape name, entry point, keyword arguments)`` for every kernel and shape: the chunk kernels on
    :data:`SHAPES`, then the token-by-token kernel (:func:`decode_calls`)."""
    from benchmarks.run import entry_points

    for op in ("gdn", "kda", "simple_gla", "gla"):
        fn = entry_points(op)[0]
        for name, call in shape_calls(op, device):
            yield op, name, fn, call
    yield from decode_calls(device)
    yield from training_calls(device)


def shape_calls(op: str, device: str, whole: bool = False):
    """``(shape name, keyword arguments)`` of ``op`` on each of :data:`SHAPES` (``whole``: but the split one)."""
    for name, B, T, H, HV, D, lengths, h0, state_v_first in SHAPES:
        if whole and name.startswith("split"):
            continue
        call = inputs(op, B, T, H, HV, D, lengths, h0, device)
        if state_v_first:
            call["state_v_first"] = True
            if h0:
                call["initial_state"] = call["initial_state"].transpose(-1, -2).contiguous()
        yield name, call


# the backwards' calls (op name -> the chunk op and the environment its backward runs under): GDN, simple GLA, GLA
# and KDA (their per-chunk passes in PyTorch, or by their kernels)
TRAINING = {
    "gdn_train": ("gdn", {"CULA_DELTA_GRADIENT_KERNEL": "0"}),
    "gdn_train_kernel": ("gdn", {"CULA_DELTA_GRADIENT_KERNEL": "1"}),
    "simple_gla_train": ("simple_gla", {"CULA_CHUNK_GRADIENT_KERNEL": "0"}),
    "simple_gla_train_kernel": ("simple_gla", {"CULA_CHUNK_GRADIENT_KERNEL": "1"}),
    "gla_train": ("gla", {"CULA_KEY_GRADIENT_KERNEL": "0"}),
    "gla_train_kernel": ("gla", {"CULA_KEY_GRADIENT_KERNEL": "1"}),
    "kda_train": ("kda", {"CULA_KDA_GRADIENT_KERNEL": "0"}),
    "kda_train_kernel": ("kda", {"CULA_KDA_GRADIENT_KERNEL": "1"}),
}


def training_calls(device: str):
    """The chunk backwards (:data:`TRAINING`) on :data:`SHAPES` but the split one (the walks run each sequence
    whole); :func:`train_step` runs them."""
    from benchmarks.run import entry_points

    for label, (op, _) in TRAINING.items():
        fn = entry_points(op)[0]
        for name, call in shape_calls(op, device, whole=True):
            yield label, name, fn, call


def train_step(label: str, fn, call):
    """Forward and backward of a :func:`training_calls` call: ``(every gradient concatenated, the final state)``."""
    import torch

    os.environ.update(TRAINING[label][1])
    leaves = [x.requires_grad_() for x in call.values() if isinstance(x, torch.Tensor) and x.is_floating_point()]
    o, ht = fn(**call)
    torch.autograd.backward([o, ht], [torch.randn_like(o), torch.randn_like(ht)])
    return torch.cat([x.grad.float().flatten() for x in leaves]), ht.detach()


def decode_calls(device: str):
    """The fused-recurrent entry points on the token-by-token kernel: a bf16 pool with padding, a verify with
    per-token slots and accepted counts (KDA's gate in the kernel), varlen with 0- and 1-token sequences and V-first
    states (GLA), D = 64 (Lightning)."""
    import torch
    import torch.nn.functional as F

    import cula

    def qkv(B, T, H, HV, D):
        return {
            "q": torch.randn(B, T, H, D, device=device).bfloat16(),
            "k": F.normalize(torch.randn(B, T, H, D, device=device), dim=-1).bfloat16(),
            "v": torch.randn(B, T, HV, D, device=device).bfloat16(),
        }

    x = qkv(4, 1, 2, 4, 128)
    pool = (torch.randn(6, 4, 128, 128, device=device) * 0.1).bfloat16()
    idx = torch.tensor([3, -1, 0, 5], dtype=torch.int32, device=device)
    x.update(g=F.logsigmoid(torch.randn(4, 1, 4, device=device)), beta=torch.rand(4, 1, 4, device=device))
    yield "gdn_decode", "bf16 pool, padding", cula.gdn.fused_recurrent_gated_delta_rule, {
        **x, "initial_state": pool, "ssm_state_indices": idx, "use_qk_l2norm_in_kernel": True,
    }  # fmt: skip
    x = qkv(2, 3, 2, 4, 128)
    x.update(g=torch.randn(2, 3, 4, 128, device=device).bfloat16(), beta=torch.rand(2, 3, 4, device=device))
    yield "kda_decode", "verify, gate in kernel", cula.kda.fused_recurrent_kda, {
        **x, "initial_state": torch.randn(6, 4, 128, 128, device=device) * 0.1,
        "ssm_state_indices": torch.tensor([[0, 1, 2], [3, -1, 4]], device=device),
        "num_accepted_tokens": torch.tensor([1, 2], device=device), "use_gate_in_kernel": True,
        "A_log": torch.zeros(4, device=device), "lower_bound": -5.0,
    }  # fmt: skip
    lengths = [1, 0, 3]
    x = qkv(1, 4, 2, 2, 128)
    x.update(
        gk=F.logsigmoid(torch.randn(1, 4, 2, 128, device=device)),
        gv=F.logsigmoid(torch.randn(1, 4, 2, 128, device=device)),
    )
    yield "gla_decode", "varlen 1,0,3, V-first", cula.gla.fused_recurrent_gla, {
        **x, "cu_seqlens": torch.tensor([0, *lengths], device=device).cumsum(0),
        "initial_state": torch.randn(3, 2, 128, 128, device=device) * 0.1, "state_v_first": True,
        "output_final_state": True,
    }  # fmt: skip
    yield "lightning_decode", "D=64", cula.lightning.fused_recurrent_lightning_attn, {
        **qkv(2, 2, 2, 2, 64), "layer_idx": 1, "num_layers": 4, "output_final_state": True,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the shapes and exit")
    parser.add_argument(
        "--op", nargs="+", help="only these kernels' calls (gdn, kda, simple_gla, gla, gdn_decode, gdn_train, ...)"
    )
    parser.add_argument("--shape", nargs="+", help="only the calls of these shapes (names as --list prints them)")
    args = parser.parse_args()
    if args.list:
        for shape in SHAPES:
            print(shape[0])
        return 0

    import torch

    os.environ["CULA_BACKEND"] = "cute"
    os.environ["CULA_UNTESTED_KERNELS"] = "1"  # a kernel not yet run on this architecture too
    bad = 0
    for op, name, fn, call in calls("cuda"):
        if (args.op and op not in args.op) or (args.shape and name not in args.shape):
            continue
        o, ht = train_step(op, fn, call) if op in TRAINING else fn(**call)
        torch.cuda.synchronize()
        finite = bool(torch.isfinite(o).all()) and bool(torch.isfinite(ht.float()).all())
        bad += not finite
        print(f"{op:<22} {name:<24} {'finite' if finite else 'NOT FINITE'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
