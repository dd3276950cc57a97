"""cuLA as a backend of FLA 0.6.0's registry (`fla.backends`), so unchanged FLA code runs cuLA's kernels.

After ``cula.register_with_fla()`` (or ``import cula`` with ``CULA_REGISTER_FLA=1``), a call to
``fla.ops.kda.chunk_kda``, ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` or
``fla.ops.simple_gla.fused_recurrent_simple_gla`` asks cuLA first: cuLA serves it when its own dispatch picks a
cuLA backend (a CuTe DSL kernel, or the reference backend for tensors FLA's Triton kernels cannot take), and
declines otherwise, so FLA runs its own op. ``FLA_CULA=0`` disables the registration at run time; FLA's
``FLA_DISABLE_BACKEND_DISPATCH=1`` turns all of FLA's dispatch off. Other FLA entry points (``chunk_gla``,
``chunk_simple_gla``) are not dispatchable in FLA: import them from cuLA instead.
"""

from __future__ import annotations

from collections.abc import Callable

from cula import gdn, kda, lightning
from cula.dispatch import explain, inside_fla_call

# FLA entry point -> cuLA function serving it.
DISPATCHED: dict[str, Callable] = {
    "chunk_kda": kda.chunk_kda,
    "chunk_gated_delta_rule": gdn.chunk_gated_delta_rule,
    "fused_recurrent_simple_gla": lightning.fused_recurrent_simple_gla,
}
_registered = False


def _verifier(public: Callable) -> Callable:
    def verify(self, *args, **kwargs) -> tuple[bool, str | None]:
        if inside_fla_call.get():
            return False, "cuLA is itself calling FLA's op"
        decision = explain(public, *args, **kwargs)
        if decision.backend == "fla":
            return False, f"cuLA would hand this call to FLA ({'; '.join(w for _, w in decision.rejected)})"
        return True, None

    return verify


def _implementation(public: Callable) -> Callable:
    def run(self, *args, **kwargs):
        return public(*args, **kwargs)

    return run


def register_with_fla() -> None:
    """Register cuLA in FLA's backend registry (idempotent). Needs ``fla`` importable."""
    global _registered
    if _registered:
        return
    import fla.ops.gated_delta_rule  # noqa: F401  (loads the 'gated_delta_rule' registry)
    import fla.ops.kda
    import fla.ops.simple_gla
    from fla.backends import BaseBackend, register

    methods = {}
    for name, public in DISPATCHED.items():
        methods[name] = _implementation(public)
        methods[f"{name}_verifier"] = _verifier(public)
    backend = type(
        "CulaBackend",
        (BaseBackend,),
        {"backend_type": "cula", "package_name": "cula", "env_var": "FLA_CULA", "priority": 1, **methods},
    )
    register(fla.ops.kda.chunk_kda)(backend)
    register("gated_delta_rule")(backend)
    register(fla.ops.simple_gla.fused_recurrent_simple_gla)(backend)
    _registered = True
