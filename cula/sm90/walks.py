"""The backward's state walks on the chunk family (``ChunkFwdConfig.walk``, :mod:`cula.ops.chunk_backward`), SM90's
or SM100's: one launch of a variant's chunk kernel that makes no output and stores a bf16 checkpoint per chunk of C
(the kernel's ``chunk``) tokens, ``[rows, HV, V, K]`` (S^T), row ``n ceil(T / C) + c`` for fixed-length rows,
``offsets[n] // C + n + c`` for varlen ones (:func:`cula.ops.chunk_backward.checkpoint_rows`)."""

from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple

import torch

from cula.ops import chunk_backward
from cula.sm90 import entry
from cula.sm90.chunk_fwd import ChunkFwdConfig


class Walks(NamedTuple):
    """Both walks of a call: the chunk rows' tokens ``index`` [rows, C] and the per-chunk kernels' view of them,
    ``chunks`` [rows, 2] (:class:`cula.ops.chunk_backward.ChunkRows`), the checkpoints of the state at each chunk's
    start (``starts``) and of its gradient at each chunk's end (``ends``), both [rows, HV, V, K] bf16, and dh0 (the
    reverse walk's final state)."""

    index: torch.Tensor
    chunks: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor
    dh0: torch.Tensor


def walk_inputs(kernel: entry.ChunkKernel, q, k, v, do) -> dict[str, tuple]:
    """The (q, k, v) each walk of ``kernel`` reads: the forward's and (q, k, dO) with the delta rule; without it
    (k, v) and (q, dO) in the key and value places (the walks read no q there)."""
    if kernel.delta_rule:
        return {"states": (q, k, v), "state_grads": (q, k, do)}
    return {"states": (k, k, v), "state_grads": (q, q, do)}


def walk_outputs(q, v, cu_seqlens, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """A walk's outputs, uninitialised: ``(checkpoints [rows, HV, V, K] bf16, final state [N, HV, K, V] fp32)``."""
    B, _, _, D = q.shape
    HV = v.shape[2]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    checkpoints = torch.empty(max(rows, 1), HV, D, D, dtype=torch.bfloat16, device=q.device)
    return checkpoints, torch.empty(N, HV, D, D, dtype=torch.float32, device=q.device)


def state_walk(
    kernel: entry.ChunkKernel, walk, q, k, v, g, beta, scale, start, cu_seqlens, rows, state_v_first, out=None
):  # fmt: skip
    """One walk of ``kernel``: ``(checkpoints [rows, HV, V, K] bf16, the walk's final state [N, HV, K, V] fp32, V-first
    storage with ``state_v_first``)``, on the (q, k, v) of :func:`walk_inputs`. ``start``: the state it starts from
    (h0, or dht), or None for zero. ``out``: the two outputs (:func:`walk_outputs`), or None to allocate them. Shapes
    as :class:`cula.sm90.entry.ChunkCall`."""
    D = q.shape[3]
    checkpoints, final = walk_outputs(q, v, cu_seqlens, rows) if out is None else out
    starts, ends = entry.token_ranges(cu_seqlens)
    if start is not None:
        start = start.contiguous()
    config = ChunkFwdConfig(D, starts is not None, start is not None, delta_rule=kernel.delta_rule, walk=walk)
    call = entry.ChunkCall(q, k, v, g, beta, scale, state_v_first=state_v_first)
    # o is never written in a walk: v stands in for it
    tensors = entry.LaunchTensors(q, k, v, g, beta, v, start, final, starts, ends, w=checkpoints)
    entry.launch(kernel, call, config, tensors, scale)
    return checkpoints, final


def both_walks(
    kernel: entry.ChunkKernel, q, k, v, do, g, beta, scale, h0, dht, cu_seqlens, cu_seqlens_cpu, state_v_first
):
    """A call's chunk rows and both walks (:class:`Walks`): "states" from ``h0`` and "state_grads" from ``dht``
    (None: zero). q, k, v, do contiguous; g and beta as ``kernel`` takes them."""
    B, T = q.shape[:2]
    offsets = entry.call_offsets(B, T, cu_seqlens, cu_seqlens_cpu)
    plan = chunk_backward.chunk_rows(offsets, cu_seqlens is None, q.device, kernel.chunk)
    inputs = walk_inputs(kernel, q, k, v, do)
    at = (cu_seqlens, plan.rows, state_v_first)
    # the forward walk's outputs made on this stream before the walk leaves it (nothing frees or reuses them early)
    forward_out = walk_outputs(q, v, cu_seqlens, plan.rows)
    with side_by_side(q.device) as on_side:
        with on_side():
            S, _ = state_walk(kernel, "states", *inputs["states"], g, beta, scale, h0, *at, out=forward_out)
        dS, dh0 = state_walk(kernel, "state_grads", *inputs["state_grads"], g, beta, scale, dht, *at)
    return Walks(plan.index, plan.kernel_rows, S, dS, dh0)


_SIDE = threading.local()  # each thread's side stream per device (one capturing a CUDA graph shares it with none)


@contextlib.contextmanager
def side_by_side(device: torch.device):
    """Yields ``on_side``: ``with on_side():`` runs its launches on a side stream of ``device``, beside what this
    stream runs in the rest of the block. The side stream first waits for this stream's work so far; this stream
    waits for the side stream's work when the block ends (an error included). The two walks are independent and each
    fills only one CTA per (sequence, value head): side by side they share the GPU. Off CUDA (the launches
    emulated) ``on_side`` does nothing."""
    if device.type != "cuda":
        yield contextlib.nullcontext
        return
    streams = _SIDE.__dict__.setdefault("streams", {})
    side = streams.get(device)
    if side is None:
        side = streams[device] = torch.cuda.Stream(device)
    current = torch.cuda.current_stream(device)
    side.wait_stream(current)
    try:
        yield lambda: torch.cuda.stream(side)
    finally:
        current.wait_stream(side)


def walk_backward(
    kernel: entry.ChunkKernel,
    q,
    k,
    v,
    do,
    g,
    beta,
    scale,
    h0,
    dht,
    cu_seqlens,
    cu_seqlens_cpu,
    state_v_first,
    rows=None,
):
    """A backward on ``kernel``'s walks (:func:`both_walks`), then the per-chunk passes 3 and 4: ``rows(q, k, v, do,
    walks, scale) -> (dq, dk, dv, dg, dbeta or None)``, by default :func:`cula.ops.chunk_backward.rows_backward`
    (reading beta with the delta rule only). Returns ``(dq, dk, dv, dg, dbeta or None, dh0 or None)`` as the passes
    give them (fp32 from ``rows_backward``); ``scale`` None is K^-0.5."""
    scale = q.shape[3] ** -0.5 if scale is None else scale
    q, k, v, do = (x.contiguous() for x in (q, k, v, do))
    w = both_walks(kernel, q, k, v, do, g, beta, scale, h0, dht, cu_seqlens, cu_seqlens_cpu, state_v_first)
    if rows is None:
        rows_beta = beta if kernel.delta_rule else None
        grads = chunk_backward.rows_backward(q, k, v, do, g, rows_beta, w.starts, w.ends, w.index, scale)
    else:
        grads = rows(q, k, v, do, w, scale)
    return (*grads, w.dh0 if h0 is not None else None)
