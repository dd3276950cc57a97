"""What a training call's forward keeps for its backward, in bytes per token and head, cuLA's backends beside FLA's,
on a GPU.

    python tools/saved_for_backward.py [--op simple_gla gla gdn kda] [--shape 1x8192x64] [--backends cute fla torch]

Each op runs once per backend (``CULA_BACKEND``; ``CULA_UNTESTED_KERNELS=1`` for cuLA's opt-in backwards) on bf16
inputs that require grad (D = 128, H = HV), under ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd
saves is counted once per storage, except the call's own inputs (the model holds those anyway). A backend that cannot
serve the call is reported as such. On a CPU only the reference backend runs: its figure is the reference's, not a
kernel's.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def saved_bytes(fn, inputs: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves while ``fn()`` runs, the storages of ``inputs`` excepted."""
    own = {t.untyped_storage().data_ptr() for t in inputs.values() if isinstance(t, torch.Tensor)}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def make_inputs(op: str, B: int, T: int, H: int, device: str) -> dict[str, torch.Tensor]:
    """Seeded bf16 inputs of ``op`` that require grad (fp32 gates, as layers pass them)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    D = 128

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    q, k, v = (randn(B, T, H, D).bfloat16() for _ in range(3))
    args = {"q": q, "k": torch.nn.functional.normalize(k.float(), dim=-1).bfloat16(), "v": v}
    if op in ("gla", "kda"):  # KDA's within safe_gate's bound, which its kernel needs
        args["g"] = torch.nn.functional.logsigmoid(randn(B, T, H, D) + 3.0).clamp_min(-5.0)
    else:
        args["g"] = torch.nn.functional.logsigmoid(randn(B, T, H) + 3.0)
    if op in ("gdn", "kda"):
        args["beta"] = torch.rand(B, T, H, generator=gen).to(device)
    for t in args.values():
        t.requires_grad_(True)
    return args


def measure(op: str, B: int, T: int, H: int, backend: str, device: str) -> dict:
    """One op on one backend: ``{"bytes_per_token_head": ..., "served_by": ...}`` or ``{"error": ...}``."""
    from backward_pass_times import entry_point  # (this script's folder is first on sys.path)

    import cula

    fn = entry_point(op)
    args = make_inputs(op, B, T, H, device)
    os.environ["CULA_BACKEND"] = backend
    try:
        total = saved_bytes(lambda: fn(**args, output_final_state=True)[0], args)
    except Exception as error:  # noqa: BLE001 - a backend that cannot serve the call is a result here
        return {"error": f"{type(error).__name__}: {error}".splitlines()[0][:200]}
    finally:
        os.environ.pop("CULA_BACKEND", None)
    decision = cula.last_decision(getattr(fn, "func", fn))  # (KDA's entry point with its options bound)
    return {"bytes_per_token_head": total / (B * T * H), "served_by": str(decision.reason if decision else "")}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", nargs="+", default=["simple_gla", "gla", "gdn", "kda"])
    parser.add_argument("--shape", default="1x8192x64", help="B x T x H")
    parser.add_argument("--backends", nargs="+", default=["cute", "fla", "torch"])
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    B, T, H = (int(x) for x in args.shape.split("x"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ.setdefault("CULA_UNTESTED_KERNELS", "1")
    results = {}
    print(f"saved for backward, bytes per token and head (B={B} T={T} H={H} D=128 bf16, {device})")
    for op in args.op:
        for backend in args.backends if device == "cuda" else ["torch"]:
            result = measure(op, B, T, H, backend, device)
            results[f"{op}/{backend}"] = result
            figure = result.get("bytes_per_token_head")
            shown = f"{figure:10.1f}" if figure is not None else f"   -- {result['error']}"
            print(f"{op:11s} {backend:6s} {shown}  {result.get('served_by', '')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
