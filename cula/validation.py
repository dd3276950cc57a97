"""Input checks shared by every entry point: each failure names the argument and what was expected."""

from __future__ import annotations

import collections
import functools
import math
import numbers
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

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


# Host copies of small index tensors (cu_seqlens offsets, state-pool indices), for the few tensors seen last: a model
# hands the same tensors to every layer, so only its first layer waits for the device to read them (FLA caches its
# own read of cu_seqlens per tensor the same way). Keyed by the tensor object and what was read; a tensor changed in
# place (its version counter moves) is read again. Tensors without a version counter or a storage pointer
# (inference-mode tensors) are read on every call.
_HOST_COPIES: collections.OrderedDict[tuple[int, Callable], tuple[weakref.ref, tuple[int, int], Any]] = (
    collections.OrderedDict()
)
_HOST_COPIES_KEPT = 8
_HOST_COPIES_LOCK = threading.Lock()


def host_offsets(cu_seqlens, cu_seqlens_cpu=None) -> list[int]:
    """The varlen offsets as Python ints: from the host copy ``cu_seqlens_cpu`` when the caller gave one, else
    from ``cu_seqlens`` (a device sync, once per tensor and version; every call for a tensor without a version
    counter or storage pointer, such as an inference-mode tensor)."""
    if cu_seqlens_cpu is not None:
        return cu_seqlens_cpu.tolist()
    return _read_offsets(cu_seqlens)


def _read_host(x, read: Callable, fresh: bool = False):
    """``read(x)``, from the cache when this tensor at this version was read so before (unless ``fresh``). The value
    is shared with later calls: callers leave it unchanged."""
    try:
        stamp = (x._version, x.data_ptr())
    except RuntimeError:
        return read(x)
    key = (id(x), read)
    with _HOST_COPIES_LOCK:
        seen = None if fresh else _HOST_COPIES.get(key)
        if seen is not None and seen[0]() is x and seen[1] == stamp:
            _HOST_COPIES.move_to_end(key)
            return seen[2]
    value = read(x)  # outside the lock: other threads need not wait for this device read
    with _HOST_COPIES_LOCK:
        _HOST_COPIES[key] = (weakref.ref(x), stamp, value)
        _HOST_COPIES.move_to_end(key)
        while len(_HOST_COPIES) > _HOST_COPIES_KEPT:
            _HOST_COPIES.popitem(last=False)
    return value


def _to_list(x) -> list:
    return x.tolist()


def _to_host_int64(x) -> torch.Tensor:
    return x.to("cpu", torch.int64, copy=True)


def _read_offsets(cu_seqlens, fresh: bool = False) -> list[int]:
    """``cu_seqlens.tolist()``, from the cache when this tensor at this version was read before (unless ``fresh``)."""
    return list(_read_host(cu_seqlens, _to_list, fresh))


