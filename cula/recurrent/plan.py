"""What a variant's fused-recurrent call gives the token-by-token kernel (:class:`Gates`), whether the kernel can
serve it (:func:`supports`), its compile-time configuration (:func:`config_for`), and the kernel as a dispatch
backend (:func:`recurrent_kernel`). Each variant's ``api`` module maps its arguments onto :class:`Gates` and registers
the kernel on its fused-recurrent entry point. No CuTe DSL import here: the launch (:mod:`cula.recurrent.fwd_sm90`)
is imported on the first call a kernel serves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cula import runtime, validation
from cula.dispatch import CuteKernel

SUPPORTED_DIMS = (64, 128)
MAX_SEQUENCES = 65535  # CUDA's limit on a launch grid's z size: sequence n is grid row n
_IO_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_STATE_DTYPES = (torch.float32, torch.bfloat16)
_TORCH_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_TORCH_NAMES.update({torch.int32: "int32", torch.int64: "int64"})
# Value columns per CTA: 64 where every SM still gets a CTA (fewer CTAs repeat the token's staging less), else 32; 8
# state elements per thread and row for a 16-bit V-first state, else 4 (timed on an H100: PERF.md, decode).
WIDE_BLOCK_V, NARROW_BLOCK_V = 64, 32
DEFAULT_SMS = 132  # where the call's tensors are not on a CUDA device (compile checks, CPU tests)


@dataclass(frozen=True)
class Gates:
    """A call's gates and delta rule as the kernel takes them (all tensors as the caller gave them, [B, T, HV, ...]).

    ``g`` per-token scalar log gate, raw (GDN's activation applied by the kernel) when ``g_kind`` is "gdn";
    ``g_gamma`` [HV] per-head log gate; ``gk`` per-key log gate, raw when ``gk_kind`` is one of KDA's activations;
    ``gv`` per-value log gate; ``beta`` [B, T, HV] (the delta rule; ``delta_rule`` without it: beta = 1);
    ``A_log``, ``dt_bias``, ``lower_bound`` the activations' parameters."""

    g: torch.Tensor | None = None
    g_kind: str = "log"
    g_gamma: torch.Tensor | None = None
    gk: torch.Tensor | None = None
    gk_kind: str = "log"
    gv: torch.Tensor | None = None
    delta_rule: bool = False
    beta: torch.Tensor | None = None
    beta_sigmoid: bool = False
    neg_eigval: bool = False
    qk_l2norm: bool = False
    A_log: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    lower_bound: float | None = None


def supports(args: dict[str, Any], gates: Gates) -> tuple[bool, str]:
    """Whether the kernel can serve this fused-recurrent call, and why not."""
    q, k, v = args["q"], args["k"], args["v"]
    K, V = q.shape[-1], v.shape[-1]
    if K not in SUPPORTED_DIMS or V not in SUPPORTED_DIMS:
        return False, f"head dims K={K}, V={V}: the kernel takes {SUPPORTED_DIMS}"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _IO_DTYPES:
        return False, f"q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype}: one of bf16, fp16, fp32 for all three"
    cu = args.get("cu_seqlens")
    sequences = q.shape[0] if cu is None else cu.shape[0] - 1
    if sequences > MAX_SEQUENCES:
        return False, f"{sequences} sequences: the launch grid takes at most {MAX_SEQUENCES} (one CTA row each)"
    if args.get("reverse", False):
        return False, "reverse=True: the kernel walks sequences forward"
    if args.get("cp_context") is not None:
        return False, "context parallelism (cp_context): the reference backend serves it"
    h0 = args.get("initial_state")
    if h0 is not None and h0.dtype not in _STATE_DTYPES:
        return False, f"initial_state dtype {h0.dtype}: fp32 or bf16"
    if h0 is not None and not h0.is_contiguous():
        return False, "initial_state (the pool) is not contiguous: the kernel writes it in place by slot"
    if gates.beta is not None and gates.beta.dim() != 3:
        return False, "beta per value channel [B, T, HV, V]: the kernel takes one beta per head and token"
    for name, t in (("g", gates.g), ("gk", gates.gk), ("gv", gates.gv), ("beta", gates.beta)):
        if t is not None and t.dtype not in _IO_DTYPES:
            return False, f"{name} dtype {t.dtype}: bf16, fp16 or fp32"
    for name, t in (("q", q), ("k", k), ("v", v), ("initial_state", h0)):
        if t is not None and t.data_ptr() % 16:
            return False, f"{name} is not 16-byte aligned"
    return True, ""


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return runtime.sm_count(device)


def block_shape(q: torch.Tensor, v: torch.Tensor, sequences: int, state_v_first: bool, state_dtype: torch.dtype):
    """``(block_v, vec)``: the value columns a CTA holds and the state elements a thread moves at once."""
    V, HV = v.shape[-1], v.shape[2]
    wide = min(WIDE_BLOCK_V, V)
    block_v = wide if sequences * HV * (V // wide) >= _sms(q.device) else NARROW_BLOCK_V
    vec = 8 if state_v_first and state_dtype.itemsize == 2 else 4
    return block_v, vec


def config_for(args: dict[str, Any], gates: Gates) -> dict[str, Any]:
    """The kernel's :class:`cula.recurrent.kernel.RecurrentConfig` fields for a call."""
    q, v = args["q"], args["v"]
    h0 = args.get("initial_state")
    indices, accepted = args.get("ssm_state_indices"), args.get("num_accepted_tokens")
    pooled = validation.pooled(args)
    inplace = pooled and bool(args.get("inplace_final_state"))
    final = "inplace" if inplace else ("ht" if args.get("output_final_state") else "none")
    beta = "none"
    if gates.delta_rule:
        beta = "one" if gates.beta is None else "given"
    cu = args.get("cu_seqlens")
    v_first = bool(args.get("state_v_first", False))
    sequences = q.shape[0] if cu is None else cu.numel() - 1
    block_v, vec = block_shape(q, v, sequences, v_first, h0.dtype if h0 is not None else torch.float32)
    return {
        "head_k": q.shape[-1],
        "head_v": v.shape[-1],
        "state_v_first": v_first,
        "io_dtype": _TORCH_NAMES[q.dtype],
        "state_dtype": _TORCH_NAMES[h0.dtype] if h0 is not None else "float32",
        "g": "none" if gates.g is None else gates.g_kind,
        "g_dtype": _TORCH_NAMES[gates.g.dtype] if gates.g is not None else "float32",
        "gamma": gates.g_gamma is not None,
        "gk": "none" if gates.gk is None else gates.gk_kind,
        "gk_dtype": _TORCH_NAMES[gates.gk.dtype] if gates.gk is not None else "float32",
        "gv": gates.gv is not None,
        "gv_dtype": _TORCH_NAMES[gates.gv.dtype] if gates.gv is not None else "float32",
        "beta": beta,
        "beta_dtype": _TORCH_NAMES[gates.beta.dtype] if gates.beta is not None else "float32",
        "beta_sigmoid": gates.beta_sigmoid,
        "neg_eigval": gates.beta_sigmoid and gates.neg_eigval,
        "qk_l2norm": gates.qk_l2norm,
        "is_varlen": cu is not None,
        "cu_dtype": _TORCH_NAMES[cu.dtype] if cu is not None else "int32",
        "has_initial_state": h0 is not None,
        "indices": _TORCH_NAMES[indices.dtype] if indices is not None else "none",
        "accepted": _TORCH_NAMES[accepted.dtype] if accepted is not None else "none",
        "token_slots": inplace and indices is not None and indices.dim() == 2,
        "final": final,
        "block_v": block_v,
        "vec": vec,
    }


def recurrent_kernel(prefix: str, gates_of: Callable[[dict[str, Any]], Gates], arch_major: int) -> CuteKernel:
    """The kernel as a variant's fused-recurrent backend on compute capability ``arch_major`` (named
    ``<prefix>_sm<major>0``): ``gates_of`` maps the call's bound arguments onto :class:`Gates`."""

    def kernel_supports(args):
        return supports(args, gates_of(args))

    def kernel_run(args):
        from cula.recurrent.fwd_sm90 import run

        return run(args, gates_of(args))

    # run on Hopper GPUs; on Blackwell only compiled (dispatch serves it there on request: CULA_UNTESTED_KERNELS=1)
    tested = arch_major == 9
    return CuteKernel(f"{prefix}_sm{arch_major}0", arch_major, kernel_supports, kernel_run, hardware_tested=tested)
