"""Kimi Delta Attention chunked forward for SM100 (:class:`cula.sm100.key_delta_chunk_fwd.KeyDeltaChunkFwdSm100`: the
SM100 delta-rule kernel with a per-key gate, chunks of 128 tokens, the state in tensor memory) and its place in the
host path, which it shares with SM90 (:mod:`cula.sm90.entry`): launch arguments, state pools, V-first states. What is
KDA's own here: each chunk's Tinv and scores P~, made once per call before its launches (:func:`chunk_intra`), and q
and k normalised there for ``use_qk_l2norm_in_kernel``. g arrives activated (fp32, natural log per key channel);
unlike the SM90 kernel it needs no bound on the gate (the intra-chunk factors are made exactly, the kernel's own are
at most 1 but for K 2^G, which only underflows where its product does). Long sequences split as GDN's on SM100: the
first pass, then transition and correction passes without v, every pass reading the call's workspace. D = 128.

Compiled for sm_100a and sm_103a on any machine; no Blackwell GPU has run it, so dispatch serves it only with
``CULA_UNTESTED_KERNELS=1``.
"""

from __future__ import annotations

import torch

from cula import runtime
from cula.gdn import chunk_fwd_sm100 as gdn_sm100
from cula.ops import chunk_backward
from cula.ops.gates import GATE_FLOOR
from cula.sm90 import entry
from cula.sm90.chunk_fwd import ChunkFwdConfig
from cula.sm100.delta_chunk_fwd import HEAD_DIMS
from cula.sm100.key_delta_chunk_fwd import KeyDeltaChunkFwdSm100
from cula.sm100.scalar_chunk_fwd import CHUNK


def supports(q, k, v, g=None, beta=None, initial_state=None, cu_seqlens=None, **_) -> tuple[bool, str]:
    """Whether :func:`chunk_kda_fwd_sm100` can serve these inputs, and why not (g: fp32, activated)."""
    ok, why = entry.supports_qkv(q, k, v, beta, initial_state, cu_seqlens, HEAD_DIMS, arch_major=10)
    if not ok:
        return ok, why
    if g is not None and (g.dtype != torch.float32 or tuple(g.shape) != (*v.shape[:3], q.shape[-1])):
        return False, "g must be float32 [B, T, HV, K] (activated)"
    return True, ""


def compile_kda_fwd_sm100(arch="sm_100a", *, beta_fp32=True, state_v_first=False, keep_artifacts=False, **config):
    """The kernel for ``config`` (:class:`cula.sm90.chunk_fwd.ChunkFwdConfig` fields; the delta rule, D = 128),
    compiled on any machine for ``arch``; its ``w`` is the Tinv | P~ rows, [B, T, HV, 256] bf16."""
    cfg = ChunkFwdConfig(**config)
    fake = entry.fake_args(
        cfg.head_dim, beta_fp32, state_v_first, per_key_gate=True, config=cfg, gate_params=False,
        workspace_columns=2 * CHUNK,
    )  # fmt: skip
    return runtime.compile_kernel(KeyDeltaChunkFwdSm100(cfg), fake, arch, keep_artifacts)


def prepare(call: entry.ChunkCall) -> entry.ChunkCall:
    """The call as the kernel takes it: q and k L2-normalised (as SM100 GDN's), each chunk's Tinv and P~ made into
    ``workspace`` (:func:`chunk_intra`), which every launch of the call reads."""
    call = gdn_sm100.normalised(call)
    return call._replace(workspace=chunk_intra(call))


# fp32 elements of each batch's temporaries per (chunk, value head): its tokens' rows, the scores and a block's pair
# factors (key_gated_products), the solve
_ELEMENTS_PER_CHUNK = 8 * CHUNK * CHUNK


