"""Peer implementations timed beside cuLA and FLA on the same inputs, through adapters that convert FLA's
conventions to theirs and their results back.

FlashInfer's GDN prefill (``flashinfer.gdn_prefill.chunk_gated_delta_rule``, flashinfer-python 0.7.2; on SM90 a
CuTe DSL kernel) takes packed tokens ``[total_T, H, D]`` with ``cu_seqlens`` always, the linear decay
``alpha = exp(g)`` and the activated beta as fp32 ``[total_T, HV]``, states ``[N, HV, V, K]`` (the transpose of
FLA's ``[N, HV, K, V]``), and q / k as given (no in-kernel L2 norm in the shipped kit). Its default ``use_cp="auto"``
runs a four-kernel context-parallel pipeline when sequences x heads are few; ``use_cp=False`` forces its one fused
kernel. Both are timed: the faster is the peer to beat.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# The peer's two routes: as a user calls it (its own choice of route), and its single fused kernel forced.
FLASHINFER_ROUTES = {"auto": "auto", "fused": False}


@dataclass
class FlashInferGDN:
    """FlashInfer's GDN prefill on one benchmark call's arguments (FLA's conventions: ``[B, T, H, D]`` tensors, a
    natural-log gate ``g``, states ``[N, HV, K, V]``). ``prefill`` is ``flashinfer.gdn_prefill.
    chunk_gated_delta_rule`` or anything with its contract (the CPU tests pass a stand-in)."""

    prefill: Callable

    @classmethod
    def load(cls) -> FlashInferGDN | None:
        """The adapter, or None where FlashInfer is not importable."""
        try:
            from flashinfer.gdn_prefill import chunk_gated_delta_rule
        except Exception:  # any import failure means: no FlashInfer column
            return None
        return cls(chunk_gated_delta_rule)

    @staticmethod
    def declines(args: dict) -> str:
        """Why FlashInfer cannot take these arguments as they are ("" if it can)."""
        if args["q"].shape[-1] != 128:
            return "FlashInfer's SM90 GDN prefill takes D = 128 only"
        if args.get("use_qk_l2norm_in_kernel"):
            return "in-kernel q/k L2 norm needs a FlashInfer JIT module the kit does not ship"
        if args.get("use_gate_in_kernel") or args.get("use_beta_sigmoid_in_kernel"):
            return "gate / beta activation in the op is not FlashInfer's contract"
        return ""

    def convert(self, args: dict) -> dict:
        """FlashInfer's keyword arguments for this call (the conversions happen here, outside any timed region)."""
        q, k, v = args["q"], args["k"], args["v"]
        B, T = q.shape[:2]
        cu = args.get("cu_seqlens")
        if cu is None:
            cu = torch.arange(B + 1, device=q.device, dtype=torch.int32) * T
        h0 = args.get("initial_state")
        converted = {
            "q": q.reshape(B * T, *q.shape[2:]).contiguous(),
            "k": k.reshape(B * T, *k.shape[2:]).contiguous(),
            "v": v.reshape(B * T, *v.shape[2:]).contiguous(),
            "g": args["g"].float().exp().reshape(B * T, -1).contiguous(),
            "beta": args["beta"].float().reshape(B * T, -1).contiguous(),
            "scale": args.get("scale"),
            "initial_state": None if h0 is None else h0.transpose(-1, -2).contiguous(),
            "output_final_state": True,
            "cu_seqlens": cu,
        }
        return converted

    def call(self, converted: dict, route: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """One call on converted arguments; returns FlashInfer's own ``(o [total_T, HV, V], state [N, HV, V, K])``."""
        return self.prefill(**converted, use_cp=FLASHINFER_ROUTES[route])

    @staticmethod
    def back(args: dict, o: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FlashInfer's outputs in FLA's conventions: ``(o [B, T, HV, V], final state [N, HV, K, V])``."""
        B, T = args["q"].shape[:2]
        return o.reshape(B, T, *o.shape[1:]), state.transpose(-1, -2)
