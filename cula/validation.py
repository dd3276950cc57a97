"""Input checks shared by every entry point: each failure names the argument and what was expected."""

from __future__ import annotations

import collections
import math
import numbers
import threading
import weakref

import torch

# float64 is served by the reference backend only (so that torch.autograd.gradcheck runs on the entry points)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def tensor(name: str, x, ndim: int | None = None, dtypes=FLOAT_DTYPES, optional: bool = False):
    """``x`` is a tensor (or None when optional) of rank ``ndim`` with a dtype in ``dtypes``."""
    if x is None:
        if optional:
            return None
        raise ValueError(f"`{name}` is required")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"`{name}` must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"`{name}` must have dtype in ({_names(dtypes)}), got {x.dtype}")
    return x


def shape(name: str, x, expected: tuple[int, ...], what: str) -> None:
    if x is not None and tuple(x.shape) != tuple(expected):
        raise ValueError(f"`{name}` must have shape {what} = {tuple(expected)}, got {tuple(x.shape)}")


def same_device(**tensors) -> None:
    present = {n: t for n, t in tensors.items() if isinstance(t, torch.Tensor)}
    devices = {t.device for t in present.values()}
    if len(devices) > 1:
        listing = ", ".join(f"`{n}` on {t.device}" for n, t in present.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")


def qkv(q, k, v, allow_gva: bool) -> tuple[int, int, int, int, int, int]:
    """q, k: [B, T, H, K]; v: [B, T, HV, V] (HV == H unless GVA). Returns B, T, H, HV, K, V."""
    tensor("q", q, 4)
    tensor("k", k, 4)
    tensor("v", v, 4)
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"`q`, `k`, `v` must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, T, H, K = q.shape
    shape("k", k, (B, T, H, K), "q.shape [B, T, H, K]")
    if v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"`v` must have shape [B, T, HV, V] with B={B}, T={T} as in q, got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    for name, dim, size in (("q", "H", H), ("q", "K", K), ("v", "HV", HV), ("v", "V", V)):
        if size == 0:
            raise ValueError(f"`{name}` must have {dim} >= 1, got shape {tuple(q.shape if name == 'q' else v.shape)}")
    if allow_gva:
        if HV % H != 0:
            raise ValueError(f"`v` has HV={HV} heads, which must be a multiple of the H={H} heads of q and k (GVA)")
    elif HV != H:
        raise ValueError(f"`v` must have the same number of heads as q and k (H={H}), got {HV}")
    if T == 0 or B == 0:
        raise ValueError(f"`q` must have B >= 1 and T >= 1, got shape {tuple(q.shape)}")
    return B, T, H, HV, K, V


# Offsets read from cu_seqlens tensors, for the few tensors seen last: a model hands the same cu_seqlens to every
# layer, so only its first layer waits for the device to read them (FLA caches its own read of them per tensor
# the same way). Keyed by the tensor object; a tensor changed in place (its version counter moves) is read again.
# Tensors without a version counter or a storage pointer (inference-mode tensors) are read on every call.
_OFFSETS_SEEN: collections.OrderedDict[int, tuple[weakref.ref, tuple[int, int], list[int]]] = collections.OrderedDict()
_OFFSETS_KEPT = 8
_OFFSETS_LOCK = threading.Lock()


def host_offsets(cu_seqlens, cu_seqlens_cpu=None) -> list[int]:
    """The varlen offsets as Python ints: from the host copy ``cu_seqlens_cpu`` when the caller gave one, else
    from ``cu_seqlens`` (a device sync, once per tensor and version; every call for a tensor without a version
    counter or storage pointer, such as an inference-mode tensor)."""
    if cu_seqlens_cpu is not None:
        return cu_seqlens_cpu.tolist()
    return _read_offsets(cu_seqlens)


def _read_offsets(cu_seqlens, fresh: bool = False) -> list[int]:
    """``cu_seqlens.tolist()``, from the cache when this tensor at this version was read before (unless ``fresh``)."""
    try:
        stamp = (cu_seqlens._version, cu_seqlens.data_ptr())
    except RuntimeError:
        return cu_seqlens.tolist()
    key = id(cu_seqlens)
    with _OFFSETS_LOCK:
        seen = None if fresh else _OFFSETS_SEEN.get(key)
        if seen is not None and seen[0]() is cu_seqlens and seen[1] == stamp:
            _OFFSETS_SEEN.move_to_end(key)
            return list(seen[2])
    offsets = cu_seqlens.tolist()  # outside the lock: other threads need not wait for this device read
    with _OFFSETS_LOCK:
        _OFFSETS_SEEN[key] = (weakref.ref(cu_seqlens), stamp, offsets)
        _OFFSETS_SEEN.move_to_end(key)
        while len(_OFFSETS_SEEN) > _OFFSETS_KEPT:
            _OFFSETS_SEEN.popitem(last=False)
    return list(offsets)


def _check_offsets(name: str, offsets: list[int], T: int) -> None:
    if offsets[0] != 0 or offsets[-1] != T:
        raise ValueError(f"`{name}` must start at 0 and end at T={T}, got {offsets[0]} ... {offsets[-1]}")
    if any(b < a for a, b in zip(offsets, offsets[1:], strict=False)):
        raise ValueError(f"`{name}` must be non-decreasing, got {offsets}")


def cu_seqlens_(cu_seqlens, B: int, T: int, cu_seqlens_cpu=None, read: bool = True) -> list[int] | None:
    """cu_seqlens: int32/int64 [N+1], starts at 0, non-decreasing, ends at T; only with B == 1. Returns the
    offsets as Python ints (None without cu_seqlens, or with ``read=False``: the tensors' metadata checked only).

    With the host copy ``cu_seqlens_cpu`` (FLA's argument) both are checked and must agree: a kernel indexes
    tokens with the device tensor and plans its launch with the host one. The device tensor is read once per
    tensor and version (:func:`host_offsets`' cache), again when the two differ (the cache cannot see a write by
    the caller's own kernel), and not at all while a CUDA graph is being captured (no device read is possible
    then; the eager call before the capture checked the same tensor)."""
    if cu_seqlens is None:
        return None
    tensor("cu_seqlens", cu_seqlens, 1, (torch.int32, torch.int64))
    if B != 1:
        raise ValueError(f"`cu_seqlens` needs the batch size of q to be 1 (flatten the sequences), got B={B}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"`cu_seqlens` must hold N+1 >= 2 offsets, got {cu_seqlens.numel()}")
    tensor("cu_seqlens_cpu", cu_seqlens_cpu, 1, (torch.int32, torch.int64), optional=True)
    if cu_seqlens_cpu is not None and tuple(cu_seqlens_cpu.shape) != tuple(cu_seqlens.shape):
        raise ValueError(f"`cu_seqlens_cpu` must have the shape of `cu_seqlens`, got {tuple(cu_seqlens_cpu.shape)}")
    if not read:
        return None
    host = None if cu_seqlens_cpu is None else cu_seqlens_cpu.tolist()
    capturing = cu_seqlens.is_cuda and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    device = None
    if host is None or not capturing:
        # one small copy per tensor; a wrong offset would otherwise make a kernel read out of bounds
        device = _read_offsets(cu_seqlens)
        if host is not None and device != host:
            device = _read_offsets(cu_seqlens, fresh=True)
    for name, offsets in (("cu_seqlens", device), ("cu_seqlens_cpu", host)):
        if offsets is not None:
            _check_offsets(name, offsets, T)
    if host is not None and device is not None and host != device:
        raise ValueError(f"`cu_seqlens_cpu` = {host} differs from `cu_seqlens` = {device}")
    return host if host is not None else device


def state(
    initial_state, N: int, HV: int, K: int, V: int, state_v_first: bool, varlen: bool, fp64: bool = False
) -> None:
    """initial_state: fp32 [N, HV, K, V], or [N, HV, V, K] with state_v_first; fp64 too for fp64 inputs."""
    if initial_state is None:
        return
    tensor("initial_state", initial_state, 4, (torch.float32, torch.float64) if fp64 else (torch.float32,))
    layout = "[N, HV, V, K]" if state_v_first else "[N, HV, K, V]"
    expected = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    if initial_state.shape[0] != N:
        source = "len(cu_seqlens) - 1" if varlen else "the batch size B"
        raise ValueError(f"`initial_state` must have N={N} ({source}) states, got {initial_state.shape[0]}")
    shape("initial_state", initial_state, expected, layout)


def scale(value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`scale` must be a float or None, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"`scale` must be finite, got {value}")


# Boolean switches of FLA's entry points. FLA tests them for truth; its layers pass `use_cache` (which may be None)
# as `output_final_state`, so None and values equal to 0 or 1 (numpy bools among them) are taken as False and True,
# anything else (a string, 2) refused.
FLAGS = (
    "output_final_state",
    "use_qk_l2norm_in_kernel",
    "use_gate_in_kernel",
    "use_beta_sigmoid_in_kernel",
    "allow_neg_eigval",
    "safe_gate",
    "state_v_first",
    "reverse",
    "disable_recompute",
    "return_intermediate_states",
    "use_graph",
)


def flags(args: dict) -> None:
    """Each switch of ``FLAGS`` present in ``args`` is a bool (or None, 0, 1: stored back as a bool)."""
    for name in FLAGS:
        if name not in args:
            continue
        value = args[name]
        try:
            ok = value is None or isinstance(value, bool) or bool(value == 0) or bool(value == 1)
        except (TypeError, ValueError, RuntimeError):  # a tensor of several elements, say
            ok = False
        if not ok:
            raise TypeError(f"`{name}` must be a bool, got {type(value).__name__} {value!r}")
        args[name] = bool(value)


class RemovedArgumentError(ValueError, DeprecationWarning):
    """An argument FLA 0.6.0 removed. Also a DeprecationWarning, the exception FLA raises for it."""


def head_first(args: dict, refused_in_any_form: bool) -> None:
    """FLA removed ``head_first`` (inputs are ``[B, T, H, ...]``). Some of its entry points raise whenever it is
    passed (``refused_in_any_form``); the others ignore it, which would read ``[B, H, T, K]`` inputs as
    ``[B, T, H, K]``: there ``head_first=True`` is refused too."""
    if "head_first" in args and (refused_in_any_form or args["head_first"]):
        raise RemovedArgumentError(
            f"`head_first`={args['head_first']!r}: FLA removed it, inputs must be [B, T, H, ...] (transpose them)"
        )


def beta_flags(args: dict) -> None:
    if args.get("allow_neg_eigval") and not args.get("use_beta_sigmoid_in_kernel"):
        raise ValueError("`allow_neg_eigval=True` needs use_beta_sigmoid_in_kernel=True")


def chunk_size(args: dict, allowed: tuple[int, ...] | None, op: str) -> None:
    """``chunk_size`` (a keyword argument): one of ``allowed`` (64 when absent), or with ``allowed`` None a power of
    two or None, as FLA checks it."""
    if allowed is not None:
        value = args.get("chunk_size", 64)
        if value not in allowed:
            listed = ", ".join(map(str, allowed[:-1])) + f" or {allowed[-1]}"
            raise ValueError(f"`chunk_size` must be {listed} for {op}, got {value!r}")
        return
    value = args.get("chunk_size")
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`chunk_size` must be an int, got {type(value).__name__}")
    if value < 1 or value & (value - 1):
        raise ValueError(f"`chunk_size` must be a power of 2 for {op}, got {value}")


def per_head(name: str, x, B: int, T: int, HV: int, optional: bool = False) -> None:
    """A per-token, per-head tensor such as beta or a scalar gate: [B, T, HV]."""
    tensor(name, x, 3, optional=optional)
    shape(name, x, (B, T, HV), "[B, T, HV]")


def beta_(beta, B: int, T: int, HV: int, V: int, optional: bool = False) -> None:
    """beta: [B, T, HV], or per value channel [B, T, HV, V] (the fused-recurrent ops accept both)."""
    tensor("beta", beta, None, optional=optional)
    if beta is not None and tuple(beta.shape) not in ((B, T, HV), (B, T, HV, V)):
        raise ValueError(f"`beta` must have shape [B, T, HV] = {(B, T, HV)} or [B, T, HV, V], got {tuple(beta.shape)}")


def head_params(
    use_gate_in_kernel: bool, A_log, dt_bias, HV: int, dt_bias_numel: int, a_log_required: bool = True
) -> None:
    """A_log [HV] and optional dt_bias (``dt_bias_numel`` elements) for gates computed in the kernel."""
    if not use_gate_in_kernel:
        return
    if A_log is None:
        if a_log_required:
            raise ValueError("`A_log` is required when use_gate_in_kernel=True")
    elif tensor("A_log", A_log, None).numel() != HV:
        raise ValueError(f"`A_log` must hold HV={HV} values, got shape {tuple(A_log.shape)}")
    tensor("dt_bias", dt_bias, None, optional=True)
    if dt_bias is not None and dt_bias.numel() != dt_bias_numel:
        raise ValueError(f"`dt_bias` must hold {dt_bias_numel} values, got shape {tuple(dt_bias.shape)}")


def common(args: dict, allow_gva: bool) -> tuple[int, int, int, int, int, int, int]:
    """Checks shared by every op: q/k/v, scale, cu_seqlens and initial_state. Returns B, T, H, HV, K, V, N.

    For ops that take ``cu_seqlens_cpu``, fills it in from the offsets read here when the caller left it out.
    While compiling, the offsets' values are not read (a graph cannot hold values read from the device): what reads
    them as the call runs checks them (the custom ops, :mod:`cula.custom_ops`; the reference)."""
    B, T, H, HV, K, V = qkv(args["q"], args["k"], args["v"], allow_gva)
    scale(args.get("scale"))
    flags(args)
    cu_seqlens = args.get("cu_seqlens")
    offsets = cu_seqlens_(cu_seqlens, B, T, args.get("cu_seqlens_cpu"), read=not torch.compiler.is_compiling())
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if offsets is not None and "cu_seqlens_cpu" in args and args["cu_seqlens_cpu"] is None:
        # hand the host copy on, so that later steps (the GDN time model, FLA) do not copy the offsets again
        args["cu_seqlens_cpu"] = torch.tensor(offsets, dtype=cu_seqlens.dtype)
    fp64 = args["q"].dtype == torch.float64
    state(args.get("initial_state"), N, HV, K, V, args.get("state_v_first", False), cu_seqlens is not None, fp64)
    same_device(**{n: t for n, t in args.items() if n != "cu_seqlens" and n != "cu_seqlens_cpu"})
    return B, T, H, HV, K, V, N
