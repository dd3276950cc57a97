"""cuLA vs FLA, side by side in one run on the same inputs; writes JSON, a markdown table and a plot.

    python -m benchmarks.run --op gdn kda --shapes core varlen 2x16384x64 8192+512+4096x32 --out results
    python -m benchmarks.run --list

On a GPU each row times cuLA's public entry point (whatever backend its dispatch picks, named in the row) and
FLA 0.6.0's op with `triton.testing.do_bench` (p20, median and p80; FLA warmed first since its first call
autotunes), checks that the two outputs agree (relative RMSE) and how far each is from cuLA's fp32 PyTorch reference
on the first heads, and gives achieved TFLOP/s and GB/s against the floor counted for the op at the GPU's peak rates
(benchmarks/devices.py). Where FlashInfer is importable, GDN rows time its prefill too (benchmarks/peers.py).

Without a GPU it times nothing worth comparing: it checks cuLA's PyTorch reference backend against FLA's naive
recurrence (forward, in fp32 unless --dtype says otherwise, on the small `smoke` grid by default) and writes the same
JSON, table and plot.

--op, --shapes and --modes take several values, space- or comma-separated (FLA's runner: space-separated).
Shapes (--shapes): a grid's name, or a custom shape (D from --head-dim):
  BxTxH          B sequences of T tokens, H heads, e.g. 2x16384x64
  L1+L2+...xH    one varlen call (B = 1, cu_seqlens) of two sequences or more of these lengths, H heads,
                 e.g. 8192+512+4096x32
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.devices import Peaks, peaks_for
from benchmarks.peers import FLASHINFER_ROUTES, FlashInferGDN
from benchmarks.plot import write_plot
from benchmarks.shapes import (
    GRIDS,
    Case,
    cases,
    check_shape,
    grid,
    varlen_lengths,  # noqa: F401  (scripts/ab_trees.py imports it from here)
)

OPS = ("gdn", "kda", "gla", "simple_gla")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
QUANTILES = (0.2, 0.5, 0.8)  # p20, median, p80 of each side's time
DEFAULT_SEED = 0
CHUNK = 64
# Heads the fp32 reference covers on a GPU row: every head is its own recurrence, and the reference materialises
# a [64, 64, K] decay per chunk for KDA, too much at the big shapes for all of them.
REF_HEADS = 2


@dataclass
class Row:
    op: str
    shape: str
    mode: str
    cula_backend: str = ""
    cula_ms: float | None = None  # every *_ms time is a median; quantiles_ms holds each side's p20, median, p80
    kernel_ms: float | None = None  # cuLA's CuTe DSL kernel forced (CULA_BACKEND=cute) where dispatch chose FLA
    cula_host_ms: float | None = None  # host time to issue one cuLA call (GPU work queued, not waited for)
    fla_ms: float | None = None
    speedup: float | None = None
    # FlashInfer's GDN prefill (benchmarks/peers.py): each route's ms, the faster route, cuLA's speedup over it
    flashinfer_routes_ms: dict = field(default_factory=dict)
    flashinfer_ms: float | None = None
    flashinfer_route: str = ""
    speedup_vs_flashinfer: float | None = None
    rel_rmse: float | None = None
    # each side against the fp32 reference on the first REF_HEADS heads (the larger of output and final state)
    ref_rmse_cula: float | None = None
    ref_rmse_fla: float | None = None
    # the parts of those maxima: "vs_fla", "cula_vs_ref", "fla_vs_ref", "flashinfer_vs_ref" -> [output, final state]
    errors: dict = field(default_factory=dict)
    floor_ms: float | None = None
    cula_tflops: float | None = None
    cula_gbps: float | None = None
    floor_fraction: float | None = None
    notes: list[str] = field(default_factory=list)
    # "cula", "fla", "kernel", "flashinfer" (its faster route) -> [p20, median, p80] in ms
    quantiles_ms: dict = field(default_factory=dict)


# -- inputs ---------------------------------------------------------------------------------------------------


def case_seed(case: Case, seed: int) -> int:
    """The seed of one case's inputs: a function of the run's seed, the op and the shape alone."""
    return zlib.crc32(f"{seed}/{case.op}/{case.name}".encode())


def seed_case(case: Case, seed: int) -> None:
    """Seeds torch's (every device's) and Python's generators for ``case``, so that a row's inputs do not depend on
    which rows ran before it."""
    random.seed(case_seed(case, seed))
    torch.manual_seed(case_seed(case, seed))


def make_inputs(case: Case, device: str, dtype: torch.dtype, requires_grad: bool, seed: int = DEFAULT_SEED) -> dict:
    """Keyword arguments accepted by both cuLA's and FLA's entry point for ``case.op``, drawn from ``seed_case``."""
    seed_case(case, seed)
    B, T, H, D = case.B, case.T, case.H, case.D
    kw = {"device": device, "dtype": dtype}
    q = torch.randn(B, T, H, D, **kw)
    k = F.normalize(torch.randn(B, T, H, D, device=device, dtype=torch.float32), dim=-1).to(dtype)
    v = torch.randn(B, T, H, D, **kw)
    args = {"q": q, "k": k, "v": v}
    if case.op == "gdn":
        args["g"] = F.logsigmoid(torch.randn(B, T, H, device=device, dtype=torch.float32))
        args["beta"] = torch.rand(B, T, H, **kw).sigmoid()
        if case.layer:
            args["k"] = torch.randn(B, T, H, D, **kw)
            args["use_qk_l2norm_in_kernel"] = True
    elif case.op == "kda":
        # the setting of FLA's KDA layer: bounded gate, l2norm and beta sigmoid computed in the kernel
        args["g"] = torch.randn(B, T, H, D, **kw)
        args["beta"] = torch.randn(B, T, H, **kw)
        args.update(
            A_log=torch.log(torch.empty(H, device=device).uniform_(1, 16)),
            dt_bias=torch.randn(H * D, device=device) * 0.1,
            use_gate_in_kernel=True,
            use_qk_l2norm_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            safe_gate=True,
            lower_bound=-5.0,
        )
    elif case.op == "gla":
        args["g"] = F.logsigmoid(torch.randn(B, T, H, D, device=device, dtype=torch.float32)) / 16
    elif case.op == "simple_gla":
        args["g_gamma"] = -(8 / H) * torch.arange(1, H + 1, device=device, dtype=torch.float32) / H
    args["output_final_state"] = True
    if case.lengths is not None:
        offsets = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], device=device)
        args["cu_seqlens"] = offsets.to(torch.int32)
    for name in ("q", "k", "v", "g", "beta"):
        if name in args and requires_grad:
            args[name] = args[name].detach().requires_grad_(True)
    return args


def entry_points(op: str):
    import cula

    cula_fn = {
        "gdn": cula.gdn.chunk_gated_delta_rule,
        "kda": cula.kda.chunk_kda,
        "gla": cula.gla.chunk_gla,
        "simple_gla": cula.lightning.chunk_simple_gla,
    }[op]
    return cula_fn, cula_fn.cula_op.fla_target


# -- the two numbers ------------------------------------------------------------------------------------------


def floor(case: Case, itemsize: int = 2) -> tuple[float, float]:
    """FLOPs and bytes a fused chunk kernel must spend (q, k, v, o of ``itemsize`` bytes, GDN's and GLA's gates in
    fp32, the fp32 state read and written once)."""
    tokens_heads = case.B * case.T * case.H if case.lengths is None else sum(case.lengths) * case.H
    n_seq = case.B if case.lengths is None else len(case.lengths)
    K = V = case.D
    if case.op in ("gdn", "kda"):
        flops_per = 2 * CHUNK * (3 * K + 2 * V) + 6 * K * V
    elif case.op == "gla":
        flops_per = 2 * CHUNK * (2 * K + V) + 4 * K * V
    else:
        flops_per = 2 * CHUNK * (K + V) + 4 * K * V
    gate_bytes = {"gdn": 4 + itemsize, "kda": itemsize * (K + 1), "gla": 4 * K, "simple_gla": 0}[case.op]
    bytes_ = tokens_heads * (itemsize * (2 * K + 2 * V) + gate_bytes) + n_seq * case.H * K * V * 4 * 2
    return tokens_heads * flops_per, bytes_


# -- timing ---------------------------------------------------------------------------------------------------


def rel_rmse(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def bench(fn, warmup_ms: int = 25, rep_ms: int = 100) -> list[float]:
    """``fn``'s GPU time in ms at ``QUANTILES`` (p20, median, p80), from ``triton.testing.do_bench``."""
    import triton.testing

    return list(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=list(QUANTILES)))


