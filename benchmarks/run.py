"""cuLA vs FLA, side by side in one run on the same inputs; writes JSON and a markdown table.

    python -m benchmarks.run [--ops gdn,kda,...] [--grid core,varlen] [--modes fwd,fwdbwd] [--out results]

On a GPU each row times cuLA's public entry point (whatever backend its dispatch picks, named in the row) and
FLA 0.6.0's op with `triton.testing.do_bench` (median, FLA warmed first since its first call autotunes), checks
that the two outputs agree (relative RMSE) and how far each is from cuLA's fp32 PyTorch reference on the first
heads, and prints achieved TFLOP/s and GB/s against the floor counted for the op. On a machine without a GPU it runs
cuLA's PyTorch reference backend at a small size against FLA's naive recurrence and says so.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.peers import FLASHINFER_ROUTES, FlashInferGDN

# Ceilings measured on the project's H200 (shared/device/README.md): bf16 matmul and device copy.
PEAK_TFLOPS = 687.0
PEAK_GBPS = 4300.0
CHUNK = 64
# Heads the fp32 reference covers on a GPU row: every head is its own recurrence, and the reference materialises
# a [64, 64, K] decay per chunk for KDA, too much at the big shapes for all of them.
REF_HEADS = 2


@dataclass
class Case:
    op: str
    B: int
    T: int
    H: int
    D: int
    lengths: list[int] | None = None  # varlen: the sequence lengths (then B == 1)
    label: str = ""
    # GDN as FLA's GatedDeltaNet layer calls it: raw q and k, L2-normalised by the op (use_qk_l2norm_in_kernel)
    layer: bool = False

    @property
    def name(self) -> str:
        if self.lengths is not None:
            return f"varlen {self.label} N={len(self.lengths)} T={sum(self.lengths)} H={self.H}"
        return f"B={self.B} T={self.T} H={self.H}" + (" l2norm in op" if self.layer else "")


@dataclass
class Row:
    op: str
    shape: str
    mode: str
    cula_backend: str = ""
    cula_ms: float | None = None
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


# -- inputs ---------------------------------------------------------------------------------------------------


def varlen_lengths(kind: str, n: int, total: int, rng: random.Random) -> list[int]:
    """``n`` lengths summing to ``total``: uniform, random, or skewed (one long sequence, many short)."""
    if kind == "uniform":
        base = [total // n] * n
    elif kind == "random":
        cuts = sorted(rng.sample(range(1, total), n - 1))
        base = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    else:  # skewed: half of the tokens in one sequence
        rest = total // 2
        base = [total - rest] + [rest // (n - 1)] * (n - 1)
    base[-1] += total - sum(base)
    return base


def make_inputs(case: Case, device: str, dtype: torch.dtype, requires_grad: bool) -> dict:
    """Keyword arguments accepted by both cuLA's and FLA's entry point for ``case.op``."""
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


def floor(case: Case) -> tuple[float, float]:
    """FLOPs and bytes a fused chunk kernel must spend (bf16 in/out, fp32 state read and written once)."""
    tokens_heads = case.B * case.T * case.H if case.lengths is None else sum(case.lengths) * case.H
    n_seq = case.B if case.lengths is None else len(case.lengths)
    K = V = case.D
    if case.op in ("gdn", "kda"):
        flops_per = 2 * CHUNK * (3 * K + 2 * V) + 6 * K * V
    elif case.op == "gla":
        flops_per = 2 * CHUNK * (2 * K + V) + 4 * K * V
    else:
        flops_per = 2 * CHUNK * (K + V) + 4 * K * V
    gate_bytes = {"gdn": 4 + 2, "kda": 2 * K + 2, "gla": 4 * K, "simple_gla": 0}[case.op]
    bytes_ = tokens_heads * (2 * (2 * K + 2 * V) + gate_bytes) + n_seq * case.H * K * V * 4 * 2
    return tokens_heads * flops_per, bytes_


# -- timing ---------------------------------------------------------------------------------------------------


def rel_rmse(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def bench(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


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
    outputs = {}
    for route in FLASHINFER_ROUTES:
        try:
            outputs[route] = peer.call(converted, route)  # the first call compiles
            row.flashinfer_routes_ms[route] = bench(lambda route=route: peer.call(converted, route))
        except Exception as error:
            row.notes.append(f"FlashInfer {route} failed: {type(error).__name__}: {str(error)[:160]}")
    if not row.flashinfer_routes_ms:
        return None
    row.flashinfer_route = min(row.flashinfer_routes_ms, key=row.flashinfer_routes_ms.get)
    row.flashinfer_ms = row.flashinfer_routes_ms[row.flashinfer_route]
    return peer.back(args, *outputs[row.flashinfer_route])


def run_gpu_case(case: Case, mode: str, with_fla: bool = True, peer: FlashInferGDN | None = None) -> Row:
    import cula

    row = Row(case.op, case.name, mode)
    cula_fn, fla_target = entry_points(case.op)
    from cula.dispatch import fla_function

    fla_fn = fla_function(fla_target)
    args = make_inputs(case, "cuda", torch.bfloat16, requires_grad=mode == "fwdbwd")
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
            row.fla_ms = bench(step(fla_fn))
    except Exception as error:  # FLA refuses some ops on some triton versions: record it, time cuLA anyway
        o_fla = None
        row.notes.append(f"FLA failed: {type(error).__name__}: {str(error)[:200]}")
    try:
        o_cula, s_cula = cula_fn(**args)
        row.cula_backend = cula.last_decision(cula_fn).backend
        row.cula_ms = bench(step(cula_fn))
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
    flops, bytes_ = floor(case)
    if mode == "fwd":
        row.floor_ms = max(flops / (PEAK_TFLOPS * 1e9), bytes_ / (PEAK_GBPS * 1e6))
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
            return bench(call)
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


def host_overhead_us(op: str, device: str, calls: int = 200) -> dict[str, float]:
    """Host time per call on tiny inputs (B=1, T=64, H=32, D=128): the host cost of dispatch and launch.

    H=32 shares FLA's autotuning with the grid's H=32 shapes, so FLA does not autotune again here."""
    from cula.dispatch import fla_function

    cula_fn, fla_target = entry_points(op)
    args = make_inputs(Case(op, 1, 64, 32, 128), device, torch.bfloat16, requires_grad=False)
    result = {}
    for name, fn in (("cula", cula_fn), ("fla", fla_function(fla_target))):
        try:
            fn(**args)
            result[name] = host_issue_ms(lambda fn=fn: fn(**args), calls) * 1e3
        except Exception as error:
            result[name] = f"failed: {type(error).__name__}"
    return result


# -- CPU mode -------------------------------------------------------------------------------------------------


def run_cpu_case(case: Case) -> Row:
    """cuLA's reference backend vs FLA's naive recurrence, fp32 on the CPU (output only)."""
    import cula

    row = Row(case.op, case.name, "fwd (CPU, reference backend)")
    cula_fn, _ = entry_points(case.op)
    args = make_inputs(case, "cpu", torch.float32, requires_grad=False)
    naive = naive_fn(case.op)
    with torch.no_grad():
        o, _ = cula_fn(**args)
        row.cula_backend = cula.last_decision(cula_fn).backend
        row.cula_ms = timed(lambda: cula_fn(**args))
        o_ref = naive(args)
        row.fla_ms = timed(lambda: naive(args))
        row.rel_rmse = rel_rmse(o, o_ref)
        row.speedup = row.fla_ms / row.cula_ms
    row.notes.append("FLA column: FLA's naive recurrence (its Triton kernels need a GPU)")
    return row


def naive_fn(op: str):
    """FLA's naive recurrence for ``op`` on our benchmark arguments (KDA's in-kernel transforms applied first)."""
    if op == "gdn":
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

        return lambda a: naive_recurrent_gated_delta_rule(a["q"], a["k"], a["v"], a["beta"], a["g"])[0]
    if op == "kda":
        from fla.ops.kda.naive import naive_recurrent_kda

        from cula.ops.gates import kda_gate, l2norm

        def kda(a):
            g = kda_gate(a["g"], a["A_log"], a["dt_bias"], a["lower_bound"])
            return naive_recurrent_kda(l2norm(a["q"]), l2norm(a["k"]), a["v"], g, a["beta"].sigmoid())[0]

        return kda
    if op == "gla":
        from fla.ops.gla.naive import naive_recurrent_gla

        return lambda a: naive_recurrent_gla(a["q"], a["k"], a["v"], a["g"])[0]
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    def simple_gla(a):
        g = a["g_gamma"].expand(*a["q"].shape[:3])
        return naive_recurrent_simple_gla(a["q"], a["k"], a["v"], g)[0]

    return simple_gla


def timed(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


# -- grid, report ---------------------------------------------------------------------------------------------


def gpu_grid(ops: list[str], grids: list[str], D: int = 128) -> list[Case]:
    cases = []
    rng = random.Random(0)
    for op in ops:
        if "core" in grids:
            cases += [Case(op, 1, 8192, 64, D), Case(op, 2, 16384, 64, D), Case(op, 8, 2048, 32, D)]
        if "varlen" in grids:
            for n, total in ((10, 4096 * 4), (20, 16384 * 2)):
                for kind in ("uniform", "random", "skewed"):
                    lengths = varlen_lengths(kind, n, total, rng)
                    cases.append(Case(op, 1, total, 32, D, lengths, kind))
        if "long" in grids:
            cases.append(Case(op, 1, 65536, 8, D))
        if "layer" in grids and op == "gdn":
            cases += [Case(op, 2, 16384, 64, D, layer=True), Case(op, 1, 8192, 64, D, layer=True)]
    return cases


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
        env["gpu"] = "none (CPU only: cuLA's PyTorch reference backend at a small size)"
    return env


def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}" if abs(x) >= 1e-3 else f"{x:.1e}"
    return str(x)


def markdown(env: dict, rows: list[Row], overhead: dict) -> str:
    title = "cuLA vs FLA" + (" on the H200" if "H200" in env.get("gpu", "") else "")
    lines = [f"# {title}", "", "Generated by `python -m benchmarks.run`; do not edit by hand.", ""]
    lines += [f"- {key}: {value}" for key, value in env.items()]
    lines += [
        "",
        "ms: median of `triton.testing.do_bench` (FLA warmed first). speedup = FLA ms / cuLA ms. rel RMSE: cuLA vs FLA,",
        "the larger of output and final state. vs ref: cuLA's and FLA's rel RMSE against cuLA's fp32 PyTorch reference",
        f"on the first {REF_HEADS} heads (the larger of output and final state; each part in the JSON's `errors`).",
        "floor: max(FLOPs / 687 TFLOP/s, bytes / 4.3 TB/s) for a fused kernel.",
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
        fi = f"{fmt(r.flashinfer_ms)} ({r.flashinfer_route})" if r.flashinfer_ms else "-"
        fi_ref = max(r.errors["flashinfer_vs_ref"]) if "flashinfer_vs_ref" in r.errors else None
        lines.append(
            f"| {r.op} | {r.shape} | {r.mode} | {r.cula_backend} | {fmt(r.cula_ms)} | {fmt(r.fla_ms)} | "
            f"{fmt(r.speedup, 2)} | {fi} | {fmt(r.speedup_vs_flashinfer, 2)} | {fmt(r.kernel_ms)} | "
            f"{fmt(r.rel_rmse, 4)} | {fmt(r.ref_rmse_cula, 4)} / {fmt(r.ref_rmse_fla, 4)} / {fmt(fi_ref, 4)} | "
            f"{fmt(r.floor_ms)} | {fmt(r.floor_fraction, 2)} | "
            f"{fmt(r.cula_tflops, 1)} | {fmt(r.cula_gbps, 0)} | {'; '.join(r.notes)} |"
        )
    if overhead:
        lines += ["", "Host time per call on tiny inputs (B=1, T=64, H=32, D=128), microseconds:", ""]
        lines += [f"- {op}: " + ", ".join(f"{k} {fmt(v, 1)}" for k, v in o.items()) for op, o in overhead.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default="gdn,kda,gla,simple_gla", help="comma list of gdn, kda, gla, simple_gla")
    parser.add_argument(
        "--grid",
        default="core,varlen,long",
        help="comma list of core, varlen, long, layer (GDN with q/k L2-normalised by the op, as FLA's layer calls it)",
    )
    parser.add_argument("--modes", default="fwd", help="comma list of fwd, fwdbwd")
    parser.add_argument("--no-fla", action="store_true", help="time cuLA alone (no FLA autotuning): for kernel work")
    parser.add_argument("--no-peers", action="store_true", help="leave out FlashInfer's column even where importable")
    parser.add_argument("--out", default="results", help="folder for benchmark.json and the markdown table")
    parser.add_argument("--markdown-name", default=None, help="default BENCHMARK_H200.md on an H200, else BENCHMARK.md")
    args = parser.parse_args(argv)
    ops = args.ops.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    name = args.markdown_name or ("BENCHMARK_H200.md" if "H200" in env.get("gpu", "") else "BENCHMARK.md")
    rows: list[Row] = []
    overhead: dict = {}

    def save() -> None:
        # rewritten after every row, so a run stopped by a time limit still leaves its table
        result = {"env": env, "rows": [asdict(r) for r in rows], "host_us": overhead}
        (out / "benchmark.json").write_text(json.dumps(result, indent=1))
        (out / name).write_text(markdown(env, rows, overhead))

    def add(row: Row) -> None:
        rows.append(row)
        print(json.dumps(asdict(row)), flush=True)
        save()

    if torch.cuda.is_available():
        flashinfer = None if args.no_peers else FlashInferGDN.load()
        env["flashinfer"] = "timed on GDN rows" if flashinfer is not None else "not importable or not asked for"
        for case in gpu_grid(ops, args.grid.split(",")):
            peer = flashinfer if case.op == "gdn" else None
            for mode in args.modes.split(","):
                add(run_gpu_case(case, mode, with_fla=not args.no_fla, peer=peer))
        if not args.no_fla:  # the host-time comparison calls FLA too
            for op in ops:
                overhead[op] = host_overhead_us(op, "cuda")
            save()
    else:
        print("No CUDA GPU: timing cuLA's PyTorch reference backend at a small size on the CPU.", flush=True)
        for op in ops:
            add(run_cpu_case(Case(op, 1, 256, 2, 64)))
    print(markdown(env, rows, overhead))
    print(f"wrote {out / 'benchmark.json'} and {out / name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_PRINT_AUTOTUNING", "0")
    sys.exit(main())
