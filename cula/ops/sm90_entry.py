"""Host-side pieces shared by the SM90 chunked-forward entries of the delta-rule family (GDN, KDA): the input
checks both kernels make, the fake tensors they are compiled with, a placeholder int32 tensor for unused range
arguments, the entry itself (outputs, varlen ranges, sequence splitting) around a kernel's launch, its call from
an entry point's bound arguments, and the variants of each kernel that the compile check builds."""

import torch

from cula import runtime, validation
from cula.ops import segment_split, state_chain_sm90
from cula.ops.gates import kernel_beta

_DUMMY: dict = {}


# CUDA's limit on a launch grid's y (and z) size: the chunk kernels run sequence n as grid row n
MAX_SEQUENCES = 65535


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
    sequences = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if sequences > MAX_SEQUENCES:
        return False, f"{sequences} sequences: the launch grid takes at most {MAX_SEQUENCES} (one CTA row each)"
    if initial_state is not None and initial_state.dtype != torch.float32:
        return False, "initial_state must be float32"
    return True, ""


def fake_args(D: int, beta_fp32: bool, state_v_first: bool, per_key_gate: bool, raw_gate: bool = False) -> tuple:
    """Fake arguments for compiling a chunk kernel, in its launch order ``q, k, v, g, beta, o, h0, ht, starts, ends,
    w, scale[, a_log, dt_bias, lower_bound], stream``: q, k [B, T, H, D], v and o [B, T, HV, D] bf16; g [B, T, HV]
    fp32, or with ``per_key_gate`` [B, T, HV, D] (fp32, bf16 when ``raw_gate``: activated by the kernel) followed by
    the gate's parameters (A_log [HV] and dt_bias [HV * D] fp32, lower_bound); beta fp32 or bf16; the states
    (N, HV, K, V) fp32, stored [N, HV, V, K] (K contiguous) with ``state_v_first``; int32 token ranges; the split
    passes' workspace [ranges, rows, HV, 64] bf16. Batch, length, head and range counts symbolic."""
    import cutlass

    sym = runtime.sym_int
    n_ranges = sym()
    B, T, H, HV, N = sym(), sym(), sym(), sym(), sym()
    bf16 = cutlass.BFloat16
    state_order = (3, 2, 0, 1) if state_v_first else None
    g = (
        runtime.fake_tensor(bf16 if raw_gate else cutlass.Float32, (B, T, HV, D))
        if per_key_gate
        else runtime.fake_tensor(cutlass.Float32, (B, T, HV), align=4)
    )
    gate_params = ()
    if per_key_gate:
        gate_params = (
            runtime.fake_tensor(cutlass.Float32, (sym(),), align=4),
            runtime.fake_tensor(cutlass.Float32, (sym(),), align=4),
            cutlass.Float32(-5.0),
        )
    return (
        runtime.fake_tensor(bf16, (B, T, H, D)),
        runtime.fake_tensor(bf16, (B, T, H, D)),
        runtime.fake_tensor(bf16, (B, T, HV, D)),
        g,
        # beta's element size as its alignment: an fp32 beta assumed 2-byte aligned is loaded as two 16-bit halves,
        # joined at once, so the load's whole latency is waited where it is issued
        runtime.fake_tensor(cutlass.Float32 if beta_fp32 else bf16, (B, T, HV), align=4 if beta_fp32 else 2),
        runtime.fake_tensor(bf16, (B, T, HV, D)),
        runtime.fake_tensor(cutlass.Float32, (N, HV, D, D), state_order),
        runtime.fake_tensor(cutlass.Float32, (N, HV, D, D), state_order),
        runtime.fake_tensor(cutlass.Int32, (n_ranges,), align=4),
        runtime.fake_tensor(cutlass.Int32, (n_ranges,), align=4),
        runtime.fake_tensor(bf16, (sym(), sym(), HV, 64)),
        cutlass.Float32(1.0),
        *gate_params,
        runtime.fake_stream(),
    )


