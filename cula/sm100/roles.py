"""Warp roles and named barriers of the SM100 chunk kernels.

An SM100 chunk kernel is 16 warps. Warpgroup 0 holds the single-warp roles (TMA loads, the MMA issuer, the gate
scan, and a spare warp); warpgroups 1 to 3 each hold one role whose threads own one row of a 128-lane TMEM
accumulator each (a warp reaches only the TMEM lanes 32 (warp % 4) .. + 31, so these roles start on a warpgroup).
"""

from __future__ import annotations

import enum

WARP = 32
WARPGROUP = 128


class WarpRole(enum.IntEnum):
    """The first warp of each role."""

    LOAD = 0  # TMA loads of the q | k | v stage
    MMA = 1  # issues every tcgen05 MMA; allocates and frees TMEM
    GATE = 2  # the chunk's gate scan into a gate slot
    SPARE = 3
    SCORES = 4  # warpgroup 1: P -> masked, gated bf16 scores; q and k rows scaled in place
    STATE = 8  # warpgroup 2: S^T in TMEM -> its bf16 operand, then the chunk decay in place
    OUTPUT = 12  # warpgroup 3: O from TMEM to global memory


THREADS = 16 * WARP


class Barrier(enum.IntEnum):
    """Named barriers (id 0 is the CTA's ``bar.sync``)."""

    TMEM_ALLOC = 1  # every thread: the TMEM address published by the MMA warp
    TMEM_FREE = 2  # every thread: all TMEM reads and writes done before the MMA warp frees it
    WALK = 3  # the per-key gate's walk (the scores warpgroup): its steep test and a steep chunk's G grid
    # the per-chunk gradient kernel's (cula.sm100.scalar_chunk_bwd)
    GATES = 4  # the gate warp's G and factors, for the three warpgroups
    STATES_READ = 5  # the state sum has read both checkpoints: the scores may go over them
    ROWS = 6  # the row sums of dq and dk, for the gate warp's dg


class GradientRole(enum.IntEnum):
    """The first warp of each role of the per-chunk gradient kernel (:mod:`cula.sm100.scalar_chunk_bwd`): the
    single-warp roles as the chunk kernels', three warpgroups owning a token row each."""

    LOAD = 0  # TMA loads of the chunk's tiles and checkpoints
    MMA = 1  # issues every tcgen05 MMA; allocates and frees TMEM
    GATE = 2  # the chunk's gates, then the gate's gradient
    SCORES = 4  # dP~ and P~, then dv
    QUERIES = 8  # the state sum, then dq
    KEYS = 12  # dk
