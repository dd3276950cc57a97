"""Time the SM90 backwards pass by pass, beside FLA's forward + backward, in one process on a GPU: the data behind
PERF.md's backward rows.

    python tools/backward_pass_times.py [--op simple_gla|gdn|gla|kda] [--shapes 1x8192x64,2x16384x64]
        [--gate g|g_gamma] [--skip-passes] [--walks-only] [--skip-fla] [--profile FILE] [--host-profile FILE]

For each B x T x H shape (D = 128, bf16, H = HV) it prints, as medians of CUDA-event timings over 10 calls: the two
state walks, the per-chunk passes in PyTorch (``rows_backward``, KDA's with its bounded gate) and by their kernels
(``CULA_CHUNK_GRADIENT_KERNEL``, ``CULA_DELTA_GRADIENT_KERNEL``, ``CULA_KEY_GRADIENT_KERNEL``,
``CULA_KDA_GRADIENT_KERNEL``), each kernel element by element (``CULA_GRADIENT_TILE_COPIES=0``, "per-chunk, kernel")
and with tile copies (``=1``); then the whole forward + backward through the public op served by cuLA
(``CULA_BACKEND=cute CULA_UNTESTED_KERNELS=1``, with those kernels) and by FLA (where FLA runs it; its first call
autotunes).
"""

import argparse
import contextlib
import json
import os
import statistics


def median_ms(fn, reps: int = 10) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def report(label: str, value):
    """Prints one measurement as soon as it is taken (a run cut short still tells what it had), and returns it."""
    print(f"  {label}: {value}", flush=True)
    return value


def inputs(op: str, B: int, T: int, H: int, gate: str):
    import torch
    import torch.nn.functional as F

    D = 128
    q = torch.randn(B, T, H, D, device="cuda").bfloat16()
    k = F.normalize(torch.randn(B, T, H, D, device="cuda"), dim=-1).bfloat16()
    v, do = (torch.randn(B, T, H, D, device="cuda").bfloat16() for _ in range(2))
    args = {"q": q, "k": k, "v": v}
    if op == "gdn":
        args["g"] = F.logsigmoid(torch.randn(B, T, H, device="cuda") + 3.0)
        args["beta"] = torch.rand(B, T, H, device="cuda")
    elif op == "kda":  # activated, within safe_gate's bound
        args["g"] = F.logsigmoid(torch.randn(B, T, H, D, device="cuda") + 3.0).clamp_min(-5.0)
        args["beta"] = torch.rand(B, T, H, device="cuda")
    elif op == "gla":
        args["g"] = F.logsigmoid(torch.randn(B, T, H, D, device="cuda") + 3.0)
    elif gate == "g":
        args["g"] = F.logsigmoid(torch.randn(B, T, H, device="cuda") + 3.0)
    else:
        args["g_gamma"] = -torch.rand(H, device="cuda") * 0.2
    return args, do


def entry_point(op: str):
    """The public op of ``op`` (KDA's with ``safe_gate``, which its kernel needs)."""
    import functools

    import cula

    ops = {
        "gdn": cula.gdn.chunk_gated_delta_rule,
        "gla": cula.gla.chunk_gla,
        "kda": functools.partial(cula.kda.chunk_kda, safe_gate=True, lower_bound=-5.0),
    }
    return ops.get(op, cula.lightning.chunk_simple_gla)


def walk_operands(op: str, args: dict) -> tuple:
    """``(kernel, g, beta, rows_beta)``: the SM90 chunk kernel whose walks the backward of ``op`` runs, the gate and
    beta as it takes them, and the beta :func:`cula.ops.chunk_backward.rows_backward` reads (None without the delta
    rule)."""
    import torch

    v = args["v"]
    if op == "gdn":
        from cula.gdn.chunk_fwd_sm90 import GDN_SM90 as kernel

        return kernel, args["g"], args["beta"], args["beta"]
    if op == "kda":
        from cula.kda.chunk_fwd_sm90 import KDA_SM90 as kernel

        return kernel, args["g"], args["beta"], args["beta"]
    if op == "gla":
        from cula.gla.chunk_fwd_sm90 import GLA_SM90 as kernel

        beta = torch.empty(v.shape[:3], dtype=torch.float32, device=v.device)  # the kernel's unread beta slot
        return kernel, args["g"], beta, None
    from cula.lightning.chunk_fwd_sm90 import SIMPLE_GLA_SM90 as kernel
    from cula.lightning.chunk_fwd_sm90 import token_gate

    gate = token_gate(args.get("g"), args.get("g_gamma"), v)
    return kernel, gate, gate, None  # beta's slot carries the gate


