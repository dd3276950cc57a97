"""Gated DeltaNet chunked forward for SM100 (:class:`cula.sm100.delta_chunk_fwd.DeltaChunkFwdSm100`: the SM100
scalar-gate kernel with the delta rule, chunks of 128 tokens, the state in tensor memory) and its place in the host
path, which it shares with SM90 (:mod:`cula.sm90.entry`): launch arguments, state pools, V-first states. What is
GDN's own here: each chunk's Tinv, made once per call on the host before its launches (:func:`chunk_inverses`),
and q and k normalised there for ``use_qk_l2norm_in_kernel`` (the kernel has no norm role). Long sequences split as
on SM90: the first pass, then transition and correction passes of the same kernel without v (uncached: each makes
its chunks' P again; every pass reads the call's inverses), cut at multiples of its 128-token chunk where SM90's GDN
split costs expect a split to pay. D = 128.

Compiled for sm_100a and sm_103a on any machine; no Blackwell GPU has run it, so dispatch serves it only with
``CULA_UNTESTED_KERNELS=1``.
"""

from __future__ import annotations

import functools

import torch

from cula import runtime
from cula.gdn import chunk_fwd_sm90
from cula.ops import segment_split
from cula.ops.gates import GATE_FLOOR, l2norm
from cula.sm90 import entry
from cula.sm90.chunk_fwd import ChunkFwdConfig
from cula.sm100.delta_chunk_fwd import HEAD_DIMS, DeltaChunkFwdSm100
from cula.sm100.scalar_chunk_fwd import CHUNK

ARCHS = ("sm_100a", "sm_103a")


# Whether :func:`chunk_gated_delta_rule_fwd_sm100` can serve these inputs, and why not
supports = functools.partial(chunk_fwd_sm90.supports, dims=HEAD_DIMS, arch_major=10)


def compile_gdn_fwd_sm100(arch="sm_100a", *, beta_fp32=True, state_v_first=False, keep_artifacts=False, **config):
    """The kernel for ``config`` (:class:`cula.sm90.chunk_fwd.ChunkFwdConfig` fields; the delta rule, D = 128),
    compiled on any machine for ``arch``; its ``w`` is the inverses, [B, T, HV, 128] bf16."""
    cfg = ChunkFwdConfig(**config)
    fake = entry.fake_args(
        cfg.head_dim, beta_fp32, state_v_first, per_key_gate=False, config=cfg, workspace_columns=CHUNK
    )
    return runtime.compile_kernel(DeltaChunkFwdSm100(cfg), fake, arch, keep_artifacts)


def normalised(call: entry.ChunkCall) -> entry.ChunkCall:
    """The call with q and k L2-normalised where it asks for it (in fp32, rounded to bf16 as the SM90 kernels' norm
    warps round their operands): the SM100 delta-rule kernels have no norm role."""
    if not call.qk_l2norm:
        return call
    q, k = (l2norm(x.float()).to(x.dtype) for x in (call.q, call.k))
    return call._replace(q=q, k=k, qk_l2norm=False)


def prepare(call: entry.ChunkCall) -> entry.ChunkCall:
    """The call as the kernel takes it: q and k normalised (:func:`normalised`); each chunk's inverse made into
    ``workspace`` (:func:`chunk_inverses`), which every launch of the call reads."""
    call = normalised(call)
    return call._replace(workspace=chunk_inverses(call))


def split_cost(call: entry.ChunkCall) -> segment_split.SplitCost:
    """SM90 GDN's split costs (no SM100 timing exists), its passes uncached: each makes its chunks' P again."""
    return chunk_fwd_sm90.split_cost(call)._replace(cached=False)


# fp32 elements of each of the solve's (chunks, HV, C, C) temporaries: the chunks are solved this many at a time
_SOLVE_ELEMENTS = 1 << 26


def chunk_inverses(call: entry.ChunkCall) -> torch.Tensor:
    """``[B, T, HV, 128]`` bf16: token t's row of its chunk's Tinv = (I + A)^-1, A = strict_tril(beta_i (k_i . k_j)
    e^(G_i - G_j)) with G the chunk's cumulative max(g, floor) (the kernel's gate), solved in fp32 and rounded to bf16;
    columns past the sequence end zero. Chunks of 128 tokens from each sequence's start
    (:func:`cula.sm90.entry.chunk_batches`), solved in batches of chunks (each batch's temporaries at most
    :data:`_SOLVE_ELEMENTS` fp32 elements)."""
    B, T, H, K = call.q.shape
    HV = call.v.shape[2]
    dev = call.q.device
    head_of = runtime.host_to_device(torch.arange(HV) // (HV // H), dev)
    k_all, beta_all, g_all = call.k.reshape(B * T, H, K), call.beta.reshape(B * T, HV), call.g.reshape(B * T, HV)
    strict = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=dev).tril(-1)
    w = torch.zeros(B * T, HV, CHUNK, dtype=torch.bfloat16, device=dev)
    for rows, valid in entry.chunk_batches(call, CHUNK, max(1, _SOLVE_ELEMENTS // (HV * CHUNK * CHUNK))):
        k = k_all[rows][:, :, head_of].float()  # [chunks, C, HV, K]
        beta = torch.where(valid[..., None], beta_all[rows].float(), 0.0)
        g = torch.where(valid[..., None], g_all[rows].float().clamp_min(GATE_FLOOR), 0.0)
        G = g.cumsum(1).transpose(1, 2)  # [chunks, HV, C]
        # masks as selects: the factors above the diagonal may overflow
        decay = torch.where(strict, torch.exp(torch.where(strict, G[..., :, None] - G[..., None, :], 0.0)), 0.0)
        A = beta.transpose(1, 2)[..., None] * torch.einsum("nihd,njhd->nhij", k, k) * decay
        tinv = chunk_inverse(A, valid).to(torch.bfloat16)  # [chunks, HV, i, j]
        w[rows[valid]] = tinv.transpose(1, 2)[valid]
    return w.view(B, T, HV, CHUNK)


def chunk_inverse(A: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Tinv = (I + A)^-1 of each chunk's strictly lower ``A`` [chunks, HV, C, C] in fp32 (a triangular solve), its
    columns past the sequence end (``valid`` [chunks, C]: the chunk's tokens in their sequence) zero."""
    eye = torch.eye(A.shape[-1], device=A.device)
    return torch.where(valid[:, None, None, :], torch.linalg.solve_triangular(eye + A, eye, upper=False), 0.0)


GDN_SM100 = entry.ChunkKernel("gdn_sm100", compile_gdn_fwd_sm100, split_cost=split_cost, chunk=CHUNK, prepare=prepare)


# GDN chunked forward on SM100: the arguments of chunk_gated_delta_rule_fwd_sm90; returns (o, final_state or None)
chunk_gated_delta_rule_fwd_sm100 = functools.partial(chunk_fwd_sm90.chunk_gated_delta_rule_fwd_sm90, kernel=GDN_SM100)


# the compile check's configurations of an SM100 delta-rule kernel (GDN's, KDA's)
CHECKED = {
    **entry.checked("", "[fixed length]", "[pool]", "[pool, read only]", "[transition]", "[correction]"),
    "[state_v_first]": {"is_varlen": True, "has_initial_state": True, "state_v_first": True},
}

entry.register_checked("gdn_chunk_fwd_sm100", compile_gdn_fwd_sm100, CHECKED, archs=ARCHS, expected_ptx=entry.SM100_PTX)
