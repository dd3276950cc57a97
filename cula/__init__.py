"""cuLA: linear-attention kernels for NVIDIA GPUs, a drop-in for flash-linear-attention (FLA 0.6.0).

``from cula.kda import chunk_kda`` replaces ``from fla.ops.kda import chunk_kda``; ``cula.explain(fn, ...)`` says
which backend (CuTe DSL kernel, FLA Triton, PyTorch reference) would serve a call and why; ``with
cula.backend_counts() as counts:`` counts what served each call made in the block.
"""

import os

from cula import gdn, gla, kda, lightning
from cula.dispatch import BackendUnavailableError, Decision, backend_counts, explain, last_decision
from cula.fla_backend import register_with_fla
from cula.ops.context_parallel import build_cp_context

__version__ = "0.1.0"
__all__ = [
    "BackendUnavailableError",
    "Decision",
    "backend_counts",
    "build_cp_context",
    "explain",
    "gdn",
    "gla",
    "kda",
    "last_decision",
    "lightning",
    "register_with_fla",
]

if os.environ.get("CULA_REGISTER_FLA", "0") not in ("", "0"):
    register_with_fla()
