"""Measure dispatch's time model on this GPU and print its row for cula/devices.py.

    python scripts/calibrate_dispatch.py [--op gdn kda]

Needs an SM90 GPU and FLA. Each op's FLA forward and cuLA's kernel (forced, CULA_BACKEND=cute) are timed with
triton's do_bench (median; bf16, D = 128, the benchmark's inputs) at:

- B1 T8192 H64 and B2 T16384 H64: FLA's ns per token-head (the mean of the two);
- B2 T16384 H64: the kernel's us per chunk (its time over the chunks one CTA walks there, as the model counts them
  on this GPU's SMs); for GDN also with the q/k L2 norm in the kernel (``gdn_l2norm``);
- B1 T65536 H8: FLA's us per chunk of its longest sequence (1024 chunks in series);
- B1 T64 H32: FLA's minimum per call (so small a call is bound by its host time).

The split passes keep the current model's costs, as fractions of a chunk (``tools/split_pass_times.py`` times them). Paste the row into ``TABLE`` under the name printed, then run
``python -m benchmarks.run`` on this GPU, commit its JSON and add it to ``MEASURED_RUNS`` in tests/test_benchmark.py:
that test holds the row within 30 % of every kernel time and 20 % of every FLA time of the run. FLA autotunes at
each new shape on its first call (about a minute each).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LAYER_KERNEL = "gdn_l2norm"  # GDN with the q/k L2 norm in the kernel: the benchmark's layer rows


def timed_ms(fn, case) -> float:
    """Median ms of ``fn`` on the benchmark's inputs for ``case``, after a first call (FLA autotunes, cuLA
    compiles); printed."""
    from benchmarks.run import bench, make_inputs

    args = make_inputs(case, "cuda", torch.bfloat16, requires_grad=False)
    fn(**args)
    ms = bench(lambda: fn(**args))[1]
    print(f"  {case.op} {case.name}: {ms:.3f} ms", flush=True)
    return ms


def calibrate(op: str, sms: int, current) -> tuple:
    """(FlaTime, {kernel time model: us per chunk}) of ``op`` measured on this GPU with ``sms`` SMs; ``current``
    (the GPU's :class:`cula.devices.DeviceTimes` now) counts the chunk walks of the kernel's shape."""
    from benchmarks.run import Case, entry_points, forced_backend
    from cula.devices import FlaTime
    from cula.dispatch import fla_function

    cula_fn, fla_target = entry_points(op)
    fla_fn = fla_function(fla_target)
    print(f"FLA {fla_target}:", flush=True)
    per_token_head = [
        timed_ms(fla_fn, Case(op, B, T, H, 128)) * 1e6 / (B * T * H) for B, T, H in ((1, 8192, 64), (2, 16384, 64))
    ]
    chunk_us = timed_ms(fla_fn, Case(op, 1, 65536, 8, 128)) * 1e3 / (65536 // 64)
    min_ms = timed_ms(fla_fn, Case(op, 1, 64, 32, 128))
    fla = FlaTime(round(statistics.mean(per_token_head), 2), round(min_ms, 2), round(chunk_us, 2))

    print("cuLA's kernel (CULA_BACKEND=cute):", flush=True)
    kernels = {}
    for name, layer in ((op, False), (LAYER_KERNEL, True)) if op == "gdn" else ((op, False),):
        case = Case(op, 2, 16384, 64, 128, layer=layer)
        with forced_backend("cute"):
            ms = timed_ms(cula_fn, case)
        model = current.kernels[name]
        walks = model.ms([case.T] * case.B, case.H, sms) * 1e3 / model.chunk_us
        kernels[name] = round(ms * 1e3 / walks, 2)
    return fla, kernels


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", nargs="+", default=["gdn", "kda"], choices=["gdn", "kda"])
    ops = parser.parse_args().op
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an SM90 GPU (the kernels timed here are SM90's)", file=sys.stderr)
        return 1
    from cula import devices
    from cula.ops.segment_split import SplitCost

    props = torch.cuda.get_device_properties(0)
    current = devices.times_for(0)
    print(f"{props.name}, {props.multi_processor_count} SMs; its model now: {current.label}", flush=True)
    fla, kernels = {}, {}
    for op in ops:
        fla[op], chunk_us = calibrate(op, props.multi_processor_count, current)
        kernels.update(chunk_us)

    split_names = {value: name for name, value in vars(devices).items() if isinstance(value, SplitCost)}
    print(f"\n# scripts/calibrate_dispatch.py ({', '.join(ops)}); split costs: the {current.label} model's")
    print(f'"{props.name}": DeviceTimes(\n    "{props.name.removeprefix("NVIDIA ")}",\n    fla={{')
    for op, time in fla.items():
        print(f'        "{op}": {time!r},')
    print("    },\n    kernels={")
    for name, chunk_us in kernels.items():
        split = current.kernels[name].split
        print(f'        "{name}": KernelTime({chunk_us}, {split_names.get(split, repr(split))}),')
    print("    },\n),")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
