"""Decode: cuLA's token-by-token kernel against FLA's fused-recurrent ops, side by side in one run (GPU).

    python -m benchmarks.decode --out DIR [--variants gdn kda] [--n 1 32 256] [--heads 32] [--dim 128]

One token per sequence, H = HV heads, q/k L2-normalised in the op, bf16 inputs. Each row times one call shape:

- ``plain``: ``initial_state`` [N, HV, K, V] fp32 in, the fp32 final state out (what FLA's public ops take), on
  both sides;
- ``pool fp32`` / ``pool bf16``: cuLA with a state pool of N slots read and written back in place by index;
- ``flashinfer fp32`` / ``flashinfer bf16`` (GDN): FlashInfer's decode contract on both sides, FlashInfer's
  ``gated_delta_rule_decode_pretranspose`` and cuLA's kernel: a V-first pool [N, HV, V, K] updated in place by
  index, the gate (A_log, a, dt_bias) and beta (sigmoid of b) in the op (:class:`benchmarks.peers.FlashInferGDNDecode`;
  where FlashInfer's decode is not importable the row has cuLA's side only).

Per side: the eager call through its Python function (triton ``do_bench`` median, host time included) and the
same call replayed from a CUDA graph; the state traffic (bytes read + written) per graph-replayed time; the output's
relative RMSE against the peer's (FLA's, or FlashInfer's) where both ran. Writes ``decode.json`` and ``decode.md``
into DIR.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.peers import FlashInferGDNDecode
from benchmarks.run import bench, environment, rel_rmse


def inputs(variant: str, N: int, H: int, D: int, seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    args = {
        "q": rnd(N, 1, H, D).bfloat16(),
        "k": rnd(N, 1, H, D).bfloat16(),
        "v": rnd(N, 1, H, D).bfloat16(),
        "beta": torch.rand(N, 1, H, device="cuda", generator=gen).bfloat16(),
        "use_qk_l2norm_in_kernel": True,
    }
    if variant == "gdn":
        args["g"] = F.logsigmoid(rnd(N, 1, H) + 3)
    else:
        args["g"] = F.logsigmoid(rnd(N, 1, H, D) + 3)
    return args


def functions(variant: str):
    import fla.ops.gated_delta_rule as fla_gdn
    import fla.ops.kda as fla_kda

    import cula

    if variant == "gdn":
        return cula.gdn.fused_recurrent_gated_delta_rule, fla_gdn.fused_recurrent_gated_delta_rule
    return cula.kda.fused_recurrent_kda, fla_kda.fused_recurrent_kda


def graph_ms(call) -> float | None:
    """Median GPU time of ``call`` replayed from a CUDA graph (None if it cannot be captured)."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        torch.cuda.synchronize()
        return bench(graph.replay)[1]
    except Exception as error:  # reported in the row, not fatal
        print(f"  graph capture failed: {type(error).__name__}: {error}")
        return None


