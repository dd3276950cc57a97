"""Random inputs of the SM90 chunk entries (GDN, KDA, GLA, simple GLA) at D = 128, for the dev timing scripts (``ab_trees.py``,
``split_pass_times.py``): both draw them here, in one order, so the same random source gives the same tensors."""

import torch
import torch.nn.functional as F


def chunk_inputs(op: str, B: int, T: int, H: int, l2norm: bool, gate_in_kernel: bool, randn, rand):
    """``(q, k, v, g, beta, keyword arguments)`` for ``op``'s SM90 entry, drawn in that order by ``randn(*shape)`` /
    ``rand(*shape)`` (fp32 on the device): q, k, v bf16 (q and k normalised unless ``l2norm``, which the kernel then
    does: ``qk_l2norm``), g = logsigmoid(x + 3) / 2 >= -5 per head (GDN, simple GLA) or per key channel (KDA, GLA),
    beta uniform (GLA and simple GLA take none);
    ``gate_in_kernel`` (KDA as FLA's layer calls it) draws a raw bf16 g, bf16 beta and the gate's A_log / dt_bias."""
    D = 128
    q, k = randn(B, T, H, D), randn(B, T, H, D)
    if not l2norm:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = randn(B, T, H, D)
    gate = (B, T, H, D) if op in ("kda", "gla") else (B, T, H)
    g = (F.logsigmoid(randn(*gate) + 3) / 2).clamp(min=-5)
    beta = rand(B, T, H)
    kw = {"qk_l2norm": True} if l2norm else {}
    if gate_in_kernel:
        g = randn(*gate).to(torch.bfloat16)
        beta = beta.to(torch.bfloat16)
        kw["gate"] = (randn(H), randn(H * D), -5.0)
    return q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), g, beta, kw
