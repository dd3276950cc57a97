"""Simple GLA and Lightning Attention chunked forward for SM100 (:class:`cula.sm100.scalar_chunk_fwd.
ScalarGateChunkFwdSm100`: chunks of 128 tokens, tcgen05 MMAs, the state in tensor memory) and its place in the
host path, which it shares with SM90 (:mod:`cula.sm90.entry`): the same gate preparation (:func:`cula.lightning.
chunk_fwd_sm90.token_gate`), launch arguments, state pools and split passes (a first pass and a correction pass of
the kernel; the transitions the gate's decay, made on the host; cut at multiples of its 128-token chunk, where SM90's
split costs expect a split to pay). It takes D = 64 and 128.

Compiled for sm_100a and sm_103a on any machine; no Blackwell GPU has run it, so dispatch serves it only with
``CULA_UNTESTED_KERNELS=1``.
"""

from __future__ import annotations

import functools

from cula.lightning import chunk_fwd_sm90
from cula.sm90 import entry
from cula.sm100.scalar_chunk_fwd import HEAD_DIMS, ScalarGateChunkFwdSm100, sm100_chunk_kernel

ARCHS = ("sm_100a", "sm_103a")

# Whether :func:`chunk_simple_gla_fwd_sm100` can serve these inputs, and why not
supports = functools.partial(chunk_fwd_sm90.supports, dims=HEAD_DIMS, arch_major=10)

# The kernel for a config (ChunkFwdConfig fields), compiled on any machine for ``arch``
compile_simple_gla_fwd_sm100 = functools.partial(
    chunk_fwd_sm90.compile_simple_gla_fwd_sm90, kernel_class=ScalarGateChunkFwdSm100
)

SIMPLE_GLA_SM100 = sm100_chunk_kernel("simple_gla_sm100", compile_simple_gla_fwd_sm100, chunk_fwd_sm90.split_cost)

# Simple GLA chunked forward on SM100: the arguments of chunk_simple_gla_fwd_sm90; returns (o, final_state, the pool,
# or None)
chunk_simple_gla_fwd_sm100 = functools.partial(chunk_fwd_sm90.chunk_simple_gla_fwd_sm90, kernel=SIMPLE_GLA_SM100)

entry.register_checked(
    "simple_gla_chunk_fwd_sm100",
    compile_simple_gla_fwd_sm100,
    {
        **entry.checked("", "[fixed length]", "[pool]", "[pool, read only]", "[correction]", *entry.WALK_CONFIGS),
        **entry.checked("[D=64]", "[D=64, correction]", "[D=64, states walk]", "[D=64, state-gradient walk]"),
        "[state_v_first]": {"is_varlen": True, "has_initial_state": True, "state_v_first": True},
        "[states walk, fixed length, no start]": {"walk": "states"},
        "[states walk, state_v_first]": {
            "is_varlen": True,
            "has_initial_state": True,
            "walk": "states",
            "state_v_first": True,
        },
    },
    archs=ARCHS,
    expected_ptx=entry.SM100_PTX,
)
