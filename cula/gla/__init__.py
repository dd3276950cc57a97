"""Gated Linear Attention: ``chunk_gla`` and ``fused_recurrent_gla``."""

from cula.gla.api import chunk_gla, fused_recurrent_gla

__all__ = ["chunk_gla", "fused_recurrent_gla"]
