"""The hand-offs between the roles of a chunk kernel, as ``cutlass.pipeline`` rings of shared-memory stages.

Each ring is a full / empty mbarrier pair per stage, walked with ``PipelineState`` (stage index and phase): the
producer acquires a stage (waits until its last consumers released it), fills it and commits; consumers wait until
it is full, read it and release it. Two kinds:

- :func:`tma_ring`: filled by TMA (one thread arms the stage with its byte count, the copies complete it); released
  by one lane per consumer warp, so its consumers are counted in warps.
- :func:`thread_ring`: filled by a role's threads, every one of which commits; released by every consumer thread.

A role that only needs to know that a stage is full (it neither fills nor releases it) may wait on it as well: the
stage cannot be refilled before its counted consumers release it. Rings are made with ``defer_sync``: the kernel
fences and synchronises once after making all of them (:func:`rings_made`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import pipeline
from cutlass.pipeline import Agent, CooperativeGroup, PipelineUserType


def ring_storage(stages: int):
    """The shared-memory field of a ring of ``stages`` (full and empty barriers), for a ``cute.struct``."""
    return cute.struct.MemRange[cutlass.Int64, 2 * stages]


def tma_ring(barriers, stages: int, tx_bytes: int, consumer_warps: int):
    """A ring filled by TMA: ``tx_bytes`` per stage, released by ``consumer_warps`` warps."""
    return pipeline.PipelineTmaAsync.create(
        num_stages=stages,
        producer_group=CooperativeGroup(Agent.Thread, 1),
        consumer_group=CooperativeGroup(Agent.Thread, consumer_warps),
        tx_count=tx_bytes,
        barrier_storage=barriers.data_ptr(),
        defer_sync=True,
    )


def thread_ring(barriers, stages: int, producer_threads: int, consumer_threads: int):
    """A ring filled and committed by ``producer_threads`` threads, released by ``consumer_threads`` threads."""
    return pipeline.PipelineAsync.create(
        num_stages=stages,
        producer_group=CooperativeGroup(Agent.Thread, producer_threads),
        consumer_group=CooperativeGroup(Agent.Thread, consumer_threads),
        barrier_storage=barriers.data_ptr(),
        defer_sync=True,
    )


def rings_made():
    """After every ring is made (its barriers initialised by warp 0): fence the inits and synchronise the CTA."""
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()


def producer_start(stages: int):
    """A producer's position in a ring: stage 0, in the phase where every stage is free."""
    return pipeline.make_pipeline_state(PipelineUserType.Producer, stages)


def consumer_start(stages: int):
    """A consumer's position in a ring: stage 0, waiting for its first fill."""
    return pipeline.make_pipeline_state(PipelineUserType.Consumer, stages)
