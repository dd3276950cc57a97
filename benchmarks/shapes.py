"""The benchmark's cases: named grids of shapes and the custom shape forms ``--shapes`` takes.

Custom forms (D comes from ``--head-dim``):

- ``BxTxH``, e.g. ``2x16384x64``: B sequences of T tokens with H heads.
- ``L1+L2+...xH``, e.g. ``8192+512+4096x32``: one variable-length call (B = 1, ``cu_seqlens``) of two sequences
  or more, of these lengths (zero allowed), with H heads.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass


@dataclass
class Case:
    op: str
    B: int
    T: int
    H: int
    D: int
    lengths: list[int] | None = None  # varlen: the sequence lengths (then B == 1)
    label: str = ""
    # GDN as FLA's GatedDeltaNet layer calls it: raw q and k, L2-normalised by the op (use_qk_l2norm_in_kernel)
    layer: bool = False

    @property
    def name(self) -> str:
        if self.lengths is not None:
            return f"varlen {self.label} N={len(self.lengths)} T={sum(self.lengths)} H={self.H}"
        return f"B={self.B} T={self.T} H={self.H}" + (" l2norm in op" if self.layer else "")


def varlen_lengths(kind: str, n: int, total: int, rng: random.Random) -> list[int]:
    """``n`` lengths summing to ``total``: uniform, random, or skewed (one long sequence, many short)."""
    if kind == "uniform":
        base = [total // n] * n
    elif kind == "random":
        cuts = sorted(rng.sample(range(1, total), n - 1))
        base = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    else:  # skewed: half of the tokens in one sequence
        rest = total // 2
        base = [total - rest] + [rest // (n - 1)] * (n - 1)
    base[-1] += total - sum(base)
    return base


def _varlen_mixes() -> list[tuple[str, list[int]]]:
    # One generator for the whole grid, drawn in this order: the lengths of the committed H200 results, the same
    # for every op and whichever grids run beside it.
    rng = random.Random(0)
    return [
        (kind, varlen_lengths(kind, n, total, rng))
        for n, total in ((10, 4096 * 4), (20, 16384 * 2))
        for kind in ("uniform", "random", "skewed")
    ]


VARLEN_MIXES = _varlen_mixes()

# name -> what it holds (for --help and --list)
GRIDS = {
    "core": "B=1 T=8192 H=64, B=2 T=16384 H=64, B=8 T=2048 H=32",
    "varlen": "10 sequences in 16384 tokens and 20 in 32768, H=32: uniform, random and skewed lengths",
    "long": "B=1 T=65536 H=8",
    "layer": "GDN only: B=2 T=16384 H=64 and B=1 T=8192 H=64 with raw q/k L2-normalised by the op",
    "smoke": "B=1 T=256 H=2 and varlen 100+3+153 H=2: small enough for the CPU check",
}


def grid(name: str, op: str, D: int) -> list[Case]:
    """The cases of the named grid ``name`` for ``op`` at head dimension ``D``."""
    if name == "core":
        return [Case(op, 1, 8192, 64, D), Case(op, 2, 16384, 64, D), Case(op, 8, 2048, 32, D)]
    if name == "varlen":
        return [Case(op, 1, sum(lengths), 32, D, lengths, kind) for kind, lengths in VARLEN_MIXES]
    if name == "long":
        return [Case(op, 1, 65536, 8, D)]
    if name == "layer":
        return [Case(op, 2, 16384, 64, D, layer=True), Case(op, 1, 8192, 64, D, layer=True)] if op == "gdn" else []
    if name == "smoke":
        return [Case(op, 1, 256, 2, D), Case(op, 1, 256, 2, D, [100, 3, 153], "smoke")]
    raise KeyError(name)


_DENSE = re.compile(r"(\d+)x(\d+)x(\d+)")
_VARLEN = re.compile(r"(\d+(?:\+\d+)+)x(\d+)")  # two lengths or more: "2x16384" is no varlen call


def check_shape(spec: str) -> str:
    """``spec`` if it names a grid or is a well-formed custom shape, else ValueError saying what ``--shapes`` takes."""
    if spec in GRIDS:
        return spec
    if _DENSE.fullmatch(spec) or _VARLEN.fullmatch(spec):
        case = custom(spec, "", 1)
        if min(case.B, case.T, case.H) > 0:
            return spec
    raise ValueError(f"{spec!r} is neither a grid ({', '.join(GRIDS)}) nor BxTxH or L1+L2+...xH with positive sizes")


def custom(spec: str, op: str, D: int) -> Case:
    """The case a custom shape ``spec`` (``BxTxH`` or ``L1+L2+...xH``) describes."""
    if m := _DENSE.fullmatch(spec):
        B, T, H = (int(x) for x in m.groups())
        return Case(op, B, T, H, D)
    m = _VARLEN.fullmatch(spec)
    lengths = [int(x) for x in m[1].split("+")]
    return Case(op, 1, sum(lengths), int(m[2]), D, lengths, m[1])


def cases(ops: list[str], shapes: list[str], D: int) -> list[Case]:
    """Every op's cases for ``shapes`` (grid names and custom shapes, in the order given), each case once."""
    out = []
    for op in ops:
        seen = set()
        for spec in shapes:
            for case in grid(spec, op, D) if spec in GRIDS else [custom(spec, op, D)]:
                if case.name not in seen:
                    seen.add(case.name)
                    out.append(case)
    return out
