"""Gated DeltaNet chunked-prefill forward for SM90: the family's scalar-gate kernel
(:class:`cula.sm90.scalar_chunk_fwd.ScalarGateChunkFwdSm90`, with the delta rule) and GDN's place in the SM90 host
path: what it supports, its time model, its compile-checked configurations.

Shapes as :mod:`cula.sm90.chunk_fwd`; g [B, T, HV] fp32 (activated natural-log gate).
"""

from __future__ import annotations

import torch

from cula import devices
from cula.ops import segment_split
from cula.sm90 import entry, scalar_chunk_fwd

SUPPORTED_DIMS = (64, 128)
# The kernel's time model (its time per chunk, its split passes' costs) is in cula/devices.py, per GPU.


def supports(
    q, k, v, g=None, beta=None, initial_state=None, cu_seqlens=None, dims=SUPPORTED_DIMS, arch_major=9, **_
) -> tuple[bool, str]:
    """Whether :func:`chunk_gated_delta_rule_fwd_sm90` (or with ``dims`` and ``arch_major`` another architecture's
    kernel of GDN's launch arguments) can serve these inputs, and why not."""
    ok, why = entry.supports_qkv(q, k, v, beta, initial_state, cu_seqlens, dims, arch_major)
    if not ok:
        return ok, why
    if g is not None and (g.dtype != torch.float32 or g.shape != v.shape[:3]):
        return False, "g must be float32 [B, T, HV]"
    return True, ""


def time_model(qk_l2norm: bool) -> str:
    """The name of the kernel's time model in :data:`cula.devices.KERNELS` for these options: with qk_l2norm the
    norms cost a little per chunk."""
    return "gdn_l2norm" if qk_l2norm else "gdn"


def split_cost(call: entry.ChunkCall) -> segment_split.SplitCost:
    """The split passes' costs on the call's GPU (:func:`cula.devices.times_for`)."""
    return devices.times_for(call.q.device).kernels[time_model(call.qk_l2norm)].split


# The GDN chunk kernel for a config (ChunkFwdConfig fields; the delta rule), compiled on any machine for ``arch``
compile_gdn_fwd_sm90 = scalar_chunk_fwd.compile_fwd


GDN_SM90 = entry.ChunkKernel(
    "gdn",
    compile_gdn_fwd_sm90,
    split_cost=split_cost,
    # an H100 timed B1 T8192 H64 at 0.340 ms so against 0.415 split in two, B2 T16384 H64 (two waves) 1.357 against 0.900
    splits_values="where they pay",
)


def chunk_gated_delta_rule_fwd_sm90(*args, kernel=GDN_SM90, **kwargs):
    """GDN chunked forward on SM90: :class:`cula.sm90.entry.ChunkCall`'s fields (q, k, v, g, beta, scale, ... in
    FLA's order), positionally or by name; no ``gate``. Returns ``(o, final_state or None)``. ``kernel``: another
    architecture's kernel on the same host path (SM100's)."""
    return entry.chunk_fwd(kernel, entry.ChunkCall(*args, **kwargs))


entry.register_checked(
    "gdn_chunk_fwd_sm90",
    compile_gdn_fwd_sm90,
    {
        **entry.checked(
            *entry.DELTA_CONFIGS,
            *entry.WALK_CONFIGS,
            "[D=64, state-gradient walk]",
            *entry.VALUE_BLOCK_CONFIGS,
            "[value blocks, qk_l2norm]",
        ),
        "[D=64, qk_l2norm, intra load, correction]": {
            "head_dim": 64,
            "is_varlen": True,
            "mode": "correction",
            "intra": "load",
            "qk_l2norm": True,
        },
    },  # fmt: skip
    # measured: the later split pass's state warpgroups (192 registers) reload a few loop invariants each chunk
    sass_allowed={"[intra load, correction]": (11, 0)},
)
