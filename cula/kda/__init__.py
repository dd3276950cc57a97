"""Kimi Delta Attention: ``chunk_kda`` (prefill/training) and ``fused_recurrent_kda`` (decode)."""

from cula.kda.api import chunk_kda, fused_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda"]
