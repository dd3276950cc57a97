"""GLA chunked forward for SM100 (:class:`cula.sm100.key_chunk_fwd.KeyGateChunkFwdSm100`: the scalar-gate SM100
kernel's skeleton with a per-key gate, chunks of 128 tokens, exact for any gate) and its place in the host path, which
it shares with SM90 (:func:`cula.gla.chunk_fwd_sm90.chunk_gla_fwd_sm90`): the same launch arguments without the SM90
kernel's KDA gate parameters, state pools and split passes (a first pass and a correction pass of the kernel; the
transitions the gate's decay, made on the host; cut at multiples of its 128-token chunk). It takes D = 64 and 128.
The backward's state walks run on it too (:func:`cula.gla.chunk_bwd_sm90.chunk_gla_bwd_sm90` with :data:`GLA_SM100`).

Compiled for sm_100a and sm_103a on any machine; no Blackwell GPU has run it, so dispatch serves it only with
``CULA_UNTESTED_KERNELS=1``.
"""

from __future__ import annotations

import functools

from cula.gla import chunk_fwd_sm90
from cula.sm90 import entry
from cula.sm100.key_chunk_fwd import KeyGateChunkFwdSm100
from cula.sm100.scalar_chunk_fwd import HEAD_DIMS, sm100_chunk_kernel

ARCHS = ("sm_100a", "sm_103a")

# Whether :func:`chunk_gla_fwd_sm100` can serve these inputs, and why not
supports = functools.partial(chunk_fwd_sm90.supports, dims=HEAD_DIMS, arch_major=10)

# The kernel for a config (ChunkFwdConfig fields; the forward), compiled on any machine for ``arch``
compile_gla_fwd_sm100 = functools.partial(chunk_fwd_sm90.compile_gla_fwd_sm90, kernel_class=KeyGateChunkFwdSm100)

GLA_SM100 = sm100_chunk_kernel("gla_sm100", compile_gla_fwd_sm100, chunk_fwd_sm90.split_cost)

# GLA chunked forward on SM100: the arguments of chunk_gla_fwd_sm90; returns (o, final_state, the pool, or None)
chunk_gla_fwd_sm100 = functools.partial(chunk_fwd_sm90.chunk_gla_fwd_sm90, kernel=GLA_SM100)

entry.register_checked(
    "gla_chunk_fwd_sm100",
    compile_gla_fwd_sm100,
    {
        **entry.checked("", "[fixed length]", "[pool]", "[pool, read only]", "[correction]", *entry.WALK_CONFIGS),
        **entry.checked("[D=64]", "[D=64, correction]", "[D=64, states walk]", "[D=64, state-gradient walk]"),
        "[state_v_first]": {"is_varlen": True, "has_initial_state": True, "state_v_first": True},
    },
    # at the launch's 128 registers a thread ptxas keeps one or two words in local memory, stored in the prologue and
    # read back in the roles (the count is of the instructions)
    sass_allowed={
        "": (16, 0),
        "[fixed length]": (6, 0),
        "[pool]": (16, 0),
        "[pool, read only]": (6, 0),
        "[D=64]": (19, 0),
        "[state_v_first]": (16, 0),
        "[state-gradient walk]": (4, 0),
        "[D=64, state-gradient walk]": (4, 0),
    },
    archs=ARCHS,
    expected_ptx=entry.SM100_PTX,
)
