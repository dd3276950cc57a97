"""The host (Python) time per call of cuLA's forward entry points on the CuTe path, on a CPU: the real host path
(validation, dispatch, the time model, the split planner, allocations, the launches' arguments) with CUDA faked and
the GPU work stubbed out, so that only the host's work is timed.

    python tools/host_profile.py [--case NAME ...] [--calls 100] [--rounds 20] [--profile] [--top 25] [--step]

The call's tensors live on PyTorch's ``meta`` device (shapes and dtypes, no data): every torch op the host path
makes on them costs its dispatch, as a GPU launch's host side does, and neither computes nor touches memory, so any
shape fits. The varlen offsets stay on the CPU: validation reads them once per tensor, as it reads a GPU's. A read
of a device tensor's values on the host (a sync on a GPU) raises on ``meta``.

What is faked (:func:`faked_gpu`): every tensor reports ``is_cuda``; the GPU is an H100 SXM (compute capability 9.0,
132 SMs, its row of :mod:`cula.devices`); no CUDA graph is being captured; :func:`cula.runtime.host_to_device` copies
to the call's device without pinning. What is stubbed: each compiled kernel (the chunk kernels and the start chain
compile to a no-op through the real :func:`cula.runtime.get_or_compile`, so a launch's own code runs up to the call)
and FLA's Triton pre-passes (beta's sigmoid, the GDN and KDA gates: an empty output of the right shape).

Each case (``--case``; all by default) makes a few warm-up calls (the first reads the varlen offsets and makes the
cached plans, as a model's first layer does) and must be served by the CuTe path; then ``--rounds`` rounds over
the cases time ``--calls`` calls of each, one by one, and the fastest round's median is printed in microseconds
(this machine's slow spells then pass over a round rather than over one case). ``--step`` times a training step
instead (:func:`training_step`: the forward under autograd, then its backward with the kernels stubbed) for the
cases whose backward runs on cuLA's kernels. ``--profile`` adds cProfile's top
functions by own and by cumulative time over each case's calls, ``--ops`` the torch ops one call dispatches (each a
launch or an allocation on a GPU).

The numbers are indicative: ops on ``meta`` tensors whose shape rules are written in Python (``index_select``,
``index_add_``, ``arange``, elementwise arithmetic) cost more here than a GPU's dispatch of them; a GPU's host adds
what the fakes skip (stream queries, the launches themselves, ~7 us each through TVM-FFI) and runs Python at its
own speed.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # cula and benchmarks, run as a script

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DEVICE = "meta"
DEVICE_NAME = "NVIDIA H100 80GB HBM3"
SMS = 132
WARMUP = 5
_INHERITED = object()  # a patched attribute that its class only inherited


class _Stream:
    """What the host path asks of a CUDA stream."""

    stream_id = 0

    def synchronize(self) -> None:
        pass


def _to_device(x: torch.Tensor, device) -> torch.Tensor:
    """:func:`cula.runtime.host_to_device` without pinned memory (a CPU-only torch has none)."""
    return x if device is None or torch.device(device).type == "cpu" else x.to(device)


def _empty_output(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """FLA's Triton pre-passes, stubbed: an fp32 output of the input's shape (``empty_like``'s layout rules would cost
    tens of microseconds in Python on ``meta``)."""
    return torch.empty(x.shape, dtype=torch.float32, device=x.device)


@contextlib.contextmanager
def faked_gpu():
    """Inside this block the host path runs as on an H100 with every GPU launch stubbed (see the module docstring)."""
    import fla.ops.common.gate
    import fla.ops.gated_delta_rule.gate
    import fla.ops.kda.gate

    from cula import runtime

    props = type("Props", (), {"multi_processor_count": SMS, "name": DEVICE_NAME})
    real_get_or_compile = runtime.get_or_compile
    patches = [
        (torch.Tensor, "is_cuda", property(lambda self: True)),
        (torch.cuda, "get_device_capability", lambda device=None: (9, 0)),
        (torch.cuda, "get_device_properties", lambda device=None: props),
        (torch.cuda, "is_current_stream_capturing", lambda: False),
        (torch.cuda, "current_stream", lambda device=None: _Stream()),
        (runtime, "host_to_device", _to_device),
        (runtime, "get_or_compile", lambda key, build: real_get_or_compile(("stub", key), lambda: lambda *a: None)),
        (fla.ops.common.gate, "fused_beta_sigmoid", _empty_output),
        (fla.ops.gated_delta_rule.gate, "gdn_gate_fwd", _empty_output),
        (fla.ops.kda.gate, "kda_gate_fwd", _empty_output),
    ]
    saved = [(owner, name, owner.__dict__.get(name, _INHERITED)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    runtime.forget_devices()
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            if value is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        runtime.forget_devices()


def _qkv(B: int, T: int, H: int, D: int) -> dict:
    return {n: torch.empty(B, T, H, D, dtype=torch.bfloat16, device=DEVICE) for n in ("q", "k", "v")}


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def gdn(B: int, T: int, H: int, D: int = 128, lengths: list[int] | None = None) -> tuple[Callable, dict]:
    """chunk_gated_delta_rule as the benchmark calls it: fp32 activated g, beta, the final state."""
    import cula

    args = _qkv(B, T, H, D)
    args.update(
        g=torch.empty(B, T, H, device=DEVICE), beta=torch.empty(B, T, H, device=DEVICE), output_final_state=True
    )
    if lengths is not None:
        args["cu_seqlens"] = _offsets(lengths)
    return cula.gdn.chunk_gated_delta_rule, args


def kda(B: int, T: int, H: int, D: int = 128) -> tuple[Callable, dict]:
    """chunk_kda in FLA's layer setting: raw bf16 gate activated in the kernel, q/k norm and beta's sigmoid."""
    import cula

    args = _qkv(B, T, H, D)
    args.update(
        g=torch.empty(B, T, H, D, dtype=torch.bfloat16, device=DEVICE),
        beta=torch.empty(B, T, H, dtype=torch.bfloat16, device=DEVICE), A_log=torch.empty(H, device=DEVICE),
        dt_bias=torch.empty(H * D, device=DEVICE), use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0, output_final_state=True,
    )  # fmt: skip
    return cula.kda.chunk_kda, args


def gla(B: int, T: int, H: int, D: int = 128) -> tuple[Callable, dict]:
    """chunk_gla with an fp32 per-key gate."""
    import cula

    args = _qkv(B, T, H, D)
    args.update(g=torch.empty(B, T, H, D, device=DEVICE), output_final_state=True)
    return cula.gla.chunk_gla, args


def simple_gla(B: int, T: int, H: int, D: int = 128) -> tuple[Callable, dict]:
    """chunk_simple_gla with a per-head g_gamma."""
    import cula

    args = _qkv(B, T, H, D)
    args.update(g_gamma=torch.empty(H, device=DEVICE), output_final_state=True)
    return cula.lightning.chunk_simple_gla, args


def lightning(B: int, T: int, H: int, D: int = 128) -> tuple[Callable, dict]:
    """chunk_lightning_attn of layer 1 of 4."""
    import cula

    args = _qkv(B, T, H, D)
    args.update(layer_idx=1, num_layers=4, output_final_state=True)
    return cula.lightning.chunk_lightning_attn, args


def gdn_decode(N: int, H: int = 32, D: int = 128) -> tuple[Callable, dict]:
    """fused_recurrent_gated_delta_rule as a serving engine's decode step calls it: one token per sequence, an fp32
    state pool of N slots read and written in place by slot, the q/k norm in the kernel. Its tensors are on the CPU
    (validation reads the slots' values, which a meta tensor has not; the pool's bytes are never touched)."""
    import cula

    bf16 = torch.bfloat16
    args = {n: torch.zeros(N, 1, H, D, dtype=bf16) for n in ("q", "k", "v")}
    args.update(
        g=torch.zeros(N, 1, H), beta=torch.zeros(N, 1, H, dtype=bf16), initial_state=torch.empty(N, H, D, D),
        ssm_state_indices=torch.arange(N, dtype=torch.int32), use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return cula.gdn.fused_recurrent_gated_delta_rule, args


def kda_decode(N: int, H: int = 32, D: int = 128) -> tuple[Callable, dict]:
    """fused_recurrent_kda as the decode benchmark's plain row calls it: one token per sequence, a per-key log gate,
    fp32 initial states in and final states out, the q/k norm in the kernel (tensors on the CPU, as
    :func:`gdn_decode`'s)."""
    import cula

    bf16 = torch.bfloat16
    args = {n: torch.zeros(N, 1, H, D, dtype=bf16) for n in ("q", "k", "v")}
    args.update(
        g=torch.zeros(N, 1, H, D), beta=torch.zeros(N, 1, H, dtype=bf16), initial_state=torch.empty(N, H, D, D),
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return cula.kda.fused_recurrent_kda, args


def _skewed(n: int) -> list[int]:
    from benchmarks.shapes import VARLEN_MIXES

    return next(lengths for kind, lengths in VARLEN_MIXES if kind == "skewed" and len(lengths) == n)


# name -> a maker of (entry point, its arguments)
CASES: dict[str, Callable[[], tuple[Callable, dict]]] = {
    "gdn B1 T8192 H64": lambda: gdn(1, 8192, 64),
    "gdn B2 T16384 H64": lambda: gdn(2, 16384, 64),
    "gdn varlen skewed N=20 H32": lambda: gdn(1, 32768, 32, lengths=_skewed(20)),
    "simple_gla B1 T8192 H64": lambda: simple_gla(1, 8192, 64),
    "lightning B1 T8192 H64": lambda: lightning(1, 8192, 64),
    "kda B1 T8192 H64": lambda: kda(1, 8192, 64),
    "gla B1 T8192 H64": lambda: gla(1, 8192, 64),
    "simple_gla B1 T65536 H8": lambda: simple_gla(1, 65536, 8),
    "gla B1 T65536 H8": lambda: gla(1, 65536, 8),
    "gdn decode N=1 H32": lambda: gdn_decode(1),
    "gdn decode N=256 H32": lambda: gdn_decode(256),
    "kda decode N=32 H32": lambda: kda_decode(32),
}


# the cases whose training calls cuLA's SM90 backward serves
STEP_CASES = ("gdn B1 T8192 H64", "simple_gla B1 T8192 H64", "lightning B1 T8192 H64", "gla B1 T8192 H64")


def training_step(fn: Callable, args: dict) -> tuple[Callable, dict]:
    """A training step on ``fn(**args)`` as ``(step, {})``: :func:`backward_pass_times.training_step` (every floating
    input a leaf that requires grad, its ``.grad`` set to None before each step), the output's cotangent shaped as
    v."""
    from backward_pass_times import training_step as step_of

    return step_of(fn, args, torch.empty_like(args["v"]), "cute"), {}


def time_case(fn: Callable, args: dict, calls: int) -> float:
    """The median host microseconds per call of ``calls`` calls of ``fn(**args)``, timed one by one."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(**args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


class _OpNames(TorchDispatchMode):
    """The torch ops dispatched inside the block, by name: on a GPU each is a launch or an allocation's host cost."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def op_names(fn: Callable, args: dict) -> list[str]:
    """The torch ops one call of ``fn(**args)`` dispatches, in order."""
    with _OpNames() as ops:
        fn(**args)
    return ops.names


def profile_case(fn: Callable, args: dict, calls: int, top: int) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn(**args)
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


def main() -> None:
    import cula

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=list(CASES), help="a case to run (repeatable; all if none)")
    parser.add_argument("--calls", type=int, default=100, help="timed calls per case and round")
    parser.add_argument("--rounds", type=int, default=20, help="rounds over the cases; the fastest one's median counts")
    parser.add_argument("--ops", action="store_true", help="also list the torch ops of one call of each case")
    parser.add_argument("--profile", action="store_true", help="also cProfile each case's calls")
    parser.add_argument("--top", type=int, default=25, help="functions listed per profile")
    parser.add_argument("--step", action="store_true", help="time training steps (forward and backward) instead")
    opts = parser.parse_args()
    names = opts.case or list(STEP_CASES if opts.step else CASES)
    if opts.step and set(names) - set(STEP_CASES):
        raise SystemExit(f"--step takes the cases {', '.join(STEP_CASES)}")
    with torch.set_grad_enabled(opts.step), faked_gpu():
        calls = {}
        for name in names:
            fn, args = CASES[name]()
            calls[name] = training_step(fn, args) if opts.step else (fn, args)
            for _ in range(WARMUP):
                calls[name][0](**calls[name][1])
            decision = str(cula.last_decision(fn))
            if "served by 'cute'" not in decision:
                raise SystemExit(f"{name}: not served by the CuTe path:\n{decision}")
        # rounds over every case, the fastest round's median kept: a shared machine's slow spells pass over a
        # round or two rather than over one case's calls
        best = dict.fromkeys(names, float("inf"))
        for _ in range(opts.rounds):
            for name, (fn, args) in calls.items():
                best[name] = min(best[name], time_case(fn, args, opts.calls))
        for name in names:
            print(f"{name}: {best[name]:.1f} us host per {'step' if opts.step else 'call'}", flush=True)
        if opts.ops:
            for name, (fn, args) in calls.items():
                ops = op_names(fn, args)
                print(f"{name}: {len(ops)} torch ops per call: {' '.join(ops)}")
        if opts.profile:
            for name, (fn, args) in calls.items():
                print(f"\n--- {name}")
                profile_case(fn, args, opts.calls, opts.top)


if __name__ == "__main__":
    if os.environ.get("CULA_BACKEND", "cute") != "cute":
        raise SystemExit("tools/host_profile.py times the CuTe path: unset CULA_BACKEND or set it to cute")
    main()
