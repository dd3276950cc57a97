"""Context parallelism: one batch of packed sequences split over the ranks of a process group (FLA 0.6.0's
``cp_context``, ``fla.ops.cp``), served by the reference backend on any device and any torch.distributed backend
(gloo on CPUs, NCCL on GPUs).

The tokens ``[0, T)`` (``cu_seqlens`` of the whole batch, ``T`` a multiple of the world size ``W``) are cut into
``W`` equal parts; rank ``r`` holds part ``r`` and calls the op on it, its ``cu_seqlens`` being the part's own
offsets (``CPContext.cu_seqlens``). A sequence may span several ranks: it is the last local sequence of the rank
where it starts, the only one of the ranks in between and the first of the rank where it ends.

The algebra is the one of the single-GPU split (`cula.ops.segment_split`): over a rank's part of a sequence the
recurrence is affine in its start state, ``S_end = M S_start + S_local``, ``M`` (K x K) being the final state of the
``v = 0`` recurrence from ``S = I``, and the outputs are ``o_local`` plus the ``v = 0`` outputs from ``S_start``.
Each rank runs its part from zero (its sequences that start there from their initial states), makes ``M`` of its
first sequence when that one comes from an earlier rank, and all ranks exchange ``[M_first | S_first | S_last]``
in one all_gather. A rank then chains the start of its first sequence through the ranks before it, adds the
correction to that sequence's outputs and, with ``output_final_state``, chains its last sequence on to the rank
where it ends, so that every rank holding part of a sequence returns that sequence's final state.

FLA 0.6.0 refuses ``initial_state`` and ``output_final_state`` under ``cp_context``; here they are indexed by the
local sequences (``initial_state[i]`` starts local sequence ``i``, unused for a first sequence that comes from an
earlier rank).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

# (lo, hi, v [1, hi - lo, HV, V'], initial states [N, HV, K, V'] or None, offsets relative to lo or None) ->
# (o [1, hi - lo, HV, V'], final states [N, HV, K, V']): the reference over tokens [lo, hi) of the local part
TokenRunner = Callable[
    [int, int, torch.Tensor, torch.Tensor | None, list[int] | None], tuple[torch.Tensor, torch.Tensor]
]


@dataclass
class CPContext:
    """A rank's share of a batch split over ``group``, with the attributes of FLA's ``FLACPContext`` (so either
    serves every backend): ``cu_seqlens`` [N_local + 1] the local part's offsets (and ``cu_seqlens_cpu`` a host
    copy); ``pre_num_ranks`` how many earlier ranks hold part of the first local sequence (``is_first_rank`` when
    none), ``post_num_ranks`` how many later ranks hold part of the last one (``is_last_rank`` when none);
    ``pre_num_conv_tokens`` how many tokens of the first local sequence lie on earlier ranks."""

    group: Any = None
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_cpu: torch.Tensor | None = None
    is_last_rank: bool | None = None
    pre_num_ranks: int | None = None
    is_first_rank: bool | None = None
    post_num_ranks: int | None = None
    conv1d_kernel_size: int | None = None
    pre_num_conv_tokens: int | None = None
    pre_num_ranks_dev: torch.Tensor | None = None
    post_num_ranks_dev: torch.Tensor | None = None
    layout: str = "contiguous"

    @property
    def num_seqs(self) -> int:
        return 0 if self.cu_seqlens is None else len(self.cu_seqlens) - 1

    @property
    def is_cp_enabled(self) -> bool:
        return self.group is not None

    def copy_for_backward(self) -> CPContext:
        return replace(
            self,
            cu_seqlens=None if self.cu_seqlens is None else self.cu_seqlens.clone(),
            cu_seqlens_cpu=None if self.cu_seqlens_cpu is None else self.cu_seqlens_cpu.clone(),
        )


def build_cp_context(
    cu_seqlens: torch.Tensor,
    group: Any,
    conv1d_kernel_size: int | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    layout: str = "contiguous",
) -> CPContext:
    """This rank's `CPContext` for the batch with global offsets ``cu_seqlens`` [N + 1] split over ``group`` (as
    ``fla.ops.cp.build_cp_context`` builds it; zero-length sequences are dropped from the local offsets, as there).
    The total token count must be a positive multiple of the world size."""
    if layout == "zigzag":
        raise NotImplementedError(
            "cuLA's build_cp_context makes contiguous layouts; zigzag contexts (fla.ops.cp.build_cp_context) are served "
            "by FLA's kernels on CUDA"
        )
    if layout != "contiguous":
        raise ValueError(f"`layout` must be 'contiguous' or 'zigzag', got {layout!r}")
    world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    offsets = (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).tolist()
    total = offsets[-1]
    if total < world or total % world:
        raise ValueError(f"the total token count ({total}) must be a positive multiple of the world size ({world})")
    part = total // world
    lo, hi = rank * part, (rank + 1) * part
    local = sorted({0, part} | {o - lo for o in offsets if lo < o < hi})
    # the sequences holding the part's first and last tokens
    first_start = max(o for o in offsets if o <= lo)
    last_end = min(o for o in offsets if o >= hi)
    pre, post = rank - first_start // part, (last_end - 1) // part - rank
    local_cpu = torch.tensor(local, dtype=torch.int32)
    return CPContext(
        group=group,
        cu_seqlens=local_cpu.to(cu_seqlens.device),
        cu_seqlens_cpu=local_cpu,
        is_last_rank=post == 0,
        pre_num_ranks=pre,
        is_first_rank=pre == 0,
        post_num_ranks=post,
        conv1d_kernel_size=conv1d_kernel_size,
        pre_num_conv_tokens=lo - first_start,
    )


def validate(args: dict) -> None:
    """Checks a ``cp_context`` call and makes the context's local offsets the call's ``cu_seqlens`` (FLA overrides
    ``cu_seqlens`` with them the same way)."""
    ctx = args.get("cp_context")
    if ctx is None:
        return
    for name in ("cu_seqlens", "group", "pre_num_ranks", "post_num_ranks"):
        if not hasattr(ctx, name):
            raise TypeError(
                f"`cp_context` must be a context from build_cp_context (cula.build_cp_context or "
                f"fla.ops.cp.build_cp_context), got {type(ctx).__name__} without `{name}`"
            )
    if ctx.cu_seqlens is None:
        raise ValueError("`cp_context.cu_seqlens` is required for context parallelism (build it with build_cp_context)")
    if args.get("ssm_state_indices") is not None or args.get("inplace_final_state"):
        raise NotImplementedError("a state pool with cp_context: pass initial_state per local sequence instead")
    args["cu_seqlens"] = ctx.cu_seqlens
    args["cu_seqlens_cpu"] = getattr(ctx, "cu_seqlens_cpu", None)
    if ctx.group is None:
        return
    if getattr(ctx, "layout", "contiguous") != "contiguous":
        return  # FLA's zigzag layout: FLA serves it, the reference refuses it when it gets the call
    if ctx.pre_num_ranks is None or ctx.post_num_ranks is None:
        raise ValueError("`cp_context` lacks pre_num_ranks / post_num_ranks: build it with build_cp_context")
    world, rank = dist.get_world_size(group=ctx.group), dist.get_rank(group=ctx.group)
    if not 0 <= ctx.pre_num_ranks <= rank or not 0 <= ctx.post_num_ranks < world - rank:
        raise ValueError(
            f"`cp_context` of rank {rank} of {world}: pre_num_ranks={ctx.pre_num_ranks}, "
            f"post_num_ranks={ctx.post_num_ranks} point outside the group"
        )


def _requires_grad(tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def forward(args: dict, run: TokenRunner) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The op on this rank's part: ``o`` [1, T_local, HV, V] in the compute dtype and, with ``output_final_state``,
    the final states [N_local, HV, K, V] (``[N_local, HV, V, K]`` with ``state_v_first``) of the local sequences'
    whole sequences."""
    ctx = args["cp_context"]
    if getattr(ctx, "layout", "contiguous") != "contiguous":
        raise NotImplementedError(
            f"cula reference: cp_context layout {ctx.layout!r} (FLA's kernels serve it on CUDA); use 'contiguous'"
        )
    if _requires_grad(args.values()):
        raise NotImplementedError(
            "cula reference: the backward of cp_context calls (the exchange is not differentiated); FLA serves it "
            "on CUDA"
        )
    v_first = args.get("state_v_first", False)
    h0 = args["initial_state"]
    if h0 is not None and v_first:
        h0 = h0.transpose(-1, -2)
    offsets = [int(o) for o in args["cu_seqlens_cpu"].tolist()]
    v = args["v"]
    if ctx.group is None:  # no split: the local sequences are whole
        o, ht = run(0, offsets[-1], v, h0, offsets)
        return o, _final(ht, args)
    pre, post = ctx.pre_num_ranks, ctx.post_num_ranks
    world, rank = dist.get_world_size(group=ctx.group), dist.get_rank(group=ctx.group)
    HV, K, V = v.shape[2], args["k"].shape[3], v.shape[3]
    if pre and h0 is not None:
        h0 = h0.clone()
        h0[0] = 0  # the first sequence starts on an earlier rank: its start comes through the exchange
    o, ht = run(0, offsets[-1], v, h0, offsets)
    first_end = offsets[1]
    if pre:
        zeros = v.new_zeros(1, first_end, HV, K, dtype=ht.dtype)
        eye = torch.eye(K, dtype=ht.dtype, device=ht.device).expand(1, HV, K, K)
        trans = run(0, first_end, zeros, eye, None)[1][0]
    else:  # no earlier rank reads it
        trans = ht.new_zeros(HV, K, K)
    record = torch.cat([trans, ht[0], ht[-1]], -1).contiguous()  # [HV, K, K + 2V]
    records = [torch.empty_like(record) for _ in range(world)]
    dist.all_gather(records, record, group=ctx.group)
    trans_of = [r[..., :K] for r in records]
    first_of = [r[..., K : K + V] for r in records]  # state after a rank's first sequence (its only one between)
    last_of = [r[..., K + V :] for r in records]
    if pre:
        start = last_of[rank - pre]
        for m in range(rank - pre + 1, rank):
            start = torch.baddbmm(first_of[m], trans_of[m], start)
        o_hom, h_hom = run(0, first_end, torch.zeros_like(v[:, :first_end]), start.unsqueeze(0), None)
        o[:, :first_end] += o_hom
        ht[0] += h_hom[0]
    if not args["output_final_state"]:
        return o, None
    state = ht[-1]
    for m in range(rank + 1, rank + post + 1):
        state = torch.baddbmm(first_of[m], trans_of[m], state)
    ht[-1] = state
    return o, _final(ht, args)


def _final(ht: torch.Tensor, args: dict) -> torch.Tensor | None:
    if not args["output_final_state"]:
        return None
    return (ht.transpose(-1, -2) if args.get("state_v_first", False) else ht).contiguous()
