"""Simple GLA and Lightning Attention chunked forward for SM100 (:class:`cula.sm100.scalar_chunk_fwd.
ScalarGateChunkFwdSm100`: chunks of 128 tokens, tcgen05 MMAs, the state in tensor memory) and its place in the
host path, which it shares with SM90 (:mod:`cula.sm90.entry`): the same gate preparation (:func:`cula.lightning.
chunk_fwd_sm90.token_gate`), launch arguments and state pools. It walks every sequence whole (no split passes yet)
and takes D = 128.

Compiled for sm_100a and sm_103a on any machine; no Blackwell GPU has run it, so dispatch serves it only with
``CULA_UNTESTED_KERNELS=1``.
"""

from __future__ import annotations

from cula import runtime
from cula.lightning.chunk_fwd_sm90 import token_gate
from cula.sm90 import entry
from cula.sm90.chunk_fwd import ChunkFwdConfig
from cula.sm100.scalar_chunk_fwd import CHUNK, HEAD_DIM, ScalarGateChunkFwdSm100

ARCHS = ("sm_100a", "sm_103a")


def supports(q, k, v, g=None, g_gamma=None, initial_state=None, cu_seqlens=None, **_) -> tuple[bool, str]:
    """Whether :func:`chunk_simple_gla_fwd_sm100` can serve these inputs, and why not."""
    ok, why = entry.supports_qkv(q, k, v, None, initial_state, cu_seqlens, (HEAD_DIM,), arch_major=10)
    if not ok:
        return ok, why
    if q.shape[2] != v.shape[2]:
        return False, "simple GLA has one value head per q/k head"
    if g is not None and (not g.is_floating_point() or g.shape != v.shape[:3]):
        return False, "g must be a floating-point [B, T, H]"
    if g_gamma is not None and (not g_gamma.is_floating_point() or g_gamma.shape != (v.shape[2],)):
        return False, "g_gamma must be a floating-point [H]"
    return True, ""


def compile_simple_gla_fwd_sm100(arch="sm_100a", *, state_v_first=False, keep_artifacts=False, **config):
    """The kernel for ``config`` (:class:`cula.sm90.chunk_fwd.ChunkFwdConfig` fields; ``delta_rule`` is False),
    compiled on any machine for ``arch``."""
    cfg = ChunkFwdConfig(**{**config, "delta_rule": False})
    fake = entry.fake_args(cfg.head_dim, True, state_v_first, per_key_gate=False, checkpoints=cfg.walk != "output")
    return runtime.compile_kernel(ScalarGateChunkFwdSm100(cfg), fake, arch, keep_artifacts)


SIMPLE_GLA_SM100 = entry.ChunkKernel(
    "simple_gla_sm100",
    lambda arch, config, beta_fp32, state_v_first: compile_simple_gla_fwd_sm100(
        arch, state_v_first=state_v_first, **config.__dict__
    ),
    delta_rule=False,
    chunk=CHUNK,
)


def chunk_simple_gla_fwd_sm100(
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
    out=None,
    final_state_out=None,
    state_slots=None,
    inplace=False,
):
    """Simple GLA chunked forward on SM100, as :func:`cula.lightning.chunk_fwd_sm90.chunk_simple_gla_fwd_sm90` but
    never split. Returns ``(o, final_state, the pool, or None)``."""
    gate = token_gate(g, g_gamma, v)
    call = entry.ChunkCall(
        q.contiguous(), k.contiguous(), v.contiguous(), gate, gate, scale, initial_state, output_final_state,
        cu_seqlens, state_v_first, out, final_state_out, cu_seqlens_cpu, split=False, state_slots=state_slots,
        inplace=inplace,
    )  # fmt: skip
    return entry.chunk_fwd(SIMPLE_GLA_SM100, call)


entry.register_checked(
    "simple_gla_chunk_fwd_sm100",
    compile_simple_gla_fwd_sm100,
    {
        "": {"is_varlen": True, "has_initial_state": True},
        "[fixed length]": {},
        "[pool]": {"is_varlen": True, "has_initial_state": True, "state_slots": "read_write"},
        "[pool, read only]": {"has_initial_state": True, "state_slots": "read"},
        "[state_v_first]": {"is_varlen": True, "has_initial_state": True, "state_v_first": True},
        "[states walk]": {"is_varlen": True, "has_initial_state": True, "walk": "states"},
        "[state-gradient walk]": {"is_varlen": True, "has_initial_state": True, "walk": "state_grads"},
        "[state-gradient walk, fixed length]": {"walk": "state_grads"},
    },
    archs=ARCHS,
    expected_ptx=entry.SM100_PTX,
)
