"""Simple GLA and Lightning Attention chunked forward for SM90: the family's scalar-gate kernel without the delta rule
(:class:`cula.sm90.scalar_chunk_fwd.ScalarGateChunkFwdSm90` with ``delta_rule=False``: no beta, no solve,
V_new = V) and their place in the SM90 host path.

Math per chunk (state S is K x V; G the cumulative log gate inside the chunk):

    O  = scale (Q * exp(G)) S + tril(scale Q K^T * exp(G_i - G_j)) V
    S <- exp(G_last) S + (K * exp(G_last - G))^T V

The kernel takes one fp32 log gate per token and head: simple GLA's ``g`` plus its per-head ``g_gamma`` (Lightning's
decay is such a ``g_gamma``), summed on the host (:func:`token_gate`). Shapes as :mod:`cula.sm90.chunk_fwd`, H = HV.
"""

from __future__ import annotations

import torch

from cula import devices
from cula.ops import segment_split
from cula.sm90 import entry, scalar_chunk_fwd

SUPPORTED_DIMS = (64, 128)


def supports(
    q, k, v, g=None, g_gamma=None, initial_state=None, cu_seqlens=None, dims=SUPPORTED_DIMS, arch_major=9, **_
) -> tuple[bool, str]:
    """Whether :func:`chunk_simple_gla_fwd_sm90` can serve these inputs, and why not (``dims`` and ``arch_major``:
    the head dims and GPU architecture of the kernel asked, SM90's by default)."""
    ok, why = entry.supports_qkv(q, k, v, None, initial_state, cu_seqlens, dims, arch_major)
    if not ok:
        return ok, why
    if q.shape[2] != v.shape[2]:
        return False, "simple GLA has one value head per q/k head"
    if g is not None and (not g.is_floating_point() or g.shape != v.shape[:3]):
        return False, "g must be a floating-point [B, T, H]"
    if g_gamma is not None and (not g_gamma.is_floating_point() or g_gamma.shape != (v.shape[2],)):
        return False, "g_gamma must be a floating-point [H]"
    return True, ""


def token_gate(g: torch.Tensor | None, g_gamma: torch.Tensor | None, v: torch.Tensor) -> torch.Tensor:
    """The kernel's log gate, fp32 [B, T, H]: ``g`` plus ``g_gamma`` per head (zero where both are None), made in
    one pass over the tokens."""
    if g is None and g_gamma is None:
        return torch.zeros(v.shape[:3], dtype=torch.float32, device=v.device)
    if g is None:
        return g_gamma.float().expand(v.shape[:3]).contiguous()
    gate = g.float() if g_gamma is None else g.float() + g_gamma.float()
    return gate.contiguous()


def split_cost(call: entry.ChunkCall) -> segment_split.SplitCost:
    """The split passes' costs: GDN's measured ones (no split pass of this kernel has been timed; its correction pass,
    without P and the update, costs less), uncached: the later passes carry no V (they need neither Tinv nor P); no
    transition pass (the token gate's decay, made on the host)."""
    return devices.times_for(call.q.device).kernels["gdn"].split._replace(cached=False, transition=0.0)


def compile_simple_gla_fwd_sm90(arch="sm_90a", **options):
    """The family's scalar-gate kernel without the delta rule (:func:`cula.sm90.scalar_chunk_fwd.compile_fwd`'s
    options): beta's slot is never read, fp32 as the gate that fills it at launch."""
    return scalar_chunk_fwd.compile_fwd(arch, **{**options, "delta_rule": False})


SIMPLE_GLA_SM90 = entry.ChunkKernel(
    "simple_gla",
    compile_simple_gla_fwd_sm90,
    split_cost=split_cost,
    delta_rule=False,
    gate_transition=True,
    splits_values="where they pay",
)


def chunk_simple_gla_fwd_sm90(
    q,
    k,
    v,
    g=None,
    g_gamma=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    state_v_first=False,
    cu_seqlens_cpu=None,
    split=None,
    out=None,
    final_state_out=None,
    state_slots=None,
    inplace=False,
    kernel=SIMPLE_GLA_SM90,
):
    """Simple GLA chunked forward on SM90: q, k, v [B, T, H, D] bf16; g [B, T, H] and / or g_gamma [H] log gates
    (either may be None); the rest as :class:`cula.sm90.entry.ChunkCall`. Returns ``(o, final_state, the pool, or
    None)``. ``kernel``: another architecture's kernel on the same host path (SM100's)."""
    gate = token_gate(g, g_gamma, v)
    # beta's slot carries the gate too: never read without the delta rule, it gives the launch its [B, T, HV]
    call = entry.ChunkCall(
        q.contiguous(), k.contiguous(), v.contiguous(), gate, gate, scale, initial_state, output_final_state,
        cu_seqlens, state_v_first, out, final_state_out, cu_seqlens_cpu, split, state_slots=state_slots,
        inplace=inplace,
    )  # fmt: skip
    return entry.chunk_fwd(kernel, call)


entry.register_checked(
    "simple_gla_chunk_fwd_sm90",
    compile_simple_gla_fwd_sm90,
    entry.checked(
        "",
        "[fixed length]",
        "[pool, read only]",
        "[bf16 pool]",
        "[D=64]",
        "[correction]",
        *entry.WALK_CONFIGS,
        "[D=64, state-gradient walk]",
        "[D=64, correction]",
        *entry.VALUE_BLOCK_CONFIGS,
    ),  # fmt: skip
)
