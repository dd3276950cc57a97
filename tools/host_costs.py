"""The host's time per call of a training step's parts, on a GPU: what the GPU waits on when the host is slower than
the kernels (a step at B1 T8192 H64 spends ~2.3 ms in kernels, PERF.md).

    python tools/host_costs.py [--op simple_gla|gdn|gla] [--shape 1x8192x64] [--calls 20]

Each part is called ``--calls`` times after a warm-up with no synchronisation in between, and the host's wall time
per call is printed (then the GPU is drained): the forward without and with autograd, the backward alone (on graphs
made beforehand), the whole step, and two of the backward's own steps (the chunk rows' index, both walks). The calls
are served by cuLA's kernels (``CULA_BACKEND=cute``, set here): dispatch would otherwise give FLA the training calls
whose backward it runs faster.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks, run as a script


def host_ms(fn, calls: int) -> float:
    """``fn``'s host time per call after a warm-up call (:func:`benchmarks.run.host_issue_ms`)."""
    from benchmarks.run import host_issue_ms

    fn()
    return host_issue_ms(fn, calls)


def main() -> None:
    import torch
    from backward_pass_times import entry_point, inputs, walk_operands

    from cula.dispatch import ENV_BACKEND
    from cula.ops import chunk_backward
    from cula.sm90 import walks

    os.environ[ENV_BACKEND] = "cute"  # read by dispatch at each call

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=("simple_gla", "gdn", "gla"), default="simple_gla")
    parser.add_argument("--shape", default="1x8192x64")
    parser.add_argument("--calls", type=int, default=20)
    opts = parser.parse_args()
    B, T, H = (int(x) for x in opts.shape.split("x"))
    args, do = inputs(opts.op, B, T, H, "g_gamma")
    fn = entry_point(opts.op)
    leaves = {n: x.detach().requires_grad_() if x.is_floating_point() else x for n, x in args.items()}
    costs = {}
    with torch.no_grad():
        costs["forward, no grad"] = host_ms(lambda: fn(**args), opts.calls)
    costs["forward, with autograd"] = host_ms(lambda: fn(**leaves), opts.calls)
    graphs = [fn(**leaves)[0] for _ in range(opts.calls + 1)]
    torch.cuda.synchronize()
    costs["backward alone"] = host_ms(lambda: graphs.pop().backward(do), opts.calls)
    graphs.clear()

    def step():
        for leaf in leaves.values():
            if isinstance(leaf, torch.Tensor):
                leaf.grad = None
        fn(**leaves)[0].backward(do)

    costs["forward + backward"] = host_ms(step, opts.calls)
    offsets = [b * T for b in range(B + 1)]
    costs["chunk rows' index"] = host_ms(lambda: chunk_backward.chunk_rows(offsets, True, "cuda"), opts.calls)
    kernel, g, beta, _ = walk_operands(opts.op, args)
    q, k, v = args["q"], args["k"], args["v"]
    scale = q.shape[3] ** -0.5
    costs["both walks"] = host_ms(
        lambda: walks.both_walks(kernel, q, k, v, do, g, beta, scale, None, None, None, None, False), opts.calls
    )
    for name, ms in costs.items():
        print(f"{opts.op} {opts.shape} host ms per call, {name}: {ms:.3f}", flush=True)


if __name__ == "__main__":
    main()
