"""Host-side pieces shared by the SM90 chunked-forward entries of the delta-rule family (GDN, KDA): the input
checks both kernels make, the fake tensors they are compiled with, and a placeholder int32 tensor for unused
range arguments."""

import torch

from cula import runtime

_DUMMY: dict = {}


def supports_qkv(q, k, v, beta, initial_state, cu_seqlens, dims) -> tuple[bool, str]:
    """The checks of both kernels' ``supports`` except the gate's: device, dtypes, shapes, head dims in ``dims``
    (K = V), GVA, contiguity, beta, varlen batch, fp32 initial state."""
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return False, "tensors are not on a CUDA device"
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return False, f"needs an SM90 (compute capability 9.0) GPU, got {torch.cuda.get_device_capability(q.device)}"
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        return False, f"q, k, v must be bfloat16 (got {q.dtype}, {k.dtype}, {v.dtype})"
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        return False, "expected q, k [B, T, H, K] and v [B, T, HV, V]"
    K, V, H, HV = q.shape[-1], v.shape[-1], q.shape[2], v.shape[2]
    if K not in dims or V not in dims or K != V:
        return False, f"head dims K={K}, V={V} not supported (supported: K = V in {dims})"
    if HV % H != 0:
        return False, f"HV={HV} must be a multiple of H={H}"
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        return False, "q, k, v must be contiguous"
    if beta is not None and (beta.dtype not in (torch.float32, torch.bfloat16) or beta.shape != v.shape[:3]):
        return False, "beta must be float32 or bfloat16 [B, T, HV]"
    if cu_seqlens is not None and q.shape[0] != 1:
        return False, "varlen (cu_seqlens) needs B == 1"
    if initial_state is not None and initial_state.dtype != torch.float32:
        return False, "initial_state must be float32"
    return True, ""


def fake_io(D: int, beta_fp32: bool, state_v_first: bool, per_key_gate: bool) -> tuple:
    """Fake ``q, k, v, g, beta, o, h0, ht`` for compiling a chunk kernel: q, k [B, T, H, D], v and o [B, T, HV, D]
    bf16; g [B, T, HV] (or [B, T, HV, D] with ``per_key_gate``) fp32; beta fp32 or bf16; the states (N, HV, K, V)
    fp32, stored [N, HV, V, K] (K contiguous) with ``state_v_first``. Batch, length and head counts symbolic."""
    import cutlass

    sym = runtime.sym_int
    B, T, H, HV, N = sym(), sym(), sym(), sym(), sym()
    bf16 = cutlass.BFloat16
    state_order = (3, 2, 0, 1) if state_v_first else None
    g = (
        runtime.fake_tensor(cutlass.Float32, (B, T, HV, D))
        if per_key_gate
        else runtime.fake_tensor(cutlass.Float32, (B, T, HV), align=4)
    )
    return (
        runtime.fake_tensor(bf16, (B, T, H, D)),
        runtime.fake_tensor(bf16, (B, T, H, D)),
        runtime.fake_tensor(bf16, (B, T, HV, D)),
        g,
        runtime.fake_tensor(cutlass.Float32 if beta_fp32 else bf16, (B, T, HV), align=2),
        runtime.fake_tensor(bf16, (B, T, HV, D)),
        runtime.fake_tensor(cutlass.Float32, (N, HV, D, D), state_order),
        runtime.fake_tensor(cutlass.Float32, (N, HV, D, D), state_order),
    )


def dummy_i32(device) -> torch.Tensor:
    """A one-element int32 tensor on ``device`` for a kernel's unused int32 arguments (made once per device)."""
    t = _DUMMY.get(device)
    if t is None:
        t = _DUMMY[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return t
