"""Time each launch of a split SM90 chunk call with CUDA events: the data the split cost model is fitted to
(``KernelTime.split`` in cula/devices.py).

    python tools/split_pass_times.py [--op gdn|kda] [--l2norm] [--gate-in-kernel] [--shapes 1x65536x8,1x8192x64]
        [--seg CHUNKS]

For each B x T x H shape (D = 128, bf16) it prints the whole call (``triton.testing.do_bench``, split as the entry
plans it, or every ``--seg`` chunks), the same call unsplit, the model's estimate, and per launch of the split call
(medians over 20 calls): mode, CTAs, chunks walked by its longest CTA, ms and us per such chunk, by CUDA events around
the launch (which include the launch's host time when the stream is idle, as before a call's first launch) and by
the kernel's own duration (``torch.profiler``, the figures to fit the model to). What the launches do not cover
(the start chain, allocations, launch gaps) is the rest of the call.
"""

import argparse
import statistics


def per_launch(call, kernel_name: str, reps: int = 20) -> list[dict]:
    """Median time of each launch of ``call()`` (in launch order), recorded by wrapping
    :func:`cula.sm90.entry.launch` (``ms``), and of each launched kernel whose name holds ``kernel_name``
    (``kernel_ms``; None if the profiler did not see one per launch)."""
    import torch

    from cula.sm90 import entry as entry_module

    original = entry_module.launch
    events = []

    def timed(kernel, chunk_call, config, t, scale):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        original(kernel, chunk_call, config, t, scale)
        end.record()
        ctas = (t.q.shape[0] if t.starts is None else t.starts.numel()) * t.v.shape[2]
        events.append((config.mode, config.intra, ctas, start, end))

    entry_module.launch = timed
    try:
        runs = []
        for _ in range(reps):
            events.clear()
            call()
            torch.cuda.synchronize()
            runs.append([(m, i, n, s.elapsed_time(e)) for m, i, n, s, e in events])
    finally:
        entry_module.launch = original
    launches = len(runs[0])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    kernels = sorted(
        (e.time_range.start, e.time_range.elapsed_us() / 1e3)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and kernel_name in e.name
    )
    per_call = [[ms for _, ms in kernels[r * launches : (r + 1) * launches]] for r in range(reps)]
    exact = len(kernels) == reps * launches
    return [
        {
            "mode": m,
            "intra": i,
            "ctas": n,
            "ms": statistics.median(run[j][3] for run in runs),
            "kernel_ms": statistics.median(k[j] for k in per_call) if exact else None,
        }
        for j, (m, i, n, _) in enumerate(runs[0])
    ]


def time_shape(op: str, module, entry, shape: str, l2norm: bool, sms: int, gate_in_kernel: bool = False) -> None:
    """Print the call, the unsplit call, the model and each launch for one B x T x H shape (D = 128)."""
    import functools

    import torch
    from chunk_inputs import chunk_inputs  # (this script's folder is first on sys.path)
    from triton.testing import do_bench

    from cula import devices
    from cula.ops import segment_split

    B, T, H = (int(x) for x in shape.split("x"))
    q, k, v, g, beta, kw = chunk_inputs(
        op, B, T, H, l2norm, gate_in_kernel,
        lambda *s: torch.randn(*s, device="cuda"), lambda *s: torch.rand(*s, device="cuda"),
    )  # fmt: skip
    call = functools.partial(entry, q, k, v, g, beta, output_final_state=True, **kw)

    whole = do_bench(call, warmup=20, rep=200)
    unsplit = do_bench(lambda: call(split=False), warmup=20, rep=200)
    # (KDA's model has no qk_l2norm cost)
    kernel_time = devices.times_for(0).kernels[module.time_model(l2norm, 128) if op == "gdn" else "kda"]
    model = kernel_time.ms([T] * B, H, sms)
    print(f"{op} {shape}{' qk_l2norm' if l2norm else ''}{' gate in kernel' if gate_in_kernel else ''}: call {whole:.3f} ms, unsplit {unsplit:.3f} ms, "
          f"model {model:.3f} ms (for the planner's own plan)")  # fmt: skip
    launches = per_launch(call, "kernel")
    plan = segment_split.plan_segments([T] * B, H, sms, segment_split.CHUNK, kernel_time.split)
    pieces = [T] if plan is None else [e - s for _, s, e in segment_split.segments([0, T], plan[:1])]
    longest = -(-max(pieces) // segment_split.CHUNK)
    for row in launches:
        kernel = (
            "kernel ?"
            if row["kernel_ms"] is None
            else (f"kernel {row['kernel_ms']:.3f} ms = {1000 * row['kernel_ms'] / longest:.2f} us per chunk")
        )
        print(f"  {row['mode']:10s} intra={row['intra']:4s} {row['ctas']:5d} CTAs  {row['ms']:.3f} ms  "
              f"{1000 * row['ms'] / longest:.2f} us per chunk of the longest segment ({longest}); {kernel}")  # fmt: skip
    print(f"  rest of the call {whole - sum(r['ms'] for r in launches):.3f} ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", default="gdn", choices=["gdn", "kda"])
    p.add_argument("--shapes", default="1x65536x8,1x8192x64", help="comma list of BxTxH")
    p.add_argument("--seg", type=int, default=None, help="cut every sequence every SEG chunks (default: the plan)")
    p.add_argument("--l2norm", action="store_true", help="raw q / k normalised by the kernel (qk_l2norm)")
    p.add_argument("--gate-in-kernel", action="store_true", help="kda: a raw bf16 gate activated by the kernel")
    a = p.parse_args()

    import torch

    from cula.ops import segment_split

    if a.op == "gdn":
        from cula.gdn import chunk_fwd_sm90 as module

        entry = module.chunk_gated_delta_rule_fwd_sm90
    else:
        from cula.kda import chunk_fwd_sm90 as module

        entry = module.chunk_kda_fwd_sm90
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if a.seg is not None:
        chunk = segment_split.CHUNK

        def every_seg(lengths, *_args, **_kw):
            return [list(range(a.seg * chunk, n, a.seg * chunk)) for n in lengths]

        segment_split.plan_segments = every_seg
    for shape in a.shapes.split(","):
        time_shape(a.op, module, entry, shape, a.l2norm, sms, a.gate_in_kernel and a.op == "kda")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