def chunk_intra(call: entry.ChunkCall) -> torch.Tensor:
    """``[B, T, HV, 256]`` bf16: token t's row of its chunk's Tinv = (I + A)^-1, A = strict_tril(beta_i sum_k k_ik
    k_jk e^(G_ik - G_jk)), then its row of P~ = tril(s sum_k q_ik k_jk e^(G_ik - G_jk)), G the chunk's cumulative
    max(g, floor) per key channel (the kernel's gate); made in fp32 by
    :func:`cula.ops.chunk_backward.key_gated_products` (16-token blocks, exact for any gate) and rounded to bf16;
    columns past the sequence end zero. Chunks of 128 tokens from each sequence's start
    (:func:`cula.sm90.entry.chunk_batches`), in batches whose temporaries stay within GDN's solve bound."""
    B, T, H, K = call.q.shape
    HV = call.v.shape[2]
    C = CHUNK
    dev = call.q.device
    scale = K**-0.5 if call.scale is None else call.scale
    head_of = runtime.host_to_device(torch.arange(HV) // (HV // H), dev)
    q_all, k_all = call.q.reshape(B * T, H, K), call.k.reshape(B * T, H, K)
    beta_all, g_all = call.beta.reshape(B * T, HV), call.g.reshape(B * T, HV, K)
    strict = torch.ones(C, C, dtype=torch.bool, device=dev).tril(-1)
    w = torch.zeros(B * T, HV, 2 * C, dtype=torch.bfloat16, device=dev)
    batch = max(1, gdn_sm100._SOLVE_ELEMENTS // (HV * _ELEMENTS_PER_CHUNK))
    for rows, valid in entry.chunk_batches(call, C, batch):
        n = rows.shape[0]
        inside = valid[..., None, None]
        # selects, not products: the rows past the end hold other tokens (NaN included)
        q, k = (_per_head(torch.where(inside, x[rows][:, :, head_of].float(), 0.0)) for x in (q_all, k_all))
        beta = torch.where(valid[..., None], beta_all[rows].float(), 0.0)
        G = _per_head(torch.where(inside, g_all[rows].float().clamp_min(GATE_FLOOR), 0.0).cumsum(1))
        qk, kk = (chunk_backward.key_gated_products(x, k, None, G, 1.0)[0].view(n, HV, C, C) for x in (q, k))
        tinv = gdn_sm100.chunk_inverse(beta.transpose(1, 2)[..., None] * torch.where(strict, kk, 0.0), valid)
        rows_out = torch.cat((tinv, scale * qk), -1).to(torch.bfloat16).transpose(1, 2)  # [n, C, HV, 2 C]
        w[rows[valid]] = rows_out[valid]
    return w.view(B, T, HV, 2 * C)


def _per_head(x: torch.Tensor) -> torch.Tensor:
    """``[n, C, HV, K]`` as ``[n HV, C, K]``: chunks of one value head each, as key_gated_products takes them."""
    n, C, HV, K = x.shape
    return x.transpose(1, 2).reshape(n * HV, C, K)


# SM100 GDN's split costs: the same chain and passes (no SM100 timing exists; SM90 KDA's are a cached kernel's)
KDA_SM100 = entry.ChunkKernel(
    "kda_sm100", compile_kda_fwd_sm100, split_cost=gdn_sm100.split_cost, chunk=CHUNK, prepare=prepare
)


def chunk_kda_fwd_sm100(*args, **kwargs):
    """KDA chunked forward on SM100: :class:`cula.sm90.entry.ChunkCall`'s fields (q, k, v, g, beta, scale, ... in
    FLA's order), positionally or by name, g activated (fp32 [B, T, HV, K], natural log; no bound). Returns ``(o,
    final_state or None)``."""
    call = entry.ChunkCall(*args, **kwargs)
    if call.gate is not None or call.g.dtype != torch.float32:
        raise TypeError("the SM100 KDA kernel takes g activated (float32): apply the gate before the call")
    return entry.chunk_fwd(KDA_SM100, call)


entry.register_checked(
    "kda_chunk_fwd_sm100", compile_kda_fwd_sm100, gdn_sm100.CHECKED, archs=gdn_sm100.ARCHS, expected_ptx=entry.SM100_PTX
)
