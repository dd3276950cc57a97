"""The host path of an SM90 chunk forward, in one direction: an entry point hands a :class:`ChunkCall` (the call's
tensors and options, named) and its variant's :class:`ChunkKernel` to :func:`chunk_fwd`, which plans the call
(outputs, varlen ranges, whether and where to split long sequences: :mod:`cula.ops.segment_split`) and makes each
launch through :func:`launch` (compile once per set of compile-time constants, then call).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from cula import runtime, validation
from cula.ops import chunk_backward, segment_split, state_chain_sm90
from cula.sm90.chunk_fwd import CHUNK, ChunkFwdConfig

# CUDA's limit on a launch grid's y (and z) size: the chunk kernels run sequence n as grid row n
MAX_SEQUENCES = 65535
# "2" runs each D = 128 value head of a kernel that can (``ChunkKernel.splits_values``) as two CTAs of 64 value
# columns each (ChunkFwdConfig.value_blocks) in every launch that can take them (not a pool's, nor a cached split
# pass), "1" never; unset (or any other value), where :func:`plan_call` chooses them
ENV_VALUE_BLOCKS = "CULA_VALUE_BLOCKS"
_DUMMY: dict = {}
_LAST_PLAN = threading.local()  # each thread's latest planned call: what last_plan() returns


class ChunkCall(NamedTuple):
    """An SM90 chunk forward's inputs: q, k [B, T, H, D] bf16; v [B, T, HV, D] bf16; g as the kernel takes it
    (GDN [B, T, HV] fp32 activated; KDA [B, T, HV, D] fp32 activated, or bf16 raw with ``gate``); beta [B, T, HV]
    fp32 / bf16 (activated); states [N, HV, K, V] fp32 ([N, HV, V, K] with ``state_v_first``); varlen ``cu_seqlens``
    [N + 1] (B == 1) and optionally its host copy. ``out`` / ``final_state_out``: preallocated outputs. ``split``:
    force sequence splitting on (True: a cut per 16 chunks) or off (False); None lets the planner decide.
    ``qk_l2norm``: q and k L2-normalised in the kernel. ``gate``: KDA's ``(A_log, dt_bias, lower_bound)`` when g is
    raw and the kernel activates it. A state pool (:mod:`cula.ops.state_pool`; ``initial_state`` is the pool):
    ``state_slots`` [N] int32 / int64, the rows sequences read their states from (None: row n; negative: padding,
    :func:`_padded_pool`); ``inplace``: the final states written back to those rows, and the pool returned.
    ``workspace``: what the variant's ``prepare`` made for the call's every launch, passed as their ``w`` (SM100 GDN:
    each chunk's Tinv, [B, T, HV, 128] bf16)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    scale: float | None = None
    initial_state: torch.Tensor | None = None
    output_final_state: bool = False
    cu_seqlens: torch.Tensor | None = None
    state_v_first: bool = False
    out: torch.Tensor | None = None
    final_state_out: torch.Tensor | None = None
    cu_seqlens_cpu: torch.Tensor | None = None
    split: bool | None = None
    qk_l2norm: bool = False
    gate: tuple | None = None
    state_slots: torch.Tensor | None = None
    inplace: bool = False
    workspace: torch.Tensor | None = None


class LaunchTensors(NamedTuple):
    """One launch's tensors: ``starts`` / ``ends`` int32 token ranges in batch row 0 (varlen or split segments) or
    None for one sequence per batch row; ``h0`` None for a zero (or identity) start; ``w`` the split passes' Tinv | P
    workspace, or the call's own (:attr:`ChunkCall.workspace`), or None; ``workspaces`` the variant's further split
    workspaces (KDA's B tiles)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    o: torch.Tensor
    h0: torch.Tensor | None
    ht: torch.Tensor
    starts: torch.Tensor | None = None
    ends: torch.Tensor | None = None
    w: torch.Tensor | None = None
    workspaces: dict | None = None
    slots: torch.Tensor | None = None


@dataclass(frozen=True)
class ChunkKernel:
    """A variant's chunk forward (SM90's, or SM100's on the same launch arguments) as the host path sees it.

    - ``compile(arch, *, beta_fp32, state_v_first, **options, **config fields)``: the variant's compile function
      (:class:`ChunkFwdConfig`'s fields as keywords); the kernel it returns is called as ``(q, k, v, g, beta, o, h0,
      ht, starts, ends, w, slots, scale, *gate_args)``.
    - ``gate_args(call, tensors)``: the variant's arguments after ``scale``.
    - ``split_cost(call)``: the planner's costs of its split passes (``cached``: the passes save and load Tinv and P).
    - ``workspaces(ranges, chunks, HV, D, device)``: its further split workspaces, or None.
    - ``options(call)``: its compile-time options beyond :class:`ChunkFwdConfig` (part of the cache key).
    - ``delta_rule``: its recurrence (:attr:`ChunkFwdConfig.delta_rule`), in every launch's config.
    - ``chunk``: its chunk size (the state walks' checkpoint rows, :mod:`cula.sm90.walks`).
    - ``gate_transition``: a split's transitions are made on the host from the gate (``gate`` of
      :func:`cula.ops.segment_split.split_forward`) instead of by a "transition" pass: true for a kernel without the
      delta rule that reads its gate activated (fp32 natural log, per token or per token and key), where a range's
      transition is the gate's decay over the range, a diagonal.
    - ``splits_values``: whether the kernel walks a value head as two CTAs of half the value columns each
      (:attr:`ChunkFwdConfig.value_blocks`): "never"; "when asked" (:data:`ENV_VALUE_BLOCKS`: GPU-timed, its GPU tests
      not yet run); "where they pay" (also unasked, where :func:`plan_call` finds them faster).
    - ``prepare(call)``: the call as the kernel takes it, before it is planned (SM100 GDN: q and k normalised, each
      chunk's Tinv made into ``workspace``)."""

    name: str
    compile: Callable[..., Any]
    gate_args: Callable[[ChunkCall, LaunchTensors], tuple] = lambda call, tensors: ()
    split_cost: Callable[[ChunkCall], segment_split.SplitCost] = lambda call: segment_split.UNCACHED
    workspaces: Callable[..., dict] | None = None
    options: Callable[[ChunkCall], dict] = field(default=lambda call: {})
    delta_rule: bool = True
    chunk: int = CHUNK
    gate_transition: bool = False
    splits_values: str = "never"
    prepare: Callable[[ChunkCall], ChunkCall] = lambda call: call

    def __post_init__(self):
        assert self.splits_values in ("never", "when asked", "where they pay"), self.splits_values


def asked_value_blocks(kernel: ChunkKernel, call: ChunkCall) -> int | None:
    """CTAs per value head as :data:`ENV_VALUE_BLOCKS` sets them (1 where the kernel cannot split a head, or D is
    not 128), or None where :func:`plan_call` chooses."""
    if kernel.splits_values == "never" or not call.q.shape[3] == call.v.shape[3] == 128:
        return 1
    asked = os.environ.get(ENV_VALUE_BLOCKS, "")
    if asked in ("1", "2"):
        return int(asked)
    return None if kernel.splits_values == "where they pay" else 1


def cached_zeros(device, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor on ``device``, made once per (device, shape, dtype): what a kernel gets for an argument the call
    does not use (a range, the split passes' workspace, an absent gate parameter). Never written."""
    key = (device, tuple(shape), dtype)
    t = _DUMMY.get(key)
    if t is None:
        t = torch.zeros(shape, dtype=dtype, device=device)
        if t.is_cuda and not torch.cuda.is_current_stream_capturing():
            # zeroed on the current stream; later calls read it from any stream (the split passes' own, another
            # caller's), which nothing orders after that fill
            torch.cuda.current_stream(t.device).synchronize()
        _DUMMY[key] = t
    return t


def launch(kernel: ChunkKernel, call: ChunkCall, config: ChunkFwdConfig, t: LaunchTensors, scale: float) -> None:
    """One launch, compiled once per (variant, config, beta's dtype, state order, the variant's options, arch)."""
    beta_fp32 = t.beta.dtype == torch.float32
    options = kernel.options(call)
    arch = runtime.device_arch(t.q.device)
    key = (kernel.name, config, beta_fp32, call.state_v_first)
    key = (*key, *sorted(options.items()), arch)
    fn = runtime.get_or_compile(
        key,
        lambda: kernel.compile(
            arch, beta_fp32=beta_fp32, state_v_first=call.state_v_first, **options, **config.__dict__
        ),
    )
    ht, h0 = t.ht, t.h0
    if call.state_v_first:
        # the kernel takes (N, HV, K, V)-shaped tensors; a transposed view carries the V-first storage
        ht = ht.transpose(-1, -2)
        h0 = None if h0 is None else h0.transpose(-1, -2)
    dev = t.q.device
    ranges = cached_zeros(dev, (1,), torch.int32)
    w = cached_zeros(dev, (1, 2 * CHUNK, t.v.shape[2], CHUNK), torch.bfloat16) if t.w is None else t.w
    fn(
        t.q, t.k, t.v, t.g, t.beta, t.o, ht if h0 is None else h0, ht,
        ranges if t.starts is None else t.starts, ranges if t.ends is None else t.ends, w,
        ranges if t.slots is None else t.slots, float(scale), *kernel.gate_args(call, t),
    )  # fmt: skip


class Plan(NamedTuple):
    """How a call runs: its sequences' token offsets in the flattened token axis, and the cut points of each (None:
    every sequence walked whole by one launch); when cut, how many segments that makes and the chunks of the longest
    (the split passes' workspace rows); the CTAs per value head (:attr:`ChunkFwdConfig.value_blocks`)."""

    offsets: tuple[int, ...]
    cuts: tuple[tuple[int, ...], ...] | None
    segments: int = 0
    longest: int = 0
    value_blocks: int = 1


def last_plan() -> Plan | None:
    """The plan of this thread's latest chunk forward through :func:`chunk_fwd` whose launches were made (None before
    the first): how it ran."""
    return getattr(_LAST_PLAN, "plan", None)


def forget_last_plan() -> None:
    """:func:`last_plan` None until this thread's next planned call (for a caller that asks how its own call ran)."""
    _LAST_PLAN.plan = None


def describe(plan: Plan) -> str:
    """``plan`` in a few words, for a benchmark row: how many launches walk how many pieces with how many CTAs per
    value head."""
    blocks = f", {plan.value_blocks} CTAs per value head" if plan.value_blocks > 1 else ""
    if plan.cuts is None:
        return f"sequences walked whole{blocks}"
    cut = sum(1 for c in plan.cuts if c)
    return f"{cut} of {len(plan.cuts)} sequences cut, {plan.segments} segments{blocks}"


def call_offsets(B: int, T: int, cu_seqlens, cu_seqlens_cpu) -> list[int]:
    """A call's sequences as token offsets in the flattened batch: B rows of T tokens, or the varlen offsets (from
    ``cu_seqlens_cpu``, else read from ``cu_seqlens`` once per tensor)."""
    if cu_seqlens is None:
        return [b * T for b in range(B + 1)]
    return validation.host_offsets(cu_seqlens, cu_seqlens_cpu)


def chunk_batches(call: ChunkCall, chunk: int, batch: int):
    """The call's chunks of ``chunk`` tokens from each sequence's start (the rows of
    :func:`cula.ops.chunk_backward.chunk_rows`), ``batch`` at a time: yields ``(tokens, valid)``, [n, chunk] indices
    into the flattened (B T) token axis (clamped into it) and whether each token is in its sequence (a prefix of the
    chunk)."""
    B, T = call.q.shape[:2]
    offsets = call_offsets(B, T, call.cu_seqlens, call.cu_seqlens_cpu)
    index = chunk_backward.chunk_rows(offsets, call.cu_seqlens is None, call.q.device, chunk).index
    for c0 in range(0, index.shape[0], batch):
        rows = index[c0 : c0 + batch]
        yield rows.clamp(max=B * T - 1), rows < B * T


def token_ranges(cu_seqlens) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The int32 ``(starts, ends)`` [N] a launch takes for varlen offsets, or ``(None, None)``."""
    if cu_seqlens is None:
        return None, None
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    return cu[:-1], cu[1:]


def plan_call(kernel: ChunkKernel, call: ChunkCall) -> Plan:
    """The call's offsets (from ``cu_seqlens_cpu``, else read from ``cu_seqlens`` once per tensor), its split (forced,
    or where :func:`cula.ops.segment_split.plan_segments` expects it to be faster) and its value blocks (as asked, or
    two where twice the CTAs still fit one wave and then walk every sequence whole: an H100 timed simple GLA at
    B1 T8192 H64 0.231 ms so against 0.325 split in two, and 0.889 against 0.731 at B2 T16384 H64, two waves)."""
    B, T = call.q.shape[:2]
    offsets = tuple(call_offsets(B, T, call.cu_seqlens, call.cu_seqlens_cpu))
    if call.state_slots is not None or call.inplace:
        return Plan(offsets, None)  # a pool's states are read and written by the one launch
    blocks = asked_value_blocks(kernel, call)
    HV = call.v.shape[2]
    if blocks is None:
        fits = 2 * HV * (len(offsets) - 1) <= runtime.sm_count(call.q.device)
        if fits and (call.split is False or _plan(kernel, call, offsets, HV, 2).cuts is None):
            return Plan(offsets, None, value_blocks=2)
        blocks = 1
    if call.split is False:
        return Plan(offsets, None, value_blocks=blocks)
    plan = _plan(kernel, call, offsets, HV, blocks)
    if plan.cuts is not None and blocks > 1 and kernel.split_cost(call).cached:
        # the cached passes' Tinv | P workspace has one writer per head: cut for one CTA per head
        plan = _plan(kernel, call, offsets, HV, 1)
    return plan


def _plan(kernel: ChunkKernel, call: ChunkCall, offsets: tuple[int, ...], HV: int, blocks: int) -> Plan:
    """The split of a call not forced off, with ``blocks`` CTAs per value head."""
    planner = None if call.split else (HV * blocks, runtime.sm_count(call.q.device), kernel.split_cost(call))
    plan = _cut_plan(offsets, planner, kernel.chunk, blocks)
    if plan.segments > MAX_SEQUENCES:
        return Plan(offsets, None, value_blocks=blocks)  # more segments than a grid has rows: each walked whole
    return plan


@functools.lru_cache(maxsize=256)
def _cut_plan(
    offsets: tuple[int, ...],
    planner: tuple[int, int, segment_split.SplitCost] | None,
    chunk: int = CHUNK,
    value_blocks: int = 1,
) -> Plan:
    """The :class:`Plan` of sequences at ``offsets`` cut where ``planner`` (CTAs per sequence, SMs, split costs) has
    :func:`cula.ops.segment_split.plan_segments` cut them, or with ``planner`` None every 16 chunks (a forced split),
    at multiples of the kernel's ``chunk``, with ``value_blocks`` CTAs per value head. Made once per layout: a
    model's layers plan the same calls."""
    lengths = [e - s for s, e in zip(offsets[:-1], offsets[1:], strict=True)]
    if planner is None:
        cuts = [range(chunk * 16, n, chunk * 16) for n in lengths]
    else:
        heads, sms, cost = planner
        cuts = segment_split.plan_segments(lengths, heads, sms, chunk, cost)
    cuts = None if cuts is None else tuple(map(tuple, cuts))
    if cuts is None or not any(cuts):
        return Plan(offsets, None, value_blocks=value_blocks)  # nothing to cut
    pieces = [e - s for _, s, e in segment_split.segments(offsets, cuts)]
    return Plan(offsets, cuts, len(pieces), -(-max(pieces) // chunk), value_blocks)


def chunk_fwd(kernel: ChunkKernel, call: ChunkCall) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The call (:class:`ChunkCall`) planned and launched. Returns ``(o, final_state or None)``."""
    call = kernel.prepare(call)
    if call.state_slots is not None:
        table = validation.host_indices(call.state_slots)  # read once per tensor, for validation already
        if table is not None and bool((table < 0).any()):
            return _padded_pool(kernel, call, table)
    return _planned(kernel, call)


def _padded_pool(kernel: ChunkKernel, call: ChunkCall, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A pooled call with padding (negative slots, host ``table``: such a sequence reads and writes nothing, its
    outputs are zeros and its fp32 final state too, :mod:`cula.ops.state_pool`) on the kernels' read-only pool mode:
    one launch in which a padding sequence reads slot 0, its outputs and final state zeroed after; with ``inplace``
    the live sequences' final states are then written to their slots. Returns as :func:`chunk_fwd`."""
    B, T = call.q.shape[:2]
    dev, pool = call.q.device, call.initial_state
    live = table >= 0
    N = table.numel()
    if bool(live.any()):
        read = runtime.host_to_device(torch.where(live, table, 0).to(torch.int32), dev)
        sub = call._replace(state_slots=read, inplace=False, output_final_state=True, final_state_out=None)
        o, ht = _planned(kernel, sub)
    else:  # every sequence is padding: nothing to run
        o = call.out if call.out is not None else torch.empty_like(call.v)
        ht = pool.new_empty(N, *pool.shape[1:], dtype=torch.float32)
    offsets = call_offsets(B, T, call.cu_seqlens, call.cu_seqlens_cpu)
    lengths = torch.tensor([e - s for s, e in zip(offsets[:-1], offsets[1:], strict=True)])
    padded_tokens = runtime.host_to_device(torch.repeat_interleave(~live, lengths), dev)
    o.view(B * T, -1).masked_fill_(padded_tokens[:, None], 0)
    if call.inplace:
        rows = torch.nonzero(live).flatten()
        live_states = ht.index_select(0, runtime.host_to_device(rows, dev)).to(pool.dtype)
        pool.index_copy_(0, runtime.host_to_device(table[rows], dev), live_states)
        return o, pool
    ht.masked_fill_(runtime.host_to_device(~live, dev).view(N, 1, 1, 1), 0)
    return o, (ht if call.output_final_state else None)


def _planned(kernel: ChunkKernel, call: ChunkCall) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`chunk_fwd` for a call without padding slots."""
    B, T, H, K = call.q.shape
    HV, V = call.v.shape[2], call.v.shape[3]
    scale = K**-0.5 if call.scale is None else call.scale
    N = B if call.cu_seqlens is None else call.cu_seqlens.numel() - 1
    o = call.out if call.out is not None else torch.empty(B, T, HV, V, dtype=call.v.dtype, device=call.v.device)
    plan = plan_call(kernel, call)
    if plan.cuts is not None:
        ht = _split(kernel, call, plan, o, scale)
        _LAST_PLAN.plan = plan
        return o, ht
    state_shape = (N, HV, V, K) if call.state_v_first else (N, HV, K, V)
    ht = call.initial_state if call.inplace else call.final_state_out
    if ht is None:
        ht = torch.empty(state_shape, dtype=torch.float32, device=call.q.device)
    starts, ends = token_ranges(call.cu_seqlens)
    h0 = call.initial_state
    if h0 is not None and not call.inplace:
        h0 = h0.contiguous()
    slots, state_slots = call.state_slots, "none"
    if slots is not None:
        slots = slots if slots.dtype == torch.int32 else slots.to(torch.int32)
        state_slots = "read_write" if call.inplace else "read"
    state_dtype = "bfloat16" if state_slots != "none" and h0.dtype == torch.bfloat16 else "float32"
    config = ChunkFwdConfig(
        K, starts is not None, h0 is not None, qk_l2norm=call.qk_l2norm, delta_rule=kernel.delta_rule,
        state_slots=state_slots, state_dtype=state_dtype, value_blocks=plan.value_blocks,
    )  # fmt: skip
    tensors = LaunchTensors(
        call.q, call.k, call.v, call.g, call.beta, o, h0, ht, starts, ends, w=call.workspace, slots=slots
    )
    launch(kernel, call, config, tensors, scale)
    _LAST_PLAN.plan = plan
    if call.inplace:
        return o, call.initial_state
    return o, (ht if call.output_final_state else None)


def _split(kernel: ChunkKernel, call: ChunkCall, plan: Plan, o: torch.Tensor, scale: float) -> torch.Tensor | None:
    """A split call: the passes of :func:`cula.ops.segment_split.split_forward` over the flattened token axis, each a
    launch over token ranges (with ``cached`` split costs the first pass saves each chunk's Tinv and P, and the
    variant's further workspaces, for the later passes)."""
    B, T, H, K = call.q.shape
    HV = call.v.shape[2]
    flat = (call.q, call.k, call.v, call.g, call.beta, o)
    workspace = call.workspace
    if B > 1:  # the passes take every token in batch row 0 (a one-row batch already has them there)
        flat = [x.reshape(1, B * T, *x.shape[2:]) for x in flat]
        workspace = None if workspace is None else workspace.reshape(1, B * T, *workspace.shape[2:])
    # the passes run V-first storage as K-first: the kernel takes the states transposed
    flat_call = call._replace(state_v_first=False)
    h0 = call.initial_state
    if h0 is not None and call.state_v_first:
        h0 = h0.transpose(-1, -2)
    cost = kernel.split_cost(call)
    cached = cost.cached
    assert not (cached and plan.value_blocks > 1), plan  # plan_call cuts a cached kernel's call for one CTA per head
    # the activated gate of a kernel without the delta rule: the transitions are its decays
    gate = flat[3] if kernel.gate_transition and call.gate is None else None
    saved = {}

    def run(mode, starts, ends, h0_, out_):
        Vd = K if mode == "transition" else call.v.shape[3]
        ht_ = torch.empty(starts.numel(), HV, K, Vd, dtype=torch.float32, device=call.q.device)
        intra = "none"
        if cached:
            intra = "save" if mode == "full" else "load"
            if mode == "full":
                # rows per (segment, head) for each chunk's Tinv and P, as many chunks as the longest segment's
                shape = (starts.numel(), 2 * CHUNK * plan.longest, HV, CHUNK)
                saved["w"] = torch.empty(shape, dtype=torch.bfloat16, device=call.q.device)
                if kernel.workspaces is not None:
                    saved["more"] = kernel.workspaces(starts.numel(), plan.longest, HV, K, call.q.device)
        config = ChunkFwdConfig(
            K, True, h0_ is not None, mode, intra, call.qk_l2norm, kernel.delta_rule, value_blocks=plan.value_blocks
        )
        tensors = LaunchTensors(*flat[:6], h0_, ht_, starts, ends, saved.get("w", workspace), saved.get("more"))
        launch(kernel, flat_call, config, tensors, scale)
        return ht_

    # the start chain in one launch on a GPU (a PyTorch loop there costs two host ops per segment)
    chain = state_chain_sm90.chain_starts if call.q.is_cuda else segment_split.chain_starts_torch
    ht = segment_split.split_forward(
        run, plan.offsets, plan.cuts, h0, flat[5], call.output_final_state, aligned=cached, chain=chain,
        gate=gate,
    )  # fmt: skip
    if ht is not None and call.state_v_first:
        ht = ht.transpose(-1, -2).contiguous()
    if ht is not None and call.final_state_out is not None:
        call.final_state_out.copy_(ht)
        ht = call.final_state_out
    return ht


def run_bound(kernel: ChunkKernel, args: dict, g: torch.Tensor, gate: tuple | None = None):
    """An entry point's bound arguments to :func:`chunk_fwd`: ``g`` the gate as the kernel takes it (fp32 and
    activated, unless ``gate`` gives the kernel its activation), beta's pre-pass (:func:`cula.ops.gates.kernel_beta`),
    q and k L2-normalised by the kernel itself when ``use_qk_l2norm_in_kernel`` asks."""
    from cula.ops.gates import kernel_beta

    call = ChunkCall(
        args["q"].contiguous(), args["k"].contiguous(), args["v"].contiguous(), g.contiguous(), kernel_beta(args),
        args["scale"], args["initial_state"], args["output_final_state"], args["cu_seqlens"], args["state_v_first"],
        cu_seqlens_cpu=args.get("cu_seqlens_cpu"), qk_l2norm=bool(args["use_qk_l2norm_in_kernel"]), gate=gate,
        **pool_fields(args),
    )  # fmt: skip
    return chunk_fwd(kernel, call)


def pool_fields(args: dict) -> dict:
    """A pooled call's :class:`ChunkCall` fields (``state_slots``, ``inplace``), or none."""
    if not validation.pooled(args):
        return {}
    return {"state_slots": args.get("ssm_state_indices"), "inplace": bool(args.get("inplace_final_state"))}


# the compute capabilities each architecture's chunk kernels are compiled for: SM90 (Hopper), SM100 (B200, B300)
ARCH_CAPABILITIES = {9: ((9, 0),), 10: ((10, 0), (10, 3))}


def supports_qkv(q, k, v, beta, initial_state, cu_seqlens, dims, arch_major: int = 9) -> tuple[bool, str]:
    """The checks every chunk kernel makes but the gate's: device (a GPU of ``arch_major``'s capabilities), dtypes,
    shapes, head dims in ``dims`` (K = V), GVA, beta, varlen batch, fp32 initial state (bf16 on SM90, which validation
    admits only as a state pool, and :func:`cula.dispatch.pool_declines` only by index). Strided inputs are served:
    dispatch makes them contiguous."""
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return False, "tensors are not on a CUDA device"
    capability = runtime.device_capability(q.device)
    if capability not in ARCH_CAPABILITIES[arch_major]:
        wanted = " or ".join(f"{a}.{b}" for a, b in ARCH_CAPABILITIES[arch_major])
        return False, f"needs an SM{arch_major}0 GPU (compute capability {wanted}), got {capability}"
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        return False, f"q, k, v must be bfloat16 (got {q.dtype}, {k.dtype}, {v.dtype})"
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        return False, "expected q, k [B, T, H, K] and v [B, T, HV, V]"
    K, V, H, HV = q.shape[-1], v.shape[-1], q.shape[2], v.shape[2]
    if K not in dims or V not in dims or K != V:
        supported = " or ".join(str(d) for d in dims)
        return False, f"head dims K={K}, V={V} not supported (supported: K = V = {supported})"
    if HV % H != 0:
        return False, f"HV={HV} must be a multiple of H={H}"
    if beta is not None and (beta.dtype not in (torch.float32, torch.bfloat16) or beta.shape != v.shape[:3]):
        return False, "beta must be float32 or bfloat16 [B, T, HV]"
    if cu_seqlens is not None and q.shape[0] != 1:
        return False, "varlen (cu_seqlens) needs B == 1"
    sequences = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if sequences > MAX_SEQUENCES:
        return False, f"{sequences} sequences: the launch grid takes at most {MAX_SEQUENCES} (one CTA row each)"
    states = (torch.float32, torch.bfloat16) if arch_major == 9 else (torch.float32,)
    if initial_state is not None and initial_state.dtype not in states:
        return False, "initial_state must be float32 (or, on SM90, a bf16 state pool)"
    return True, ""


def fake_args(
    D: int,
    beta_fp32: bool,
    state_v_first: bool,
    per_key_gate: bool,
    raw_gate: bool = False,
    checkpoints: bool = False,
    config: ChunkFwdConfig | None = None,
    gate_params: bool = True,
    workspace_columns: int = 64,
) -> tuple:
    """Fake arguments for compiling a chunk kernel, in its launch order ``q, k, v, g, beta, o, h0, ht, starts, ends,
    w, slots, scale[, a_log, dt_bias, lower_bound, wb, wd], stream``: q, k [B, T, H, D], v and o [B, T, HV, D] bf16; g
    [B, T, HV] fp32, or with ``per_key_gate`` [B, T, HV, D] (fp32, bf16 when ``raw_gate``: activated by the kernel)
    followed, with ``gate_params`` (the SM90 KDA kernel's, which GLA's inherits), by the gate's parameters (A_log
    [HV] and dt_bias [HV * D] fp32, lower_bound) and the B-tile workspaces (wb [ranges, rows, HV, D] bf16, wd
    [ranges, chunks, HV, D] fp32); beta fp32 or bf16; the states (N, HV, K, V)
    fp32, stored [N, HV, V, K] (K contiguous) with ``state_v_first``; int32 token ranges; the split passes' workspace
    [ranges, rows, HV, ``workspace_columns``] bf16 (SM100 GDN's inverses: [B, T, HV, 128]), or with ``checkpoints``
    the state walks' [rows, HV, D, D] bf16; a state pool's int32
    rows. A bf16 pool (``config.state_dtype``) is h0, and ht too where the pool is written. Batch, length, head and
    range counts symbolic."""
    import cutlass

    sym = runtime.sym_int
    B, T, H, HV, N, n_ranges = sym(), sym(), sym(), sym(), sym(), sym()
    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    state_order = (3, 2, 0, 1) if state_v_first else None
    pool = bf16 if config is not None and config.state_dtype == "bfloat16" else f32
    final = pool if config is not None and config.state_slots == "read_write" else f32
    g = (
        runtime.fake_tensor(bf16 if raw_gate else f32, (B, T, HV, D))
        if per_key_gate
        else runtime.fake_tensor(f32, (B, T, HV), align=4)
    )
    gate_args = ()
    if per_key_gate and gate_params:
        gate_args = (
            runtime.fake_tensor(f32, (sym(),), align=4),
            runtime.fake_tensor(f32, (sym(),), align=4),
            f32(-5.0),
            runtime.fake_tensor(bf16, (sym(), sym(), HV, D)),
            runtime.fake_tensor(f32, (sym(), sym(), HV, D)),
        )
    return (
        runtime.fake_tensor(bf16, (B, T, H, D)),
        runtime.fake_tensor(bf16, (B, T, H, D)),
        runtime.fake_tensor(bf16, (B, T, HV, D)),
        g,
        # beta's element size as its alignment: an fp32 beta assumed 2-byte aligned is loaded as two 16-bit halves,
        # joined at once, so the load's whole latency is waited where it is issued
        runtime.fake_tensor(f32 if beta_fp32 else bf16, (B, T, HV), align=4 if beta_fp32 else 2),
        runtime.fake_tensor(bf16, (B, T, HV, D)),
        runtime.fake_tensor(pool, (sym(), HV, D, D), state_order),  # h0: N rows, or a pool's slots
        runtime.fake_tensor(final, (N, HV, D, D), state_order),
        runtime.fake_tensor(cutlass.Int32, (n_ranges,), align=4),
        runtime.fake_tensor(cutlass.Int32, (n_ranges,), align=4),
        runtime.fake_tensor(bf16, (sym(), HV, D, D) if checkpoints else (sym(), sym(), HV, workspace_columns)),
        runtime.fake_tensor(cutlass.Int32, (sym(),), align=4),
        f32(1.0),
        *gate_args,
        runtime.fake_stream(),
    )


# The named configurations chunk kernels are compile-checked in (``python -m cula.compile_check``): name suffix ->
# ChunkFwdConfig fields. Each kernel picks its set (:func:`checked`) and adds what is its own; each must hold its
# architecture's MMA and TMA instructions.
CONFIGS = {
    "": {"is_varlen": True, "has_initial_state": True},
    "[fixed length]": {},
    "[pool]": {"is_varlen": True, "has_initial_state": True, "state_slots": "read_write"},
    "[pool, read only]": {"has_initial_state": True, "state_slots": "read"},
    "[bf16 pool]": {
        "is_varlen": True, "has_initial_state": True, "state_slots": "read_write", "state_dtype": "bfloat16",
    },
    "[qk_l2norm]": {"is_varlen": True, "has_initial_state": True, "qk_l2norm": True},
    "[D=64]": {"head_dim": 64, "is_varlen": True, "has_initial_state": True},
    "[transition]": {"is_varlen": True, "mode": "transition"},
    "[correction]": {"is_varlen": True, "mode": "correction"},
    "[D=64, correction]": {"head_dim": 64, "is_varlen": True, "mode": "correction"},
    "[intra save]": {"is_varlen": True, "has_initial_state": True, "intra": "save"},
    "[intra load, transition]": {"is_varlen": True, "mode": "transition", "intra": "load"},
    "[intra load, correction]": {"is_varlen": True, "mode": "correction", "intra": "load"},
    "[D=64, intra save]": {"head_dim": 64, "is_varlen": True, "has_initial_state": True, "intra": "save"},
    "[D=64, intra load, correction]": {"head_dim": 64, "is_varlen": True, "mode": "correction", "intra": "load"},
    "[qk_l2norm, intra save]": {"is_varlen": True, "intra": "save", "qk_l2norm": True},
    "[qk_l2norm, intra load, correction]": {"is_varlen": True, "mode": "correction", "intra": "load", "qk_l2norm": True},
    "[states walk]": {"is_varlen": True, "has_initial_state": True, "walk": "states"},
    "[D=64, states walk]": {"head_dim": 64, "is_varlen": True, "walk": "states"},
    "[state-gradient walk]": {"is_varlen": True, "has_initial_state": True, "walk": "state_grads"},
    "[state-gradient walk, fixed length]": {"walk": "state_grads"},
    "[D=64, state-gradient walk]": {"head_dim": 64, "is_varlen": True, "walk": "state_grads"},
    "[value blocks]": {"is_varlen": True, "has_initial_state": True, "value_blocks": 2},
    "[value blocks, fixed length]": {"value_blocks": 2},
    "[value blocks, correction]": {"is_varlen": True, "mode": "correction", "value_blocks": 2},
    "[value blocks, qk_l2norm]": {"is_varlen": True, "has_initial_state": True, "qk_l2norm": True, "value_blocks": 2},
}  # fmt: skip
# A kernel that can split a value head over two CTAs (ChunkKernel.splits_values) is checked so too
VALUE_BLOCK_CONFIGS = ("[value blocks]", "[value blocks, fixed length]", "[value blocks, correction]")
# The delta-rule kernels' (GDN's, KDA's) set: every mode, intra pass and the q/k norm
DELTA_CONFIGS = (
    "", "[fixed length]", "[pool]", "[bf16 pool]", "[qk_l2norm]", "[D=64]", "[transition]", "[correction]",
    "[intra save]", "[intra load, transition]", "[intra load, correction]", "[D=64, intra save]",
    "[D=64, intra load, correction]", "[qk_l2norm, intra save]", "[qk_l2norm, intra load, correction]",
)  # fmt: skip
# The walks of the backward, in each walk's direction
WALK_CONFIGS = ("[states walk]", "[state-gradient walk]", "[state-gradient walk, fixed length]")


def checked(*suffixes: str) -> dict:
    """The named configurations :data:`CONFIGS` of these suffixes, for :func:`register_checked`."""
    return {suffix: CONFIGS[suffix] for suffix in suffixes}


# what a chunk kernel's PTX must hold: its tensor-core MMAs and TMA copies
SM90_PTX = ("wgmma.mma_async", "cp.async.bulk.tensor")
SM100_PTX = ("tcgen05.mma", "cp.async.bulk.tensor")


def register_checked(
    name: str,
    compile_fn,
    configs: dict,
    sass_allowed: dict | None = None,
    archs: tuple[str, ...] = ("sm_90a",),
    expected_ptx: tuple[str, ...] = SM90_PTX,
) -> None:
    """Register ``name + suffix`` for each entry of ``configs`` (suffix -> keyword options of ``compile_fn(arch,
    **options)``) with the compile check: ``expected_ptx`` (SM90's wgmma and TMA by default) in its PTX, clean machine
    code but for ``sass_allowed[suffix]`` (local-memory instructions, injected ``warpgroup.arrive``; measured
    allowances)."""
    for suffix, options in configs.items():
        runtime.register_kernel(
            f"{name}{suffix}",
            list(archs),
            lambda arch, o=options: compile_fn(arch, **o),
            list(expected_ptx),
            clean_sass=True,
            sass_allowed=(sass_allowed or {}).get(suffix, (0, 0)),
        )


def config_of(options: dict) -> tuple[ChunkFwdConfig, dict]:
    """Split compile options into the :class:`ChunkFwdConfig` fields and the variant's own."""
    fields = set(ChunkFwdConfig.__dataclass_fields__)
    return ChunkFwdConfig(**{k: v for k, v in options.items() if k in fields}), {
        k: v for k, v in options.items() if k not in fields
    }
