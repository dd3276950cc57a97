"""Simple GLA and Lightning backward on SM100: the plan of :mod:`cula.lightning.chunk_bwd_sm90` with the SM100 kernel's
state walks (chunks of 128, :data:`cula.lightning.chunk_fwd_sm100.SIMPLE_GLA_SM100`) and passes 3 and 4 by
:class:`cula.sm100.scalar_chunk_bwd.ScalarGateChunkBwdSm100` (one CTA per chunk row of 128 tokens and head;
``CULA_CHUNK_GRADIENT_KERNEL=0``: PyTorch rows instead). Compiled for sm_100a and sm_103a on any machine; no
Blackwell GPU has run it, so dispatch serves it only with ``CULA_UNTESTED_KERNELS=1``.
"""

from __future__ import annotations

import functools

from cula.sm90 import entry, scalar_chunk_bwd
from cula.sm100.scalar_chunk_bwd import ScalarGateChunkBwdSm100

ARCHS = ("sm_100a", "sm_103a")

# the kernel of passes 3 and 4, compiled on any machine: (arch, *, head_dim, is_varlen, tile_copies, keep_artifacts)
compile_chunk_gradients_sm100 = functools.partial(scalar_chunk_bwd.compile_gradients, ScalarGateChunkBwdSm100)

entry.register_checked(
    "simple_gla_chunk_bwd_sm100",
    compile_chunk_gradients_sm100,
    {"": {"is_varlen": True}, "[fixed length]": {}, "[D=64]": {"head_dim": 64, "is_varlen": True}},
    archs=ARCHS,
    expected_ptx=entry.SM100_PTX,
)