def passes(op: str, args: dict, do, walks_only: bool = False) -> dict:
    """The backward's passes alone on ``args`` (``walks_only``: the two walks, each alone and both side by side)."""
    from cula.ops import chunk_backward
    from cula.sm90 import walks

    q, k, v = args["q"], args["k"], args["v"]
    scale = q.shape[3] ** -0.5
    kernel, g, beta, rows_beta = walk_operands(op, args)
    w = walks.both_walks(kernel, q, k, v, do, g, beta, scale, None, None, None, None, False)
    inputs = walks.walk_inputs(kernel, q, k, v, do)
    times = {}
    for name in ("states", "state_grads"):
        times[f"walk {name}"] = report(
            f"walk {name}",
            median_ms(
                lambda name=name: walks.state_walk(
                    kernel, name, *inputs[name], g, beta, scale, None, None, w.index.shape[0], False
                )
            ),
        )
    if walks_only:

        def both():
            return walks.both_walks(kernel, q, k, v, do, g, beta, scale, None, None, None, None, False)

        times["walks side by side"] = report("walks side by side", median_ms(both))
        return times
    times["per-chunk, PyTorch"] = report(
        "per-chunk, PyTorch",
        median_ms(
            lambda: chunk_backward.rows_backward(
                q, k, v, do, g, rows_beta, w.starts, w.ends, w.index, scale, bounded_gate=op == "kda"
            ),
            reps=3,
        ),
    )
    kernel_pass = per_chunk_kernel(op, q, k, v, do, g, beta, w, scale)
    variants = (("0", "per-chunk, kernel"), ("1", "per-chunk, kernel with tile copies"))
    for copies, label in variants:
        with environment(CULA_GRADIENT_TILE_COPIES=copies):  # read per call (scalar_chunk_bwd.tile_copies)
            times[label] = report(label, median_ms(kernel_pass))
    return times


def per_chunk_kernel(op: str, q, k, v, do, g, beta, w, scale):
    """Passes 3 and 4 by ``op``'s per-chunk kernel on the walks ``w`` (a call without arguments)."""
    if op == "simple_gla":
        from cula.lightning.chunk_bwd_sm90 import chunk_gradients_sm90

        return lambda: chunk_gradients_sm90(q, k, v, do, g, w.starts, w.ends, w.chunks, scale, False)
    if op == "gdn":
        from cula.gdn.chunk_bwd_sm90 import delta_chunk_gradients_sm90

        return lambda: delta_chunk_gradients_sm90(q, k, v, do, g, beta, w.starts, w.ends, w.chunks, scale, False)
    if op == "gla":
        from cula.gla.chunk_bwd_sm90 import key_chunk_gradients_sm90

        return lambda: key_chunk_gradients_sm90(q, k, v, do, g, w.starts, w.ends, w.chunks, scale, False)
    from cula.kda.chunk_bwd_sm90 import key_delta_chunk_gradients_sm90

    return lambda: key_delta_chunk_gradients_sm90(q, k, v, do, g, beta, w.starts, w.ends, w.chunks, scale, False)


