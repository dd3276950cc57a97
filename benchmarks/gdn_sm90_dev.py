"""Correctness + timing of the SM90 GDN forward (cula.gdn.chunk_fwd_sm90) on one GPU.

python benchmarks/gdn_sm90_dev.py [--fla] [--out DIR]: relative RMSE against the project's fp32 chunked reference
at a mid-size shape, then triton do_bench medians at the issue's shapes (FLA side by side with --fla; FLA
autotunes on first use of each shape).
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
import triton

from cula.gdn.chunk_fwd_sm90 import chunk_gated_delta_rule_fwd_sm90

SHAPES = [(2, 16384, 64), (1, 8192, 64), (8, 2048, 32)]


def inputs(B, T, H, D=128, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, D, device="cuda", generator=gen), dim=-1).bfloat16()
    k = F.normalize(torch.randn(B, T, H, D, device="cuda", generator=gen), dim=-1).bfloat16()
    v = torch.randn(B, T, H, D, device="cuda", generator=gen).bfloat16()
    g = (F.logsigmoid(torch.randn(B, T, H, device="cuda", generator=gen) + 3.0) * 0.5).float()
    beta = torch.rand(B, T, H, device="cuda", generator=gen).sigmoid()
    return q, k, v, g, beta


def chunk_reference(q, k, v, g, beta, scale, C=64):
    """fp32 chunked GDN (per sequence and head), for shapes too long for a per-token loop."""
    B, T, H, D = q.shape
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    g, beta = g.transpose(1, 2), beta.float().transpose(1, 2)
    S = torch.zeros(B, H, D, D, device=q.device)
    o = torch.empty_like(v)
    tri = torch.ones(C, C, device=q.device, dtype=torch.bool).tril()
    for t0 in range(0, T, C):
        sl = slice(t0, min(t0 + C, T))
        qc, kc, vc, gc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl].cumsum(-1), beta[:, :, sl]
        n = qc.shape[2]
        decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~tri[:n, :n], float("-inf")).exp()
        A = (bc[..., None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        Tinv = torch.linalg.solve_triangular(
            torch.eye(n, device=q.device) + A, torch.eye(n, device=q.device), upper=False
        )
        vnew = Tinv @ (bc[..., None] * (vc - (kc * gc[..., None].exp()) @ S))
        o[:, :, sl] = scale * ((qc * gc[..., None].exp()) @ S + ((qc @ kc.transpose(-1, -2)) * decay) @ vnew)
        S = (
            gc[..., -1, None, None].exp() * S
            + (kc * (gc[..., -1:, None] - gc[..., None]).exp()).transpose(-1, -2) @ vnew
        )
    return o.transpose(1, 2), S


def bench(B, T, H, scale, with_fla):
    q, k, v, g, beta = inputs(B, T, H)
    t = time.time()
    chunk_gated_delta_rule_fwd_sm90(q, k, v, g, beta, scale, None, True)
    torch.cuda.synchronize()
    entry = {"first_call_s": time.time() - t}
    entry["cula_ms"] = triton.testing.do_bench(
        lambda: chunk_gated_delta_rule_fwd_sm90(q, k, v, g, beta, scale, None, True), return_mode="median"
    )
    if with_fla:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        entry["fla_ms"] = triton.testing.do_bench(
            lambda: chunk_gated_delta_rule(q, k, v, g, beta, scale, output_final_state=True), return_mode="median"
        )
    return entry


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fla", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--once", help="B,T,H: two plain calls at one shape (for a profiler), nothing else")
    args = ap.parse_args()
    if args.once:
        B, T, H = (int(x) for x in args.once.split(","))
        q, k, v, g, beta = inputs(B, T, H)
        for _ in range(2):
            chunk_gated_delta_rule_fwd_sm90(q, k, v, g, beta, 128**-0.5, None, True)
        torch.cuda.synchronize()
        return
    res = {"device": torch.cuda.get_device_name()}

    q, k, v, g, beta = inputs(2, 4096, 8)
    scale = 128**-0.5
    o_ref, s_ref = chunk_reference(q, k, v, g, beta, scale)
    o, s = chunk_gated_delta_rule_fwd_sm90(q, k, v, g, beta, scale, None, True)
    res["rel_rmse_B2_T4096_H8"] = {
        "o": ((o.float() - o_ref).norm() / o_ref.norm()).item(),
        "state": ((s - s_ref).norm() / s_ref.norm()).item(),
    }
    print(res, flush=True)

    # FLA last: it autotunes for minutes on the first call at a new shape
    for i, (B, T, H) in enumerate(SHAPES + (SHAPES[:1] if args.fla else [])):
        entry = bench(B, T, H, scale, i == len(SHAPES))
        res[f"B{B}_T{T}_H{H}" + ("_with_fla" if i == len(SHAPES) else "")] = entry
        print(f"B{B} T{T} H{H}: {entry}", flush=True)
        with open(os.path.join(args.out, "gdn_sm90_dev.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
