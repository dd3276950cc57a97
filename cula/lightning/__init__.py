"""Lightning Attention and simple GLA (scalar per-head decay)."""

from cula.lightning.api import (
    chunk_lightning_attn,
    chunk_simple_gla,
    fused_recurrent_lightning_attn,
    fused_recurrent_simple_gla,
)

__all__ = ["chunk_lightning_attn", "chunk_simple_gla", "fused_recurrent_lightning_attn", "fused_recurrent_simple_gla"]