@contextlib.contextmanager
def environment(**values: str):
    """The environment variables ``values`` set while the block runs, then restored."""
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def training_step(fn, args: dict, do, backend: str):
    """One forward + backward through the public op ``fn`` (its floating tensor arguments leaves that require grad),
    served by ``backend`` (``CULA_BACKEND`` set while it runs)."""
    import torch

    leaves = {
        n: x.detach().requires_grad_() if torch.is_tensor(x) and x.is_floating_point() else x for n, x in args.items()
    }

    def step():
        with environment(CULA_BACKEND=backend):
            for leaf in leaves.values():  # as a training step after zero_grad(set_to_none=True): no accumulation
                if isinstance(leaf, torch.Tensor):
                    leaf.grad = None
            o, _ = fn(**leaves)
            o.backward(do)

    return step


def profile_table(step, path: str, title: str) -> None:
    """Appends to ``path`` the CUDA time per kernel and op of one ``step`` (after a warm-up), by torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with open(path, "a") as out:
        out.write(f"== {title}\n{prof.key_averages().table(sort_by='cuda_time_total', row_limit=40)}\n")


def host_profile(step, path: str, title: str, steps: int = 20) -> None:
    """Appends to ``path`` where the host's time goes in ``steps`` steps (cProfile, after a warm-up), and the wall
    time per step with the GPU synchronised only at the end: the Python and launch path, which the GPU waits on when
    it is longer than the kernels."""
    import cProfile
    import io
    import pstats
    import time

    import torch

    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e3
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(50)
    with open(path, "a") as out:
        out.write(f"== {title}: {wall:.3f} ms per step (host, unprofiled)\n{text.getvalue()}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=("simple_gla", "gdn", "gla", "kda"), default="simple_gla")
    parser.add_argument("--shapes", default="1x8192x64")
    parser.add_argument("--gate", choices=("g", "g_gamma"), default="g_gamma", help="simple GLA's gate")
    parser.add_argument("--skip-passes", action="store_true", help="only the whole step (no pass-by-pass timings)")
    parser.add_argument("--walks-only", action="store_true", help="only the state walks (alone and side by side)")
    parser.add_argument("--skip-fla", action="store_true", help="no FLA column (its first call autotunes for minutes)")
    parser.add_argument("--profile", metavar="FILE", help="also append a torch.profiler table of one cuLA step here")
    parser.add_argument("--host-profile", metavar="FILE", help="also append a cProfile of 20 cuLA steps here")
    opts = parser.parse_args()
    os.environ["CULA_UNTESTED_KERNELS"] = "1"
    for shape in opts.shapes.split(","):
        B, T, H = (int(x) for x in shape.split("x"))
        args, do = inputs(opts.op, B, T, H, opts.gate)
        print(f"{opts.op} {shape}", flush=True)
        if opts.walks_only:
            print(json.dumps({"op": opts.op, "shape": shape, **passes(opts.op, args, do, walks_only=True)}))
            continue
        row = {"op": opts.op, "shape": shape, **({} if opts.skip_passes else passes(opts.op, args, do))}
        os.environ["CULA_CHUNK_GRADIENT_KERNEL"] = "1" if opts.op == "simple_gla" else "0"
        os.environ["CULA_DELTA_GRADIENT_KERNEL"] = "1" if opts.op == "gdn" else "0"
        os.environ["CULA_KEY_GRADIENT_KERNEL"] = "1" if opts.op == "gla" else "0"
        os.environ["CULA_KDA_GRADIENT_KERNEL"] = "1" if opts.op == "kda" else "0"
        cula_step = training_step(entry_point(opts.op), args, do, "cute")
        row["cuLA forward + backward"] = report("cuLA forward + backward", median_ms(cula_step, reps=5))
        if opts.profile:
            profile_table(cula_step, opts.profile, f"{opts.op} {shape}: cuLA forward + backward")
        if opts.host_profile:
            host_profile(cula_step, opts.host_profile, f"{opts.op} {shape}: cuLA forward + backward")
        if not opts.skip_fla:
            try:
                fla = median_ms(training_step(entry_point(opts.op), args, do, "fla"), reps=5)
            except Exception as error:  # FLA refuses some backwards on some triton versions
                fla = f"{type(error).__name__}: {str(error)[:120]}"
            row["FLA forward + backward"] = report("FLA forward + backward", fla)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
