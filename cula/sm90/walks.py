"""The backward's state walks on the SM90 chunk family (``ChunkFwdConfig.walk``, :mod:`cula.ops.chunk_backward`):
one launch of a variant's chunk kernel that makes no output and stores a bf16 checkpoint per chunk, ``[rows, HV, V,
K]`` (S^T), row ``n ceil(T / C) + c`` for fixed-length rows, ``offsets[n] // C + n + c`` for varlen ones
(:func:`cula.ops.chunk_backward.checkpoint_rows`)."""

from __future__ import annotations

import torch

from cula.sm90 import entry
from cula.sm90.chunk_fwd import ChunkFwdConfig


def state_walk(kernel: entry.ChunkKernel, walk, q, k, v, g, beta, scale, start, cu_seqlens, rows, state_v_first):
    """One walk of ``kernel``: ``(checkpoints [rows, HV, V, K] bf16, the walk's final state [N, HV, K, V] fp32, V-first
    storage with ``state_v_first``)``. ``walk`` "states" on (q, k, v) = the forward's; "state_grads" with dO as v
    (and without the delta rule, q as k: the walk reads only k). ``start``: the state it starts from (h0, or dht), or
    None for zero. Shapes as :class:`cula.sm90.entry.ChunkCall`."""
    B, T, H, D = q.shape
    HV = v.shape[2]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    checkpoints = torch.empty(max(rows, 1), HV, D, D, dtype=torch.bfloat16, device=q.device)
    final = torch.empty(N, HV, D, D, dtype=torch.float32, device=q.device)
    starts = ends = None
    if cu_seqlens is not None:
        cu = cu_seqlens.to(torch.int32)
        starts, ends = cu[:-1], cu[1:]
    if start is not None:
        start = start.contiguous()
    config = ChunkFwdConfig(D, starts is not None, start is not None, delta_rule=kernel.delta_rule, walk=walk)
    call = entry.ChunkCall(q, k, v, g, beta, scale, state_v_first=state_v_first)
    # o is never written in a walk: v stands in for it
    tensors = entry.LaunchTensors(q, k, v, g, beta, v, start, final, starts, ends, w=checkpoints)
    entry.launch(kernel, call, config, tensors, scale)
    return checkpoints, final