def cached_zeros(device, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor on ``device``, made once per (device, shape, dtype): what a kernel gets for an argument the call
    does not use (a range, the split passes' workspace, an absent gate parameter). Never written."""
    key = (device, tuple(shape), dtype)
    t = _DUMMY.get(key)
    if t is None:
        t = torch.zeros(shape, dtype=dtype, device=device)
        if t.is_cuda and not torch.cuda.is_current_stream_capturing():
            # zeroed on the current stream; later calls read it from any stream (the split passes' own, another
            # caller's), which nothing orders after that fill
            torch.cuda.current_stream(t.device).synchronize()
        _DUMMY[key] = t
    return t


def chunk_fwd(
    launch,
    q,
    k,
    v,
    g,
    beta,
    scale,
    initial_state,
    output_final_state,
    cu_seqlens,
    state_v_first,
    out,
    final_state_out,
    cu_seqlens_cpu,
    split,
    chunk: int,
    split_cost: segment_split.SplitCost = segment_split.UNCACHED,
    workspaces=None,
    **options,
):
    """The Python side of an SM90 chunked forward (GDN, KDA): outputs, varlen ranges, and sequence splitting.

    ``launch(q, k, v, g, beta, o, h0, ht, starts, ends, scale, state_v_first, mode, **options)`` runs the kernel
    once (``starts``/``ends``: int32 token ranges in batch row 0, or None for one sequence per batch row; ``h0``
    None: zero start, or identity for ``mode="transition"``; ``options``: the kernel's own compile-time options,
    passed to every launch). Long sequences with few heads are split across CTAs
    (``cula.ops.segment_split``) when the planner expects that to be faster; ``split`` True/False forces it on/off
    (a cut per 16 chunks when forced on). Varlen offsets come from ``cu_seqlens_cpu``, else from the device once per
    ``cu_seqlens`` tensor (:func:`cula.validation.host_offsets`, the read dispatch makes anyway).
    ``split_cost``: the planner's costs of the split passes; with ``cached`` the kernel takes ``intra`` (its first split
    pass saves each chunk's intra-chunk matrices to a workspace, the later passes load them); ``workspaces(ranges,
    chunks, HV, D, device)``, if given, makes the kernel's further workspaces of a split (keyword arguments of
    ``launch``, the same tensors for every pass).
    Returns ``(o, final_state or None)``."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if scale is None:
        scale = K**-0.5
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    o = out if out is not None else torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device)

    if cu_seqlens is None:
        offsets = [b * T for b in range(B + 1)]
    else:
        offsets = validation.host_offsets(cu_seqlens, cu_seqlens_cpu)
    cuts = None
    if split is not False:
        lengths = [e - s for s, e in zip(offsets[:-1], offsets[1:], strict=True)]
        if split:
            cuts = [list(range(chunk * 16, n, chunk * 16)) for n in lengths]
        else:
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count
            cuts = segment_split.plan_segments(lengths, HV, sms, chunk, split_cost)
        if cuts is not None and (not any(cuts) or sum(map(len, cuts)) + N > MAX_SEQUENCES):
            cuts = None  # nothing to cut, or more segments than a launch grid has rows: walk each sequence whole
    if cuts is not None:
        flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta, o)]
        h0 = initial_state
        if h0 is not None and state_v_first:
            h0 = h0.transpose(-1, -2)

        cached = split_cost.cached
        workspace = {}
        if cached:
            # chunks of the longest segment; the workspace's rows per (segment, head): Tinv and P of each, C x C each
            chunks = max(-(-(e - s) // chunk) for _, s, e in segment_split.segments(offsets, cuts))

        def run(mode, starts, ends, h0_, out_):
            Vd = K if mode == "transition" else V
            ht_ = torch.empty(starts.numel(), HV, K, Vd, dtype=torch.float32, device=q.device)
            intra = {}
            if cached:
                if mode == "full":
                    shape = (starts.numel(), 2 * chunk * chunks, HV, chunk)
                    workspace["w"] = torch.empty(shape, dtype=torch.bfloat16, device=q.device)
                    if workspaces is not None:
                        workspace.update(workspaces(starts.numel(), chunks, HV, K, q.device))
                intra = {"intra": "save" if mode == "full" else "load", **workspace}
            launch(*flat[:5], flat[5], h0_, ht_, starts, ends, scale, False, mode, **intra, **options)
            return ht_

        # the start chain in one launch on a GPU (a PyTorch loop there costs two host ops per segment)
        chain = state_chain_sm90.chain_starts if q.is_cuda else segment_split.chain_starts_torch
        ht = segment_split.split_forward(
            run, offsets, cuts, h0, flat[5], output_final_state, aligned=cached, chain=chain
        )
        if ht is not None and state_v_first:
            ht = ht.transpose(-1, -2).contiguous()
        if ht is not None and final_state_out is not None:
            final_state_out.copy_(ht)
            ht = final_state_out
        return o, ht

    state_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    ht = final_state_out
    if ht is None:
        ht = torch.empty(state_shape, dtype=torch.float32, device=q.device)
    starts = ends = None
    if cu_seqlens is not None:
        cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
        starts, ends = cu[:-1], cu[1:]
    h0 = initial_state.contiguous() if initial_state is not None else None
    launch(q, k, v, g, beta, o, h0, ht, starts, ends, scale, state_v_first, "full", **options)
    return o, (ht if output_final_state else None)


def run_bound(entry, args: dict, g: torch.Tensor, **options):
    """An SM90 chunk forward ``entry`` (GDN's or KDA's) on an entry point's bound arguments, ``g`` being the gate as
    the kernel takes it (fp32 and activated, unless ``options`` give the kernel its activation): beta's pre-pass
    (:func:`cula.ops.gates.kernel_beta`), q and k L2-normalised by the kernel itself when
    ``use_qk_l2norm_in_kernel`` asks. Returns ``(o, final_state or None)``."""
    return entry(
        args["q"].contiguous(),
        args["k"].contiguous(),
        args["v"].contiguous(),
        g.contiguous(),
        kernel_beta(args),
        args["scale"],
        args["initial_state"],
        args["output_final_state"],
        args["cu_seqlens"],
        args["state_v_first"],
        cu_seqlens_cpu=args.get("cu_seqlens_cpu"),
        qk_l2norm=bool(args["use_qk_l2norm_in_kernel"]),
        **options,
    )


def launch(
    name, compile_fn, q, k, v, g, beta, o, h0, ht, starts, ends, scale, state_v_first, mode, w=None, extra=(), **options
):
    """One launch of a chunk kernel compiled by ``compile_fn(arch, keep_artifacts, head_dim, beta_fp32, is_varlen,
    has_initial_state, state_v_first, mode, **options)`` (cached per those constants under ``name``).
    ``starts``/``ends``: int32 token ranges of the sequences in batch row 0 (varlen or split segments), or None for
    one sequence per batch row; ``h0`` None: zero (or identity) start; ``w``: the split passes' workspace (the
    kernel's ``intra`` option), or None; ``extra``: the kernel's arguments after ``scale`` (KDA's gate parameters)."""
    K = q.shape[-1]
    beta_fp32 = beta.dtype == torch.float32
    is_varlen = starts is not None
    key = (name, K, beta_fp32, is_varlen, h0 is not None, state_v_first, mode, *sorted(options.items()))
    key = (*key, runtime.device_arch(q.device))
    fn = runtime.get_or_compile(
        key,
        lambda: compile_fn(key[-1], False, K, beta_fp32, is_varlen, h0 is not None, state_v_first, mode, **options),
    )
    if state_v_first:
        # the kernel takes (N, HV, K, V)-shaped tensors; a transposed view carries the V-first storage
        ht = ht.transpose(-1, -2)
        h0 = None if h0 is None else h0.transpose(-1, -2)
    dummy = cached_zeros(q.device, (1,), torch.int32)
    fn(
        q, k, v, g, beta, o, ht if h0 is None else h0, ht,
        dummy if starts is None else starts, dummy if ends is None else ends,
        cached_zeros(q.device, (1, 64, v.shape[2], 64), torch.bfloat16) if w is None else w, float(scale), *extra,
    )  # fmt: skip


# The compile-checked variants of each chunk kernel (``python -m cula.compile_check``): name suffix -> options of
# its compile function. Each must hold wgmma and TMA instructions, with no local memory and no injected arrives.
CHECKED_VARIANTS = {
    "": {"is_varlen": True, "has_initial_state": True},
    "[qk_l2norm]": {"is_varlen": True, "has_initial_state": True, "qk_l2norm": True},
    "[D=64]": {"head_dim": 64, "is_varlen": True, "has_initial_state": True},
    "[transition]": {"is_varlen": True, "mode": "transition"},  # the passes that split long sequences
    "[correction]": {"is_varlen": True, "mode": "correction"},
}


# The split passes of a kernel that takes ``intra`` (the first pass saves each chunk's Tinv and P, the later load them)
INTRA_VARIANTS = {
    "[intra save]": {"is_varlen": True, "has_initial_state": True, "intra": "save"},
    "[intra load, transition]": {"is_varlen": True, "mode": "transition", "intra": "load"},
    "[intra load, correction]": {"is_varlen": True, "mode": "correction", "intra": "load"},
}


def register_checked_variants(
    name: str, compile_fn, extra: dict | None = None, sass_allowed: tuple[int, int] = (0, 0)
) -> None:
    """Register ``name + suffix`` for every :data:`CHECKED_VARIANTS` entry (and ``extra`` ones), compiled by
    ``compile_fn(arch, **options)`` for sm_90a, with clean machine code but for ``sass_allowed`` (local-memory
    instructions, injected ``warpgroup.arrive``) in each."""
    for suffix, options in {**CHECKED_VARIANTS, **(extra or {})}.items():
        runtime.register_kernel(
            f"{name}{suffix}",
            ["sm_90a"],
            lambda arch, o=options: compile_fn(arch, **o),
            ["wgmma.mma_async", "cp.async.bulk.tensor"],
            clean_sass=True,
            sass_allowed=sass_allowed,
        )