def bench_median(row: Row, side: str, fn) -> float:
    """Times ``fn`` with ``bench``, keeps the quantiles in ``row.quantiles_ms[side]``, returns the median."""
    row.quantiles_ms[side] = bench(fn)
    return row.quantiles_ms[side][1]


def host_issue_ms(call, calls: int = 20) -> float:
    """Host time per call to issue ``calls`` calls back to back without waiting for the GPU: a call whose host time
    reaches its GPU time is timed at its host time by ``bench`` (its events then wait for the host)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    return issued * 1e3 / calls


def time_flashinfer(peer: FlashInferGDN, args: dict, row: Row) -> tuple[torch.Tensor, torch.Tensor] | None:
    """FlashInfer's routes timed on the call's inputs (converted once, outside the timing); returns the faster
    route's outputs in FLA's conventions, or None where it declines or fails (the reason in the row's notes)."""
    why = peer.declines(args)
    if why:
        row.notes.append(f"FlashInfer not timed: {why}")
        return None
    converted = peer.convert(args)
    outputs, quantiles = {}, {}
    for route in FLASHINFER_ROUTES:
        try:
            outputs[route] = peer.call(converted, route)  # the first call compiles
            quantiles[route] = bench(lambda route=route: peer.call(converted, route))
            row.flashinfer_routes_ms[route] = quantiles[route][1]
        except Exception as error:
            row.notes.append(f"FlashInfer {route} failed: {type(error).__name__}: {str(error)[:160]}")
    if not row.flashinfer_routes_ms:
        return None
    row.flashinfer_route = min(row.flashinfer_routes_ms, key=row.flashinfer_routes_ms.get)
    row.flashinfer_ms = row.flashinfer_routes_ms[row.flashinfer_route]
    row.quantiles_ms["flashinfer"] = quantiles[row.flashinfer_route]
    return peer.back(args, *outputs[row.flashinfer_route])


def run_gpu_case(
    case: Case,
    mode: str,
    peaks: Peaks,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = DEFAULT_SEED,
    with_fla: bool = True,
    peer: FlashInferGDN | None = None,
) -> Row:
    """One row on the GPU: cuLA and FLA (and ``peer`` on forward rows) timed on the same seeded inputs, their
    agreement, their errors against the fp32 reference, and the floor at ``peaks``."""
    import cula
    from cula.sm90 import entry as sm90_entry

    row = Row(case.op, case.name, mode)
    cula_fn, fla_target = entry_points(case.op)
    from cula.dispatch import fla_function

    fla_fn = fla_function(fla_target)
    args = make_inputs(case, "cuda", dtype, requires_grad=mode == "fwdbwd", seed=seed)
    grads = [a for a in args.values() if isinstance(a, torch.Tensor) and a.requires_grad]

    def step(fn):
        def call():
            o, _ = fn(**args)
            if mode == "fwdbwd":
                torch.autograd.backward(o, do, inputs=grads)
                for t in grads:
                    t.grad = None

        return call

    do = torch.randn_like(args["v"])
    o_fla = s_fla = None
    try:
        if with_fla:
            o_fla, s_fla = fla_fn(**args)  # first call autotunes
            row.fla_ms = bench_median(row, "fla", step(fla_fn))
    except Exception as error:  # FLA refuses some ops on some triton versions: record it, time cuLA anyway
        o_fla = None
        row.notes.append(f"FLA failed: {type(error).__name__}: {str(error)[:200]}")
    try:
        sm90_entry.forget_last_plan()
        o_cula, s_cula = cula_fn(**args)
        row.cula_backend = cula.last_decision(cula_fn).backend
        plan = sm90_entry.last_plan()
        if plan is not None:  # a chunk kernel ran it: how
            row.notes.append(sm90_entry.describe(plan))
        row.cula_ms = bench_median(row, "cula", step(cula_fn))
        row.cula_host_ms = host_issue_ms(step(cula_fn))
        if row.cula_host_ms > 0.8 * row.cula_ms:
            row.notes.append(f"near host-bound: {row.cula_host_ms:.3f} ms of host time per call")
    except Exception as error:
        row.notes.append(f"cuLA failed: {type(error).__name__}: {str(error)[:200]}")
        return row
    if mode == "fwd" and row.cula_backend != "cute":
        row.kernel_ms = time_forced_kernel(cula_fn, step(cula_fn), args, row)
    peer_out = time_flashinfer(peer, args, row) if peer is not None and mode == "fwd" else None
    if row.flashinfer_ms and row.cula_ms:
        row.speedup_vs_flashinfer = row.flashinfer_ms / row.cula_ms
    if o_fla is not None:
        row.errors["vs_fla"] = [rel_rmse(o_cula.detach(), o_fla.detach()), rel_rmse(s_cula.detach(), s_fla.detach())]
        row.rel_rmse = max(row.errors["vs_fla"])
    if mode == "fwd":
        try:
            reference = reference_outputs(case.op, args)
            row.errors["cula_vs_ref"] = ref_rmse(o_cula, s_cula, reference, REF_HEADS)
            row.ref_rmse_cula = max(row.errors["cula_vs_ref"])
            if o_fla is not None:
                row.errors["fla_vs_ref"] = ref_rmse(o_fla, s_fla, reference, REF_HEADS)
                row.ref_rmse_fla = max(row.errors["fla_vs_ref"])
            if peer_out is not None:
                row.errors["flashinfer_vs_ref"] = ref_rmse(*peer_out, reference, REF_HEADS)
        except Exception as error:  # recorded in the row, the timings kept
            row.notes.append(f"reference failed: {type(error).__name__}: {str(error)[:200]}")
    if row.fla_ms and row.cula_ms:
        row.speedup = row.fla_ms / row.cula_ms
    flops, bytes_ = floor(case, dtype.itemsize)
    if mode == "fwd":
        row.floor_ms = max(flops / (peaks.tflops * 1e9), bytes_ / (peaks.gbps * 1e6))
        row.cula_tflops = flops / (row.cula_ms * 1e9)
        row.cula_gbps = bytes_ / (row.cula_ms * 1e6)
        row.floor_fraction = row.floor_ms / row.cula_ms
    return row


@contextlib.contextmanager
def forced_backend(name: str):
    """``CULA_BACKEND=name`` for the calls inside, the previous setting restored after."""
    previous = os.environ.get("CULA_BACKEND")
    os.environ["CULA_BACKEND"] = name
    try:
        yield
    finally:
        if previous is None:
            del os.environ["CULA_BACKEND"]
        else:
            os.environ["CULA_BACKEND"] = previous


@contextlib.contextmanager
def full_fp32_products():
    """fp32 matrix products without TF32 for the calls inside, whatever the process set."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def time_forced_kernel(cula_fn, call, args, row: Row) -> float | None:
    """The CuTe DSL kernel's time where dispatch preferred another backend (kept for the dispatch time model)."""
    with forced_backend("cute"):
        try:
            cula_fn(**args)
            return bench_median(row, "kernel", call)
        except Exception as error:  # no kernel serves these arguments
            row.notes.append(f"kernel not timed: {type(error).__name__}: {str(error)[:120]}")
            return None


# Arguments indexed by head: token tensors [B, T, H, ...] on dim 2, per-head vectors on dim 0, states on dim 1.
_TOKEN_ARGS = ("q", "k", "v", "g", "beta")


def head_slice(args: dict, heads: int) -> dict:
    """The call's arguments for its first ``heads`` heads (no GVA: q's heads are v's), floating tensors in fp32."""
    H = args["v"].shape[2]
    out = dict(args)
    for name in _TOKEN_ARGS:
        if name in out:
            out[name] = out[name][:, :, :heads]
    for name in ("A_log", "g_gamma"):
        if name in out:
            out[name] = out[name][:heads]
    if "dt_bias" in out:  # [H * K], head-major
        out["dt_bias"] = out["dt_bias"].view(H, -1)[:heads].reshape(-1)
    if out.get("initial_state") is not None:
        out["initial_state"] = out["initial_state"][:, :heads]
    for name, x in out.items():
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            out[name] = x.detach().float()
    return out


def reference_outputs(op: str, args: dict, heads: int = REF_HEADS) -> tuple[torch.Tensor, torch.Tensor]:
    """cuLA's PyTorch reference backend in fp32 on the first ``heads`` heads: (o [B, T, heads, V], final states
    [N, heads, K, V]). Variable-length calls run one sequence at a time, so no sequence is padded to the longest."""
    cula_fn, _ = entry_points(op)
    sliced = head_slice(args, heads)
    cu = sliced.pop("cu_seqlens", None)
    with forced_backend("torch"), full_fp32_products(), torch.no_grad():
        if cu is None:
            return cula_fn(**sliced)
        bounds = cu.tolist()
        outs, states = [], []
        for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            one = {name: (x[:, bos:eos] if name in _TOKEN_ARGS else x) for name, x in sliced.items()}
            if one.get("initial_state") is not None:
                one["initial_state"] = one["initial_state"][n : n + 1]
            o, s = cula_fn(**one)
            outs.append(o)
            states.append(s)
        return torch.cat(outs, 1), torch.cat(states, 0)


def ref_rmse(o: torch.Tensor, s: torch.Tensor, reference: tuple[torch.Tensor, torch.Tensor], heads: int) -> list:
    """Output's and final state's relative RMSE against the reference on the first ``heads`` heads."""
    o_ref, s_ref = reference
    return [rel_rmse(o.detach()[:, :, :heads], o_ref), rel_rmse(s.detach()[:, :heads], s_ref)]


def host_overhead_us(op: str, dtype: torch.dtype, D: int, seed: int, calls: int = 200) -> dict[str, float]:
    """Host time per call on tiny inputs (B=1, T=64, H=32): the host cost of dispatch and launch.

    H=32 shares FLA's autotuning with the grid's H=32 shapes, so FLA does not autotune again here."""
    from cula.dispatch import fla_function

    cula_fn, fla_target = entry_points(op)
    args = make_inputs(Case(op, 1, 64, 32, D), "cuda", dtype, requires_grad=False, seed=seed)
    result = {}
    for name, fn in (("cula", cula_fn), ("fla", fla_function(fla_target))):
        try:
            fn(**args)
            result[name] = host_issue_ms(lambda fn=fn: fn(**args), calls) * 1e3
        except Exception as error:
            result[name] = f"failed: {type(error).__name__}"
    return result


# -- CPU check ------------------------------------------------------------------------------------------------

CPU_NOTE = (
    "No CUDA GPU: this run checks cuLA's PyTorch reference backend against FLA's naive recurrence (forward, output "
    "and final state) and times nothing worth comparing. Run it on a GPU for timings."
)


def run_cpu_case(case: Case, dtype: torch.dtype = torch.float32, seed: int = DEFAULT_SEED) -> Row:
    """cuLA's reference backend against FLA's naive recurrence on the CPU: an accuracy row, nothing timed."""
    import cula

    row = Row(case.op, case.name, "fwd, CPU check")
    cula_fn, _ = entry_points(case.op)
    args = make_inputs(case, "cpu", dtype, requires_grad=False, seed=seed)
    with torch.no_grad():
        o, s = cula_fn(**args)
        row.cula_backend = cula.last_decision(cula_fn).backend
        o_ref, s_ref = naive_outputs(case.op, args)
    row.errors["vs_fla"] = [rel_rmse(o, o_ref), rel_rmse(s, s_ref)]
    row.rel_rmse = max(row.errors["vs_fla"])
    return row


def naive_outputs(op: str, args: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's naive recurrence on a call's arguments: (o, final states [N, H, K, V]); a variable-length call runs one
    sequence at a time, since the naive recurrences take no ``cu_seqlens``."""
    naive = naive_fn(op)
    cu = args.get("cu_seqlens")
    if cu is None:
        return naive(args)
    bounds = cu.tolist()
    parts = [
        naive({name: (x[:, bos:eos] if name in _TOKEN_ARGS else x) for name, x in args.items()})
        for bos, eos in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat([o for o, _ in parts], 1), torch.cat([s for _, s in parts], 0)


def naive_fn(op: str):
    """FLA's naive recurrence for ``op`` on our benchmark arguments (the transforms asked of the op in-kernel
    applied first), returning (o, final state)."""
    from cula.ops.gates import kda_gate, l2norm

    if op == "gdn":
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

        def gdn(a):
            q, k = (l2norm(a["q"]), l2norm(a["k"])) if a.get("use_qk_l2norm_in_kernel") else (a["q"], a["k"])
            return naive_recurrent_gated_delta_rule(q, k, a["v"], a["beta"], a["g"], output_final_state=True)

        return gdn
    if op == "kda":
        from fla.ops.kda.naive import naive_recurrent_kda

        def kda(a):
            g = kda_gate(a["g"], a["A_log"], a["dt_bias"], a["lower_bound"])
            q, k, beta = l2norm(a["q"]), l2norm(a["k"]), a["beta"].sigmoid()
            return naive_recurrent_kda(q, k, a["v"], g, beta, output_final_state=True)

        return kda
    if op == "gla":
        from fla.ops.gla.naive import naive_recurrent_gla

        return lambda a: naive_recurrent_gla(a["q"], a["k"], a["v"], a["g"], output_final_state=True)
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    def simple_gla(a):
        g = a["g_gamma"].expand(*a["q"].shape[:3])
        return naive_recurrent_simple_gla(a["q"], a["k"], a["v"], g, output_final_state=True)

    return simple_gla


# -- report ---------------------------------------------------------------------------------------------------


def environment() -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        # the timed calls reuse one cu_seqlens tensor: neither side syncs to read it again (as across a model's layers)
        "varlen offsets": "read from the device once per cu_seqlens tensor, by cuLA and by FLA",
        # a split long sequence's pass ranges go to the device once per split (before: one synced copy per pass)
        "split ranges": "copied to the device once per split",
    }
    for module in ("triton", "fla", "cutlass"):
        try:
            env[module] = __import__(module).__version__
        except Exception as error:  # a missing package is reported, not fatal
            env[module] = f"unavailable ({type(error).__name__})"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = f"{props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs)"
        env["cuda"] = torch.version.cuda
        try:
            import subprocess

            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                check=False,
            )
            env["driver"] = out.stdout.strip()
        except OSError:
            env["driver"] = "unknown"
    else:
        env["gpu"] = "none (CPU check: cuLA's PyTorch reference backend against FLA's naive recurrence, nothing timed)"
    return env


def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}" if abs(x) >= 1e-3 else f"{x:.1e}"
    return str(x)


def fmt_ms(row: Row, side: str, median: float | None) -> str:
    """A side's median time with its [p20, p80] where timed."""
    if side not in row.quantiles_ms:
        return fmt(median)
    p20, _, p80 = row.quantiles_ms[side]
    return f"{fmt(median)} [{fmt(p20)}, {fmt(p80)}]"


def title(peaks: Peaks | None) -> str:
    """The table's and the plot's title; ``peaks`` None on a CPU."""
    if peaks is None:
        return "cuLA's reference backend vs FLA's naive recurrence (CPU check, nothing timed)"
    return "cuLA vs FLA " + (
        f"on the {peaks.name}" if peaks.measured else "(floor at default peak rates, not measured here)"
    )


def markdown(env: dict, rows: list[Row], overhead: dict, peaks: Peaks | None) -> str:
    """The markdown table of ``rows``: timings on a GPU, the accuracy check alone on a CPU (``peaks`` None)."""
    lines = [f"# {title(peaks)}", "", "Generated by `python -m benchmarks.run`; do not edit by hand.", ""]
    lines += [f"- {key}: {value}" for key, value in env.items()]
    if peaks is None:
        lines += [
            "",
            CPU_NOTE,
            "rel RMSE: cuLA vs FLA's naive recurrence (FLA's Triton kernels need a GPU), output / final state.",
            "",
            "| op | shape | mode | cuLA backend | rel RMSE output / final state | notes |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            errors = " / ".join(fmt(e, 4) for e in r.errors.get("vs_fla", [None]))
            lines.append(f"| {r.op} | {r.shape} | {r.mode} | {r.cula_backend} | {errors} | {'; '.join(r.notes)} |")
        return "\n".join(lines) + "\n"
    lines += [
        "",
        "ms: median [p20, p80] of `triton.testing.do_bench` (FLA warmed first). speedup = FLA ms / cuLA ms (medians).",
        "rel RMSE: cuLA vs FLA, the larger of output and final state. vs ref: cuLA's and FLA's rel RMSE against cuLA's",
        f"fp32 PyTorch reference on the first {REF_HEADS} heads (the larger of output and final state; each part in the",
        "JSON's `errors`).",
        f"floor: max(FLOPs / {peaks.tflops:g} TFLOP/s, bytes / {peaks.gbps:g} GB/s) for a fused kernel ({peaks.how}).",
        "kernel ms: cuLA's CuTe DSL kernel forced (`CULA_BACKEND=cute`) on rows where dispatch picked another backend.",
        "FlashInfer ms: its GDN prefill on the same inputs (converted outside the timing), the faster of its default",
        "route and its fused kernel (which one in brackets); vs FI = FlashInfer ms / cuLA ms.",
        "notes: 'near host-bound' where issuing a cuLA call takes over 80 % of its timed ms (JSON: cula_host_ms).",
        "",
        "| op | shape | mode | cuLA backend | cuLA ms | FLA ms | speedup | FlashInfer ms | vs FI | kernel ms | rel RMSE | "
        "vs ref cuLA / FLA / FI | floor ms | floor/cuLA | TFLOP/s | GB/s | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fi = f"{fmt_ms(r, 'flashinfer', r.flashinfer_ms)} ({r.flashinfer_route})" if r.flashinfer_ms else "-"
        fi_ref = max(r.errors["flashinfer_vs_ref"]) if "flashinfer_vs_ref" in r.errors else None
        lines.append(
            f"| {r.op} | {r.shape} | {r.mode} | {r.cula_backend} | {fmt_ms(r, 'cula', r.cula_ms)} | "
            f"{fmt_ms(r, 'fla', r.fla_ms)} | {fmt(r.speedup, 2)} | {fi} | {fmt(r.speedup_vs_flashinfer, 2)} | "
            f"{fmt_ms(r, 'kernel', r.kernel_ms)} | {fmt(r.rel_rmse, 4)} | "
            f"{fmt(r.ref_rmse_cula, 4)} / {fmt(r.ref_rmse_fla, 4)} / {fmt(fi_ref, 4)} | "
            f"{fmt(r.floor_ms)} | {fmt(r.floor_fraction, 2)} | "
            f"{fmt(r.cula_tflops, 1)} | {fmt(r.cula_gbps, 0)} | {'; '.join(r.notes)} |"
        )
    if overhead:
        lines += ["", "Host time per call on tiny inputs (B=1, T=64, H=32), microseconds:", ""]
        lines += [f"- {op}: " + ", ".join(f"{k} {fmt(v, 1)}" for k, v in o.items()) for op, o in overhead.items()]
    return "\n".join(lines) + "\n"


# -- command line ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__,
        epilog="Grids:\n" + "\n".join(f"  {name:<8} {what}" for name, what in GRIDS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add(
        "--op",
        nargs="+",
        default=list(OPS),
        metavar="OP",
        help=f"one or more of {', '.join(OPS)}, or all (default: all)",
    )
    add(
        "--shapes",
        nargs="+",
        default=None,
        metavar="SHAPE",
        help="grid names and custom shapes, see below (default: core varlen long on a GPU, smoke on a CPU)",
    )
    add("--modes", nargs="+", default=["fwd"], metavar="MODE", help="GPU: fwd, fwdbwd (default: fwd)")
    add("--dtype", choices=DTYPES, default=None, help="inputs' dtype (default: bf16 on a GPU, fp32 on a CPU)")
    add("--head-dim", type=int, default=128, metavar="D", help="head dimension K = V of every shape (default: 128)")
    add(
        "--seed",
        type=int,
        default=DEFAULT_SEED,
        help="the inputs' seed: each case seeds torch and Python with a hash of it, the op and the shape, so that a "
        f"row's inputs do not depend on the rows run before it (default: {DEFAULT_SEED})",
    )
    add("--json", default=None, metavar="FILE", help="the results as JSON (default: DIR/benchmark.json)")
    add("--out", default="results", metavar="DIR", help="folder for the markdown table and the plot (default: results)")
    add(
        "--markdown-name",
        default=None,
        metavar="NAME",
        help="the table's file name (default: BENCHMARK_H200.md on an H200, else BENCHMARK.md); the plot's is NAME "
        "with .png",
    )
    add("--no-fla", action="store_true", help="GPU: time cuLA alone (no FLA autotuning): for kernel work")
    add("--no-peers", action="store_true", help="GPU: leave out FlashInfer's column even where importable")
    add("--list", action="store_true", help="print the ops and the named shapes, then exit")
    return parser


def listed_values(raw: list[str]) -> list[str]:
    """A list option's values, space- or comma-separated (``--op gdn kda`` or ``--op gdn,kda``)."""
    return [value for item in raw for value in item.split(",") if value]


def listing(D: int) -> str:
    """What ``--list`` prints: the ops with their cuLA and FLA entry points, the grids with their cases."""
    lines = ["ops (--op):"]
    for op in OPS:
        cula_fn, fla_target = entry_points(op)
        lines.append(f"  {op:<11} {cula_fn.__module__}.{cula_fn.__name__}  vs FLA {fla_target}")
    lines += ["", f"named shapes (--shapes; D = {D}):"]
    for name, what in GRIDS.items():
        lines.append(f"  {name:<8} {what}")
        for case in grid(name, "gdn", D):
            lines.append(f"             {case.name}" + (f": lengths {case.lengths}" if case.lengths else ""))
    lines += ["", "custom shapes: BxTxH (e.g. 2x16384x64), L1+L2+...xH (one varlen call, e.g. 8192+512+4096x32)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        print(listing(args.head_dim))
        return 0
    ops = listed_values(args.op)
    ops = list(OPS) if "all" in ops else ops
    modes = listed_values(args.modes)
    for option, values, allowed in (("--op", ops, OPS), ("--modes", modes, ("fwd", "fwdbwd"))):
        if not set(values) <= set(allowed):
            parser.error(f"{option}: unknown {sorted(set(values) - set(allowed))}; choose from {', '.join(allowed)}")
    gpu = torch.cuda.is_available()
    shapes = listed_values(args.shapes or (["core", "varlen", "long"] if gpu else ["smoke"]))
    for spec in shapes:
        try:
            check_shape(spec)
        except ValueError as error:
            parser.error(f"--shapes: {error}")
    todo = cases(ops, shapes, args.head_dim)
    if not todo:
        parser.error("no case to run: the layer grid holds GDN rows only")
    dtype_name = args.dtype or ("bf16" if gpu else "fp32")
    dtype = DTYPES[dtype_name]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = Path(args.json) if args.json else out / "benchmark.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    peaks = peaks_for(torch.cuda.get_device_name(0)) if gpu else None
    env = environment()
    env.update({"dtype": dtype_name, "head dim": args.head_dim, "seed": args.seed})
    if peaks is not None:
        env["peak rates"] = peaks.describe()
    name = args.markdown_name or ("BENCHMARK_H200.md" if "H200" in env.get("gpu", "") else "BENCHMARK.md")
    rows: list[Row] = []
    overhead: dict = {}

    def save() -> None:
        # rewritten after every row, so a run stopped by a time limit still leaves its table
        result = {"env": env, "rows": [asdict(r) for r in rows], "host_us": overhead}
        json_path.write_text(json.dumps(result, indent=1))
        (out / name).write_text(markdown(env, rows, overhead, peaks))

    def add(row: Row) -> None:
        rows.append(row)
        print(json.dumps(asdict(row)), flush=True)
        save()

    if gpu:
        flashinfer = None if args.no_peers else FlashInferGDN.load()
        env["flashinfer"] = "timed on GDN rows" if flashinfer is not None else "not importable or not asked for"
        for case in todo:
            peer = flashinfer if case.op == "gdn" else None
            for mode in modes:
                add(run_gpu_case(case, mode, peaks, dtype, args.seed, with_fla=not args.no_fla, peer=peer))
        if not args.no_fla:  # the host-time comparison calls FLA too
            for op in ops:
                overhead[op] = host_overhead_us(op, dtype, args.head_dim, args.seed)
    else:
        print(CPU_NOTE, flush=True)
        ignored = [flag for flag, given in (("--modes fwdbwd", "fwdbwd" in modes), ("--no-fla", args.no_fla)) if given]
        if ignored:
            print(f"Without a GPU these do nothing: {', '.join(ignored)}", flush=True)
        for case in todo:
            add(run_cpu_case(case, dtype, args.seed))
    env["plot"] = write_plot([asdict(r) for r in rows], out / f"{Path(name).stem}.png", title(peaks))
    save()
    print(markdown(env, rows, overhead, peaks))
    print(f"wrote {json_path} and {out / name}; plot {env['plot']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_PRINT_AUTOTUNING", "0")
    sys.exit(main())
