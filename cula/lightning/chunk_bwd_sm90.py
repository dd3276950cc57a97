"""Simple GLA and Lightning Attention backward on SM90 (and with SM100's walks on SM100), the plan of
:mod:`cula.ops.chunk_backward`:

1. the state at each chunk's start, and 2. the gradient of the state at each chunk's end: the family's scalar-gate
   kernel walking the chunks without output (:func:`cula.sm90.walks.state_walk`: "states" on (k, v), "state_grads"
   from the last chunk on (q, do)), each storing a bf16 checkpoint per chunk; the second walk's final state is dh0;
3. and 4. dq, dk, dv and the gate's gradient per chunk, from the checkpoints: the kernel
   :class:`cula.sm90.scalar_chunk_bwd.ScalarGateChunkBwdSm90` (one CTA per chunk and head; after SM100's walks
   :class:`cula.sm100.scalar_chunk_bwd.ScalarGateChunkBwdSm100`, :mod:`cula.lightning.chunk_bwd_sm100`), or with
   ``CULA_CHUNK_GRADIENT_KERNEL=0`` batched PyTorch products over the chunk rows
   (:func:`cula.ops.chunk_backward.rows_backward`, 17x slower on an H100 at B1 T8192 H64, PERF.md).

Shapes: q, k, v, do [B, T, H, D] bf16; the gate fp32 [B, T, H] (:func:`cula.lightning.chunk_fwd_sm90.token_gate`);
states [N, H, K, V] fp32 ([N, H, V, K] with ``state_v_first``). One value head per q / k head.
"""

from __future__ import annotations

import functools
import os

import torch

from cula.lightning.chunk_fwd_sm90 import SIMPLE_GLA_SM90
from cula.ops.gates import GATE_FLOOR
from cula.sm90 import entry, scalar_chunk_bwd, walks
from cula.sm90.scalar_chunk_bwd import ScalarGateChunkBwdSm90

# "0": passes 3 and 4 by PyTorch products instead of the kernel
ENV_GRADIENT_KERNEL = "CULA_CHUNK_GRADIENT_KERNEL"


# the kernel of passes 3 and 4, compiled on any machine: (arch, *, head_dim, is_varlen, tile_copies, keep_artifacts)
compile_chunk_gradients_sm90 = functools.partial(scalar_chunk_bwd.compile_gradients, ScalarGateChunkBwdSm90)


def chunk_gradients_sm90(q, k, v, do, gate, S, dS, chunks, scale, is_varlen, kernel_class=ScalarGateChunkBwdSm90):
    """Passes 3 and 4 by the kernel (:func:`cula.sm90.scalar_chunk_bwd.gradients`; ``kernel_class`` SM90's or, on
    chunk rows of 128, SM100's :class:`cula.sm100.scalar_chunk_bwd.ScalarGateChunkBwdSm100`): ``(dq, dk, dv, dgate
    fp32 [B, T, H])``, as :func:`cula.ops.chunk_backward.rows_backward` gives them; gates below the floor take no
    gradient."""
    # (cached by the device's architecture too: one name serves both classes)
    dq, dk, dv, dgate = scalar_chunk_bwd.gradients(
        "simple_gla_chunk_bwd", kernel_class, q, k, v, do, gate, S, dS, chunks, scale, is_varlen
    )
    return dq, dk, dv, torch.where(gate < GATE_FLOOR, 0.0, dgate)


def gradient_kernel(kernel):
    """The per-chunk gradient kernel for the state walks of ``kernel``: SM90's, or for SM100's walks (chunks of 128)
    SM100's."""
    if kernel is SIMPLE_GLA_SM90:
        return ScalarGateChunkBwdSm90
    from cula.lightning.chunk_fwd_sm100 import SIMPLE_GLA_SM100
    from cula.sm100.scalar_chunk_bwd import ScalarGateChunkBwdSm100

    assert kernel is SIMPLE_GLA_SM100, kernel.name
    return ScalarGateChunkBwdSm100


def chunk_simple_gla_bwd_sm90(
    q, k, v, gate, do, scale, initial_state, dht, cu_seqlens, cu_seqlens_cpu, state_v_first, kernel=SIMPLE_GLA_SM90
):
    """Gradients of simple GLA's chunked forward with the kernel's fp32 token gate ``gate``: ``(dq, dk, dv, dgate
    fp32 [B, T, H], dh0 or None)``; ``dht`` the gradient into the final state, or None. ``kernel``: whose walks
    (SM90's, or SM100's :data:`cula.lightning.chunk_fwd_sm100.SIMPLE_GLA_SM100`, chunks of 128); passes 3 and 4 by
    the per-chunk kernel of the same architecture (:func:`gradient_kernel`)."""
    rows = None
    if os.environ.get(ENV_GRADIENT_KERNEL, "1") != "0":
        kernel_class = gradient_kernel(kernel)

        def rows(q, k, v, do, w, scale):
            grads = chunk_gradients_sm90(
                q, k, v, do, gate, w.starts, w.ends, w.chunks, scale, cu_seqlens is not None, kernel_class
            )  # fmt: skip
            return *grads, None

    # beta's slot carries the gate (never read without the delta rule)
    dq, dk, dv, dgate, _, dh0 = walks.walk_backward(
        kernel, q, k, v, do, gate, gate, scale, initial_state, dht, cu_seqlens, cu_seqlens_cpu, state_v_first, rows
    )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dgate, dh0


entry.register_checked(
    "simple_gla_chunk_bwd_sm90",
    compile_chunk_gradients_sm90,
    {"": {"is_varlen": True}, "[fixed length]": {}, "[D=64]": {"head_dim": 64, "is_varlen": True}},
    expected_ptx=(*entry.SM90_PTX, "ldmatrix"),
)
entry.register_checked(
    "simple_gla_chunk_bwd_sm90",
    compile_chunk_gradients_sm90,
    {"[element by element]": {"is_varlen": True, "tile_copies": False}},
)