def gated_inputs(N: int, H: int, D: int, seed: int = 0) -> dict:
    """FlashInfer's decode inputs: q, k, v [N, 1, H, D] bf16, the raw gate a and beta's b [N, 1, H] bf16, A_log and
    dt_bias [H] fp32."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    gate = {n: rnd(N, 1, H, D).bfloat16() for n in ("q", "k", "v")}
    gate.update(a=rnd(N, 1, H).bfloat16(), b=rnd(N, 1, H).bfloat16(), A_log=rnd(H) * 0.5, dt_bias=rnd(H))
    return gate


def run_row(variant: str, N: int, H: int, D: int, kind: str) -> dict:
    cula_fn, fla_fn = functions(variant)
    args = inputs(variant, N, H, D)
    state_dtype = torch.bfloat16 if kind.endswith("bf16") else torch.float32
    h0 = (torch.randn(N, H, D, D, device="cuda") * 0.1).to(state_dtype)
    state_bytes = N * H * D * D * h0.element_size()
    row = {"variant": variant, "N": N, "H": H, "D": D, "call": kind}
    peer = "fla"
    if kind.startswith("flashinfer"):
        traffic = 2 * state_bytes
        gate = gated_inputs(N, H, D)
        slots = torch.arange(N, dtype=torch.int32, device="cuda")
        pool_cula, pool_fi = h0.clone(), h0.clone()
        cula_args = FlashInferGDNDecode.cula_arguments(gate, pool_cula, slots)

        def cula_call():
            return cula_fn(**cula_args)

        fi = FlashInferGDNDecode.load()
        peer_call = None
        peer = "flashinfer"
        if fi is None:
            row["note"] = "FlashInfer's decode not importable (tools/flashinfer_decode_kit.py adds it to the kit)"
        elif fi.declines(gate["q"], pool_fi):
            row["note"] = fi.declines(gate["q"], pool_fi)
        else:

            def peer_call():
                return (fi.call(gate, pool_fi, slots),)

    elif kind == "plain":
        traffic = state_bytes + N * H * D * D * 4

        def cula_call():
            return cula_fn(**args, initial_state=h0, output_final_state=True)

        def peer_call():
            return fla_fn(**args, initial_state=h0, output_final_state=True)

    else:
        traffic = 2 * state_bytes
        pool = h0.clone()
        slots = torch.arange(N, dtype=torch.int32, device="cuda")

        def cula_call():
            return cula_fn(**args, initial_state=pool, ssm_state_indices=slots)

        peer_call = None
    os.environ["CULA_BACKEND"] = "cute"
    o_cula = cula_call()[0].clone()
    row["cula_eager_ms"] = bench(cula_call)[1]
    row["cula_graph_ms"] = graph_ms(cula_call)
    if peer_call is not None:
        o_peer = peer_call()[0]
        row[f"{peer}_eager_ms"] = bench(peer_call)[1]
        row[f"{peer}_graph_ms"] = graph_ms(peer_call)
        row[f"o_rel_rmse_vs_{peer}"] = rel_rmse(o_cula, o_peer)
    best = row["cula_graph_ms"] or row["cula_eager_ms"]
    row["cula_state_TBps"] = traffic / (best * 1e-3) / 1e12
    print(json.dumps(row), flush=True)
    return row


def markdown(env: dict, rows: list[dict]) -> str:
    def f(x, d=3):
        return "-" if x is None else f"{x:.{d}f}"

    lines = [
        f"Decode, one token per sequence, bf16 inputs ({env.get('gpu', '?')}; FLA {env.get('fla')}, "
        f"cutlass-dsl {env.get('cutlass')}, torch {env.get('torch')})",
        "",
        "The peer is FLA's op, or FlashInfer's decode on the `flashinfer` rows (its contract on both sides).",
        "",
        "| variant | N | H | call | cuLA eager ms | cuLA graph ms | peer eager ms | peer graph ms | graph speedup | "
        "cuLA state TB/s | o rel RMSE vs peer | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peer = "flashinfer" if r["call"].startswith("flashinfer") else "fla"
        speedup = None
        if r.get(f"{peer}_graph_ms") and r.get("cula_graph_ms"):
            speedup = r[f"{peer}_graph_ms"] / r["cula_graph_ms"]
        lines.append(
            f"| {r['variant']} | {r['N']} | {r['H']} | {r['call']} | {f(r['cula_eager_ms'])} | "
            f"{f(r['cula_graph_ms'])} | {f(r.get(f'{peer}_eager_ms'))} | {f(r.get(f'{peer}_graph_ms'))} | "
            f"{f(speedup, 2)} | {f(r['cula_state_TBps'], 2)} | {f(r.get(f'o_rel_rmse_vs_{peer}'), 5)} | "
            f"{r.get('note', '')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", nargs="+", default=["gdn", "kda"], choices=["gdn", "kda"])
    parser.add_argument("--n", nargs="+", type=int, default=[1, 32, 256])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument(
        "--calls", nargs="+", default=["plain", "pool fp32", "pool bf16", "flashinfer fp32", "flashinfer bf16"]
    )
    a = parser.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    rows = [
        run_row(variant, N, a.heads, a.dim, kind)
        for variant in a.variants for N in a.n for kind in a.calls
        if variant == "gdn" or not kind.startswith("flashinfer")  # FlashInfer's decode is GDN's
    ]  # fmt: skip
    (out / "decode.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    (out / "decode.md").write_text(markdown(env, rows))
    print(markdown(env, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
