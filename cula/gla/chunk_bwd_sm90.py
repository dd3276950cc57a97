"""GLA backward on SM90 (and with SM100's walks on SM100), the plan of :mod:`cula.ops.chunk_backward` with a per-key gate:

1. the state at each chunk's start, and 2. the gradient of the state at each chunk's end: GLA's chunk kernel
   (:class:`cula.gla.chunk_fwd_sm90.GLAChunkFwdSm90`) walking the chunks without output (:func:`cula.sm90.walks.
   state_walk`: "states" on (k, v) with K 2^(G_last - G) in the update, "state_grads" from the last chunk on (q, dO)
   with scale Q 2^G), each storing a bf16 checkpoint per chunk; the second walk's final state is dh0;
3. and 4. dq, dk, dv and the gate's gradient per chunk, from the checkpoints: the kernel
   :class:`cula.sm90.key_chunk_bwd.KeyGateChunkBwdSm90` (one CTA per chunk and head), or with
   ``CULA_KEY_GRADIENT_KERNEL=0`` batched PyTorch products over the chunk rows
   (:func:`cula.ops.chunk_backward.rows_backward`, the per-key products by 16-token blocks; 21x slower on an H100 at
   B1 T8192 H64, PERF.md).

Shapes: q, k, v, do [B, T, H, D] bf16; g [B, T, H, D] per-key natural-log gate; states [N, H, K, V] fp32 ([N, H, V,
K] with ``state_v_first``). One value head per q / k head.
"""

from __future__ import annotations

import functools
import os

import torch

from cula.gla.chunk_fwd_sm90 import GLA_SM90
from cula.sm90 import entry, scalar_chunk_bwd, walks
from cula.sm90.key_chunk_bwd import KeyGateChunkBwdSm90

# "0": passes 3 and 4 by PyTorch products instead of the kernel (the SM100 walks always take the PyTorch products)
ENV_GRADIENT_KERNEL = "CULA_KEY_GRADIENT_KERNEL"


# the kernel of passes 3 and 4, compiled on any machine: (arch, *, head_dim, is_varlen, tile_copies, keep_artifacts)
compile_key_chunk_gradients_sm90 = functools.partial(scalar_chunk_bwd.compile_gradients, KeyGateChunkBwdSm90)


def key_chunk_gradients_sm90(q, k, v, do, gate, S, dS, chunks, scale, is_varlen):
    """Passes 3 and 4 by the kernel (:func:`cula.sm90.scalar_chunk_bwd.gradients`): ``(dq, dk, dv in q's dtype, dg
    fp32 [B, T, H, D], None)``, as :func:`cula.ops.chunk_backward.rows_backward` gives them."""
    grads = scalar_chunk_bwd.gradients(
        "gla_chunk_bwd", KeyGateChunkBwdSm90, q, k, v, do, gate, S, dS, chunks, scale, is_varlen
    )
    return *grads, None


def chunk_gla_bwd_sm90(
    q, k, v, g, do, scale, initial_state, dht, cu_seqlens, cu_seqlens_cpu, state_v_first, kernel=GLA_SM90
):
    """Gradients of GLA's chunked forward: ``(dq, dk, dv, dg fp32 [B, T, H, D], dh0 or None)``; ``dht`` the
    gradient into the final state, or None. ``kernel``: whose walks (SM90's, or SM100's
    :data:`cula.gla.chunk_fwd_sm100.GLA_SM100`, chunks of 128); the per-chunk kernel of passes 3 and 4 is SM90's
    only."""
    gate = g.float().contiguous()
    # beta's slot: an unread [B, T, H] tensor, as the forward passes
    unread_beta = torch.empty(v.shape[:3], dtype=torch.float32, device=v.device)
    rows = None
    if os.environ.get(ENV_GRADIENT_KERNEL, "1") != "0" and kernel is GLA_SM90:

        def rows(q, k, v, do, w, scale):
            return key_chunk_gradients_sm90(
                q, k, v, do, gate, w.starts, w.ends, w.chunks, scale, cu_seqlens is not None
            )

    dq, dk, dv, dg, _, dh0 = walks.walk_backward(
        kernel,
        q, k, v, do, gate, unread_beta, scale, initial_state, dht, cu_seqlens, cu_seqlens_cpu, state_v_first, rows,
    )  # fmt: skip
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg, dh0


entry.register_checked(
    "gla_chunk_bwd_sm90",
    compile_key_chunk_gradients_sm90,
    {"": {"is_varlen": True}, "[fixed length]": {}, "[D=64]": {"head_dim": 64, "is_varlen": True}},
    expected_ptx=(*entry.SM90_PTX, "ldmatrix"),
    # measured: the steep path's hoisted shared addresses, stored once and reloaded once, outside any loop
    sass_allowed={"": (24, 0), "[fixed length]": (24, 0)},
)
entry.register_checked(
    "gla_chunk_bwd_sm90",
    compile_key_chunk_gradients_sm90,
    {"[element by element]": {"is_varlen": True, "tile_copies": False}},
)
