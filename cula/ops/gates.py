"""In-kernel input transforms of FLA 0.6.0, in fp32 PyTorch.

Each function mirrors the formula FLA's kernels apply when the matching ``*_in_kernel`` flag is set:
``fla/modules/norm/l2norm.py``, ``fla/ops/common/gate.py`` (beta sigmoid), ``fla/ops/gated_delta_rule/gate.py`` and
``fla/ops/kda/gate.py``. Results are fp32 (fp64 when the input is fp64).
"""

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6
# The floor of a token's natural-log gate in the kernels and their emulations: exp(-200) is below fp32's smallest
# subnormal, so the floor changes no product, while -inf (a full state reset) would make the differences of a chunk's
# cumulative gates NaN. A gate below it takes no gradient.
GATE_FLOOR = -200.0
# The widest exponent (log2 units) of the per-key-gate kernels' block operands (q_i 2^(G_i - G_r), k_j 2^(G_r - G_j)
# against a reference token r) with which their scores stay exact up to bf16 rounding: within 2^-108 a left factor
# flushed to zero (the fast exp2 flushes below 2^-126) drops less than 2^-18 of a score. A steeper chunk's scores are
# summed directly.
GLA_SAFE_SPAN = 108.0


def to_compute(x: torch.Tensor) -> torch.Tensor:
    """Upcast to the compute dtype: fp32, or fp64 when ``x`` already is fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (FLA's ``l2norm_fwd``; eps is added under the root)."""
    x = to_compute(x)
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def beta_sigmoid(beta: torch.Tensor, allow_neg_eigval: bool = False) -> torch.Tensor:
    """``sigmoid(beta)``, doubled to ``[0, 2)`` when ``allow_neg_eigval`` (FLA's ``fused_beta_sigmoid``)."""
    beta = torch.sigmoid(to_compute(beta))
    return beta * 2 if allow_neg_eigval else beta


def gdn_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """GDN decay ``-exp(A_log) * softplus(g + dt_bias)``; ``g`` is ``[..., HV]``, ``A_log``/``dt_bias`` ``[HV]``."""
    g = to_compute(g)
    if dt_bias is not None:
        g = g + dt_bias.to(g.dtype)
    return -A_log.to(g.dtype).exp() * F.softplus(g)


def kda_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """KDA per-key decay for ``g`` of shape ``[..., HV, K]``, ``A_log`` ``[HV]``, ``dt_bias`` ``[HV * K]``.

    Without ``lower_bound``: ``-exp(A_log) * softplus(g + dt_bias)``.
    With ``lower_bound`` (FLA applies it whenever it is set, whatever ``safe_gate`` says):
    ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``, and ``lower_bound * sigmoid(g + dt_bias)`` if ``A_log`` is None.
    """
    g = to_compute(g)
    HV = g.shape[-2]
    if dt_bias is not None:
        g = g + dt_bias.to(g.dtype).view(HV, -1)
    if lower_bound is None:
        return -A_log.to(g.dtype).view(HV, 1).exp() * F.softplus(g)
    if A_log is not None:
        g = A_log.to(g.dtype).view(HV, 1).exp() * g
    return lower_bound * torch.sigmoid(g)


def qk_beta_transforms(args: dict, beta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q/k L2 norm and the beta sigmoid of the delta-rule ops (GDN and KDA share them), as an entry point's
    bound arguments ask for them; ``beta`` replaces ``args["beta"]`` when given."""
    q, k = args["q"], args["k"]
    beta = args["beta"] if beta is None else beta
    if args["use_qk_l2norm_in_kernel"]:
        q, k = l2norm(q), l2norm(k)
    if args["use_beta_sigmoid_in_kernel"]:
        beta = beta_sigmoid(beta, args["allow_neg_eigval"])
    return q, k, beta


def kernel_beta(args: dict) -> torch.Tensor:
    """beta for a delta-rule kernel from an entry point's bound arguments: sigmoid when asked (on a GPU FLA's own
    Triton pass, one read and one write, the very values FLA's fused path feeds its kernels; elsewhere the fp32
    formula above), in fp32 or bf16, contiguous. The kernels L2-normalise q and k themselves."""
    beta = args["beta"]
    if args["use_beta_sigmoid_in_kernel"]:
        if beta.is_cuda:
            from fla.ops.common.gate import fused_beta_sigmoid

            beta = fused_beta_sigmoid(beta.contiguous(), scale=2.0 if args["allow_neg_eigval"] else 1.0)
        else:
            beta = beta_sigmoid(beta, args["allow_neg_eigval"])
    if beta.dtype not in (torch.float32, torch.bfloat16):
        beta = beta.float()
    return beta.contiguous()


def kernel_gdn_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`gdn_gate` in fp32 for a kernel's input: FLA's Triton ``gdn_gate_fwd`` on a GPU (one pass)."""
    if g.is_cuda:
        from fla.ops.gated_delta_rule.gate import gdn_gate_fwd

        return gdn_gate_fwd(g.contiguous(), A_log, dt_bias, output_dtype=torch.float32)
    return gdn_gate(g, A_log, dt_bias).float()


def kernel_kda_gate(
    g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float | None
) -> torch.Tensor:
    """:func:`kda_gate` in fp32 for a kernel's input: FLA's Triton ``kda_gate_fwd`` on a GPU (one pass)."""
    if g.is_cuda:
        from fla.ops.kda.gate import kda_gate_fwd

        return kda_gate_fwd(g.contiguous(), A_log, dt_bias, lower_bound, output_dtype=torch.float32)
    return kda_gate(g, A_log, dt_bias, lower_bound).float()
