"""Gated DeltaNet: ``chunk_gated_delta_rule`` (prefill/training) and ``fused_recurrent_gated_delta_rule`` (decode)."""

from cula.gdn.api import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "chunk_gdn", "fused_recurrent_gated_delta_rule", "fused_recurrent_gdn"]
