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


@dataclass
class FlashInferGDNDecode:
    """FlashInfer's GDN decode (``flashinfer.gdn_decode.gated_delta_rule_decode_pretranspose``; on SM90 its CuTe DSL
    kernels: fp32 states by its legacy kernel, bf16 states by its bf16 fast path) on a state pool ``[slots, HV, V,
    K]`` read and written in place by ``initial_state_indices``, one token per sequence. Its gate is in the op:
    g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), with q / k L2-normalised: what cuLA's
    ``fused_recurrent_gated_delta_rule`` computes with ``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``,
    ``use_qk_l2norm_in_kernel`` and ``state_v_first`` (:meth:`cula_arguments`). ``decode`` is FlashInfer's function
    or anything with its contract (the CPU tests pass a stand-in)."""

    decode: Callable

    @classmethod
    def load(cls) -> FlashInferGDNDecode | None:
        """The adapter, or None where FlashInfer's decode is not importable (``tools/flashinfer_decode_kit.py``
        adds it to the GPU machine's kit)."""
        try:
            from flashinfer.gdn_decode import gated_delta_rule_decode_pretranspose
        except Exception:  # any import failure means: no FlashInfer column
            return None
        return cls(gated_delta_rule_decode_pretranspose)

    @staticmethod
    def declines(q: torch.Tensor, pool: torch.Tensor) -> str:
        """Why FlashInfer's decode cannot take this call ("" if it can)."""
        K, V = q.shape[-1], pool.shape[-2]
        if pool.dtype == torch.bfloat16 and (K, V) != (128, 128):
            return "FlashInfer's bf16-state decode takes K = V = 128 only"
        if pool.dtype == torch.float32 and (K < 128 or V < 128 or V % 8):
            return "FlashInfer's fp32-state decode takes K, V >= 128 (V a multiple of 8)"
        return ""

    def call(self, gate: dict, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One decode step: ``gate`` holds q, k, v [N, 1, H, D], a, b [N, 1, HV], A_log, dt_bias [HV]; ``pool``
        [slots, HV, V, K] updated in place. Returns o [N, 1, HV, V]."""
        o, _ = self.decode(
            gate["q"], gate["k"], gate["v"], None, gate["A_log"], gate["a"], gate["dt_bias"], gate["b"],
            use_qk_l2norm=True, initial_state=pool, initial_state_indices=slots,
        )  # fmt: skip
        return o

    @staticmethod
    def cula_arguments(gate: dict, pool: torch.Tensor, slots: torch.Tensor) -> dict:
        """The same step as keyword arguments of ``cula.gdn.fused_recurrent_gated_delta_rule``."""
        return {
            "q": gate["q"], "k": gate["k"], "v": gate["v"], "g": gate["a"], "beta": gate["b"],
            "use_gate_in_kernel": True, "A_log": gate["A_log"], "dt_bias": gate["dt_bias"],
            "use_beta_sigmoid_in_kernel": True, "use_qk_l2norm_in_kernel": True, "state_v_first": True,
            "initial_state": pool, "ssm_state_indices": slots,
        }  # fmt: skip
