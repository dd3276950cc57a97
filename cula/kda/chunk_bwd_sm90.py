"""KDA backward on SM90, the delta rule's plan of :mod:`cula.ops.chunk_backward` with a per-key gate:

1. the state at each chunk's start and 2. the gradient of the state at each chunk's end: KDA's chunk kernel
   (:class:`cula.kda.chunk_fwd_sm90.KDAChunkFwdSm90`) walking the chunks without output
   (:func:`cula.sm90.walks.state_walk`: "states" on (k, v), "state_grads" from the last chunk on (q, k, dO) through
   the transposed chain, the per-key factors in its B tiles), each storing a bf16 checkpoint per chunk; the second
   walk's final state is dh0;
3. and 4. each chunk's gradients from its tokens and the two checkpoints, the WY form recomputed: the kernel
   :class:`cula.sm90.key_delta_chunk_bwd.KeyDeltaChunkBwdSm90` (one CTA per chunk, value head and slab of 64 value
   columns), or with ``CULA_KDA_GRADIENT_KERNEL=0`` batched PyTorch products over the chunk rows
   (:func:`cula.ops.chunk_backward.rows_backward` with the gate bounded as the forward kernel needs it: every
   pair-factor sum by two reference tokens per chunk).

Shapes: q, k [B, T, H, K]; v, do [B, T, HV, V] bf16; g [B, T, HV, K] fp32 (activated, >= -5: the forward kernel's
bound); beta [B, T, HV] fp32; states [N, HV, K, V] fp32 ([N, HV, V, K] with ``state_v_first``).
"""

from __future__ import annotations

import functools
import os

import torch

from cula.kda.chunk_fwd_sm90 import KDA_SM90
from cula.ops import chunk_backward
from cula.sm90 import entry, scalar_chunk_bwd, walks
from cula.sm90.key_delta_chunk_bwd import SLAB, KeyDeltaChunkBwdSm90

# "0": passes 3 and 4 by PyTorch products instead of the per-chunk kernel
ENV_GRADIENT_KERNEL = "CULA_KDA_GRADIENT_KERNEL"


# the kernel of passes 3 and 4, compiled on any machine: (arch, *, head_dim, is_varlen, tile_copies, keep_artifacts)
compile_key_delta_chunk_gradients_sm90 = functools.partial(scalar_chunk_bwd.compile_gradients, KeyDeltaChunkBwdSm90)


def key_delta_chunk_gradients_sm90(q, k, v, do, g, beta, S, dS, chunks, scale, is_varlen):
    """Passes 3 and 4 by the kernel: ``(dq, dk [B, T, H, K] summed over each GVA group, dv, dg [B, T, HV, K], dbeta)``
    in fp32, as :func:`cula.ops.chunk_backward.rows_backward` gives them, the slabs' parts summed; ``chunks`` the
    chunk rows as the kernel reads them (:class:`cula.ops.chunk_backward.ChunkRows`' ``kernel_rows``)."""
    B, T, H, D = q.shape
    HV = v.shape[2]
    assert v.shape[3] == D and D % SLAB == 0, (q.shape, v.shape)  # the slabs and checkpoint tiles take K = V
    slabs = D // SLAB
    fn = scalar_chunk_bwd.compiled("kda_chunk_bwd", KeyDeltaChunkBwdSm90, q.device, D, is_varlen)
    f32 = torch.float32
    dq, dk, dg = (torch.empty(slabs * B, T, HV, D, dtype=f32, device=q.device) for _ in range(3))
    dv = torch.empty(B, T, HV, D, dtype=f32, device=q.device)
    dbeta = torch.empty(slabs * B, T, HV, dtype=f32, device=q.device)
    fn(q, k, v, do, g, beta, S, dS, chunks, dq, dk, dv, dbeta, dg, float(scale))
    if slabs > 1:  # (one slab: its parts are the gradients, no copy)
        dq, dk, dg, dbeta = (x.view(slabs, B, *x.shape[1:]).sum(0) for x in (dq, dk, dg, dbeta))
    if HV != H:
        dq, dk = (x.view(B, T, H, HV // H, D).sum(3) for x in (dq, dk))
    return dq, dk, dv, dg, dbeta


def chunk_kda_bwd_sm90(q, k, v, g, beta, do, scale, initial_state, dht, cu_seqlens, cu_seqlens_cpu, state_v_first):
    """Gradients of KDA's chunked forward with activated fp32 ``g`` and ``beta`` (q and k as the kernel reads them:
    normalised already where the call asks): ``(dq, dk, dv, dg [B, T, HV, K], dbeta, dh0 or None)`` in fp32."""
    g, beta = g.float().contiguous(), beta.float().contiguous()

    if os.environ.get(ENV_GRADIENT_KERNEL, "1") != "0":

        def rows(q, k, v, do, w, scale):
            return key_delta_chunk_gradients_sm90(
                q, k, v, do, g, beta, w.starts, w.ends, w.chunks, scale, cu_seqlens is not None
            )

    else:

        def rows(q, k, v, do, w, scale):
            return chunk_backward.rows_backward(
                q, k, v, do, g, beta, w.starts, w.ends, w.index, scale, bounded_gate=True
            )  # fmt: skip

    return walks.walk_backward(
        KDA_SM90, q, k, v, do, g, beta, scale, initial_state, dht, cu_seqlens, cu_seqlens_cpu, state_v_first, rows
    )


entry.register_checked(
    "kda_chunk_bwd_sm90",
    compile_key_delta_chunk_gradients_sm90,
    {"": {"is_varlen": True}, "[fixed length]": {}, "[D=64]": {"head_dim": 64, "is_varlen": True}},
    expected_ptx=(*entry.SM90_PTX, "stmatrix", "ldmatrix"),
    # measured: long-lived scalars (row addresses, parameters) stored where a stage peaks (the scores' operands, the
    # rows side of the pair gradients holding an accumulator and dg's local term) and reloaded by later stages,
    # outside any loop
    sass_allowed={"": (28, 0), "[fixed length]": (18, 0), "[D=64]": (22, 0)},
)
entry.register_checked(
    "kda_chunk_bwd_sm90",
    compile_key_delta_chunk_gradients_sm90,
    {"[element by element]": {"is_varlen": True, "tile_copies": False}},
    sass_allowed={"[element by element]": (22, 0)},  # measured, as the default's
)