@functools.lru_cache(maxsize=_HOST_COPIES_KEPT)
def host_copy(offsets: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Varlen offsets as a host tensor of ``dtype`` (FLA's ``cu_seqlens_cpu``), made once per offsets for the few seen
    last, as their reads are kept: every layer of a model hands on the same ones. Shared: never written."""
    with torch.inference_mode(False):  # one made for an inference call may later be saved for a backward
        return torch.tensor(offsets, dtype=dtype)


def hand_on_host_offsets(args: dict, offsets: list[int] | None, cu_seqlens) -> None:
    """Where the call takes ``cu_seqlens_cpu`` and was given none, the host copy (:func:`host_copy`) of the offsets
    just read from ``cu_seqlens`` handed on in ``args``, so that later steps (the GDN time model, FLA) do not copy
    them again. Nothing where the offsets were not read (``offsets`` None)."""
    if offsets is not None and "cu_seqlens_cpu" in args and args["cu_seqlens_cpu"] is None:
        args["cu_seqlens_cpu"] = host_copy(tuple(offsets), cu_seqlens.dtype)


def _capturing(x) -> bool:
    """Whether ``x`` is a CUDA tensor while a CUDA graph is being captured: no device read is possible then."""
    return x.is_cuda and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def host_indices(x) -> torch.Tensor | None:
    """An integer tensor (state-pool indices) on the host as int64, read as :func:`host_offsets` reads offsets
    (cached per tensor and version); None while a CUDA graph is being captured. Callers leave it unchanged."""
    if _capturing(x):
        return None
    return _read_host(x, _to_host_int64)


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
    capturing = _capturing(cu_seqlens)
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


# The state-pool arguments (cula/ops/state_pool.py says what they mean): FLA 0.6.0's names for its decode kernels.
POOL_ARGS = ("ssm_state_indices", "num_accepted_tokens", "inplace_final_state")
INDEX_DTYPES = (torch.int32, torch.int64)


def pooled(args: dict) -> bool:
    """Whether a call reads its states from a pool by index or writes them back in place."""
    return args.get("ssm_state_indices") is not None or bool(args.get("inplace_final_state"))


def state_pool(args: dict, N: int, HV: int, K: int, V: int, lengths: list[int], fp64: bool, token_slots: bool) -> bool:
    """The state-pool arguments; returns whether the call uses a pool (then ``initial_state`` is the pool and
    `state` does not apply). ``inplace_final_state`` left out or None becomes True with ``ssm_state_indices`` (the
    default of FLA's ``fused_recurrent_kda_fwd``), False without. ``token_slots``: the op takes ``[N, T_max]``
    indices and ``num_accepted_tokens`` (the fused-recurrent ops).

    The index values are read to the host (cached per tensor and version, as cu_seqlens are) and checked: in range,
    and, when writing in place, no slot written twice nor read by one sequence and written by another. While a CUDA
    graph is being captured they cannot be read: the shapes are checked, the values are not."""
    indices, accepted = args.get("ssm_state_indices"), args.get("num_accepted_tokens")
    inplace = args.get("inplace_final_state")
    if inplace is None:
        inplace = indices is not None
    elif not isinstance(inplace, bool):
        raise TypeError(f"`inplace_final_state` must be a bool, got {type(inplace).__name__} {inplace!r}")
    if "inplace_final_state" in args or indices is not None:
        args["inplace_final_state"] = inplace
    if indices is None and not inplace:
        if accepted is not None:
            raise ValueError("`num_accepted_tokens` needs `ssm_state_indices` of shape [N, T_max]")
        return False
    what = "`ssm_state_indices`" if indices is not None else "`inplace_final_state=True`"
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in args.values()):
        raise ValueError(f"{what}: state pools serve inference, but inputs require grad (use torch.no_grad())")
    if args.get("reverse"):
        raise ValueError(f"{what} with reverse=True: a state pool carries states forward, token after token")
    pool = args.get("initial_state")
    if pool is None:
        raise ValueError(f"{what} needs `initial_state`: the states to read and write back")
    dtypes = (torch.float32, torch.bfloat16, torch.float64) if fp64 else (torch.float32, torch.bfloat16)
    tensor("initial_state", pool, 4, dtypes)
    inner = (HV, V, K) if args.get("state_v_first", False) else (HV, K, V)
    layout = "[slots, HV, V, K]" if args.get("state_v_first", False) else "[slots, HV, K, V]"
    if tuple(pool.shape[1:]) != inner:
        raise ValueError(
            f"`initial_state` (the state pool) must have shape {layout} = (slots, {inner}), got {tuple(pool.shape)}"
        )
    if indices is None:
        if pool.shape[0] != N:
            raise ValueError(
                f"`initial_state` must have N={N} states (one per sequence; `ssm_state_indices` addresses a pool of "
                f"any size), got {pool.shape[0]}"
            )
        return True
    tensor("ssm_state_indices", indices, None, INDEX_DTYPES)
    if indices.dim() not in ((1, 2) if token_slots else (1,)):
        shapes = "[N] or [N, T_max] (one slot per token)" if token_slots else "[N] (chunk ops keep no per-token states)"
        raise ValueError(f"`ssm_state_indices` must have shape {shapes}, got {tuple(indices.shape)}")
    if indices.shape[0] != N:
        raise ValueError(f"`ssm_state_indices` must hold N={N} rows (one per sequence), got {indices.shape[0]}")
    longest = max(lengths, default=0)
    if indices.dim() == 2 and indices.shape[1] < max(longest, 1):
        raise ValueError(
            f"`ssm_state_indices` [N, T_max] needs a column per token: T_max >= {max(longest, 1)} (the longest "
            f"sequence), got {indices.shape[1]}"
        )
    if accepted is not None:
        if indices.dim() != 2:
            raise ValueError("`num_accepted_tokens` needs `ssm_state_indices` of shape [N, T_max]")
        tensor("num_accepted_tokens", accepted, 1, INDEX_DTYPES)
        shape("num_accepted_tokens", accepted, (N,), "[N]")
    same_device(initial_state=pool, ssm_state_indices=indices, num_accepted_tokens=accepted)
    _pool_index_values(indices, accepted, pool.shape[0], lengths, inplace)
    return True


# Index tables found valid, for the few seen last: every layer of a model checks the same host copies against the
# same pool shape and lengths, so only the first one pays for the check. Keyed by the call; the host copies are kept
# and compared by identity (a new read is a new copy).
_POOLS_CHECKED: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()


# Set to 1 by an engine that vouches for its pool indices: their values are then not read to the host (an eager
# decode step whose slot buffer was rewritten in place otherwise pays one device sync); shapes are still checked
ENV_TRUST_POOL_INDICES = "CULA_TRUST_POOL_INDICES"


def _pool_index_values(indices, accepted, slots: int, lengths: list[int], inplace: bool) -> None:
    if os.environ.get(ENV_TRUST_POOL_INDICES, "0") == "1":
        return
    table = host_indices(indices)
    steps = None if accepted is None else host_indices(accepted)
    if table is None or (accepted is not None and steps is None):
        return  # CUDA graph capture: the eager call before it checked these tensors
    key = (id(table), id(steps), slots, tuple(lengths), inplace)
    with _HOST_COPIES_LOCK:
        seen = _POOLS_CHECKED.get(key)
        if seen is not None and seen[0] is table and seen[1] is steps:
            return
    _check_pool_index_values(table, steps, slots, lengths, inplace)
    with _HOST_COPIES_LOCK:
        _POOLS_CHECKED[key] = (table, steps)
        _POOLS_CHECKED.move_to_end(key)
        while len(_POOLS_CHECKED) > _HOST_COPIES_KEPT:
            _POOLS_CHECKED.popitem(last=False)


def _check_pool_index_values(table, steps, slots: int, lengths: list[int], inplace: bool) -> None:
    at = (lambda n, t: f"[{n}, {t}]") if table.dim() == 2 else (lambda n, t: f"[{n}]")
    table = table.view(len(lengths), -1)
    N, W = table.shape
    outside = (table >= slots).nonzero()
    if len(outside):
        n, t = outside[0].tolist()
        raise ValueError(
            f"`ssm_state_indices`{at(n, t)} = {table[n, t].item()} is outside the pool of {slots} slots "
            f"(a negative index marks padding)"
        )
    if steps is not None:
        bad = ((steps < 1) | (steps > W)).nonzero()
        if len(bad):
            n = bad[0].item()
            raise ValueError(f"`num_accepted_tokens`[{n}] = {steps[n].item()} must lie in [1, T_max={W}]")
    if not inplace:
        return  # the pool is only read: sequences may share a slot
    rows = torch.arange(N)
    read = table[rows, 0 if steps is None else steps - 1]
    length = torch.tensor(lengths)
    active = (read >= 0) & (length > 0)
    written = active[:, None] & (table >= 0) & (torch.arange(W) < length[:, None])
    order = table[written].argsort(stable=True)
    slot, writer = table[written][order], rows[:, None].expand(N, W)[written][order]
    twice = (slot[1:] == slot[:-1]).nonzero()
    if len(twice):
        i = twice[0].item()
        raise ValueError(
            f"`ssm_state_indices`: slot {slot[i].item()} is written twice in place (by sequences {writer[i].item()} "
            f"and {writer[i + 1].item()}); each slot written belongs to one sequence and one token"
        )
    owner = torch.full((slots,), -1, dtype=torch.long)
    owner[slot] = writer
    read_by, reader = read[active], rows[active]
    clash = ((owner[read_by] >= 0) & (owner[read_by] != reader)).nonzero()
    if len(clash):
        i = clash[0].item()
        raise ValueError(
            f"`ssm_state_indices`: slot {read_by[i].item()} is read by sequence {reader[i].item()} and written in "
            f"place by sequence {owner[read_by[i]].item()}"
        )


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


def common(args: dict, allow_gva: bool, token_slots: bool = False) -> tuple[int, int, int, int, int, int, int]:
    """Checks shared by every op: q/k/v, scale, cu_seqlens and initial_state (or the state pool: `state_pool`, with
    ``token_slots`` for the fused-recurrent ops). Returns B, T, H, HV, K, V, N.

    For ops that take ``cu_seqlens_cpu``, fills it in from the offsets read here when the caller left it out.
    While compiling, the offsets' values are not read (a graph cannot hold values read from the device): what reads
    them as the call runs checks them (the custom ops, :mod:`cula.custom_ops`; the reference)."""
    B, T, H, HV, K, V = qkv(args["q"], args["k"], args["v"], allow_gva)
    scale(args.get("scale"))
    flags(args)
    cu_seqlens = args.get("cu_seqlens")
    offsets = cu_seqlens_(cu_seqlens, B, T, args.get("cu_seqlens_cpu"), read=not torch.compiler.is_compiling())
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    hand_on_host_offsets(args, offsets, cu_seqlens)
    fp64 = args["q"].dtype == torch.float64
    lengths = [T] * B if offsets is None else [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    if not state_pool(args, N, HV, K, V, lengths, fp64, token_slots):
        state(args.get("initial_state"), N, HV, K, V, args.get("state_v_first", False), cu_seqlens is not None, fp64)
    same_device(**{n: t for n, t in args.items() if n != "cu_seqlens" and n != "cu_seqlens_cpu"})
    return B, T, H, HV, K, V, N
