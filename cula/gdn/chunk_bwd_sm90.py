"""GDN backward on SM90, the delta rule's plan of :mod:`cula.ops.chunk_backward`:

1. the state at each chunk's start and 2. the gradient of the state at each chunk's end: the GDN kernel's two walks
   (:func:`cula.sm90.walks.state_walk`: "states", and "state_grads" through the transposed chain), each storing a
   bf16 checkpoint per chunk; the second walk's final state is dh0;
3. and 4. each chunk's gradients from its tokens and the two checkpoints, the WY form recomputed: the kernel
   :class:`cula.sm90.delta_chunk_bwd.DeltaChunkBwdSm90` (one CTA per chunk and value head), or with
   ``CULA_DELTA_GRADIENT_KERNEL=0`` batched PyTorch products over the chunk rows
   (:func:`cula.ops.chunk_backward.rows_backward`, 6x slower on an H100 at B1 T8192 H64, PERF.md).

The in-kernel options (q / k L2 norm, the gate from A_log and dt_bias, beta's sigmoid) are applied before the walks
and differentiated through by autograd after them. Shapes: q, k [B, T, H, K]; v, do [B, T, HV, V] bf16; g, beta
[B, T, HV] fp32 (activated); states [N, HV, K, V] fp32 ([N, HV, V, K] with ``state_v_first``).
"""

from __future__ import annotations

import functools
import os

import torch

from cula.ops.gates import GATE_FLOOR
from cula.sm90 import entry, scalar_chunk_bwd
from cula.sm90.delta_chunk_bwd import DeltaChunkBwdSm90

# "0": passes 3 and 4 by PyTorch products instead of the kernel
ENV_GRADIENT_KERNEL = "CULA_DELTA_GRADIENT_KERNEL"


# the kernel of passes 3 and 4, compiled on any machine: (arch, *, head_dim, is_varlen, tile_copies, keep_artifacts)
compile_delta_chunk_gradients_sm90 = functools.partial(scalar_chunk_bwd.compile_gradients, DeltaChunkBwdSm90)


def delta_chunk_gradients_sm90(q, k, v, do, g, beta, S, dS, chunks, scale, is_varlen):
    """Passes 3 and 4 by the kernel: ``(dq, dk [B, T, H, K] summed over each GVA group, dv, dg, dbeta)`` in fp32, as
    :func:`cula.ops.chunk_backward.rows_backward` gives them; ``chunks`` the chunk rows as the kernel
    reads them (:class:`cula.ops.chunk_backward.ChunkRows`' ``kernel_rows``)."""
    B, T, H, D = q.shape
    HV = v.shape[2]
    fn = scalar_chunk_bwd.compiled("delta_chunk_bwd", DeltaChunkBwdSm90, q.device, D, is_varlen)
    dq, dk, dv = (torch.empty(B, T, HV, D, dtype=torch.float32, device=q.device) for _ in range(3))
    dbeta, dg = (torch.empty(B, T, HV, dtype=torch.float32, device=q.device) for _ in range(2))
    fn(q, k, v, do, g, beta, S, dS, chunks, dq, dk, dv, dbeta, dg, float(scale))
    if HV != H:
        dq, dk = (x.view(B, T, H, HV // H, D).sum(3) for x in (dq, dk))
    return dq, dk, dv, torch.where(g < GATE_FLOOR, 0.0, dg), dbeta


def chunk_gdn_bwd_sm90(q, k, v, g, beta, do, scale, initial_state, dht, cu_seqlens, cu_seqlens_cpu, state_v_first):
    """Gradients of GDN's chunked forward with activated fp32 ``g`` and ``beta`` (q and k as the kernel reads them:
    normalised already where the call asks): ``(dq, dk, dv, dg, dbeta, dh0 or None)``."""
    from cula.gdn.chunk_fwd_sm90 import GDN_SM90
    from cula.sm90 import walks

    g, beta = g.float().contiguous(), beta.float().contiguous()
    rows = None
    if os.environ.get(ENV_GRADIENT_KERNEL, "1") != "0":

        def rows(q, k, v, do, w, scale):
            return delta_chunk_gradients_sm90(
                q, k, v, do, g, beta, w.starts, w.ends, w.chunks, scale, cu_seqlens is not None
            )

    return walks.walk_backward(
        GDN_SM90, q, k, v, do, g, beta, scale, initial_state, dht, cu_seqlens, cu_seqlens_cpu, state_v_first, rows
    )


entry.register_checked(
    "gdn_chunk_bwd_sm90",
    compile_delta_chunk_gradients_sm90,
    {"": {"is_varlen": True}, "[fixed length]": {}, "[D=64]": {"head_dim": 64, "is_varlen": True}},
    expected_ptx=(*entry.SM90_PTX, "ldmatrix", "stmatrix"),
)
entry.register_checked(
    "gdn_chunk_bwd_sm90",
    compile_delta_chunk_gradients_sm90,
    {"[element by element]": {"is_varlen": True, "tile_copies": False}},
)
