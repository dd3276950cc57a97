"""Dispatch's time model per GPU: FLA's forward time per op and each SM90 chunk kernel's, measured on the GPUs of
:data:`TABLE`, with :data:`DEFAULT` for the others and for what a row does not hold.

A row is keyed by the exact device name, as ``torch.cuda.get_device_properties(device).name`` spells it: a near name
is another part (the H100 PCIe and NVL, the GH200, the H200 NVL run at other clocks, power limits and memory
bandwidths) and gets the default. A row holds only what was measured on its GPU. Every read of the model goes through
:func:`times_for`. ``python scripts/calibrate_dispatch.py`` on a GPU prints a row for it (DESIGN.md, "Dispatch").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cula import runtime
from cula.ops import segment_split
from cula.ops.segment_split import SplitCost

OPS = ("gdn", "kda")
# The SM90 kernels' time models: GDN without and with q/k L2 norm in the kernel, KDA, GLA.
KERNELS = ("gdn", "gdn_l2norm", "kda", "gla")


@dataclass(frozen=True)
class FlaTime:
    """FLA's forward time for one op on one GPU: ``ns_per_token_head`` per token and value head, never under
    ``min_ms`` (its host time per call) nor under ``chunk_us`` per chunk of the longest sequence (its state pass
    walks a sequence's chunks in series, which dominates for one long sequence with few heads)."""

    ns_per_token_head: float
    min_ms: float
    chunk_us: float = 0.0

    def ms(self, lengths: list[int], HV: int) -> float:
        """Expected ms for sequences of these token counts over ``HV`` value heads."""
        chain = self.chunk_us * -(-max(lengths, default=0) // segment_split.CHUNK) / 1e3
        return max(self.ns_per_token_head * sum(lengths) * HV / 1e6, self.min_ms, chain)


@dataclass(frozen=True)
class KernelTime:
    """An SM90 chunk kernel's forward time on one GPU: ``chunk_us`` microseconds per chunk one CTA walks (one CTA per
    SM), and its split passes' costs in units of such a chunk (``split``, which the split planner reads too)."""

    chunk_us: float
    split: SplitCost

    def ms(self, lengths: list[int], HV: int, num_sms: int) -> float:
        """Expected ms for sequences of these token counts over ``HV`` value heads on ``num_sms`` SMs, split where
        the planner splits them (:func:`cula.ops.segment_split.chunk_walk_ms`)."""
        return segment_split.chunk_walk_ms(lengths, HV, num_sms, self.chunk_us, True, self.split)


@dataclass(frozen=True)
class DeviceTimes:
    """One GPU's time models: ``fla`` by op (:data:`OPS`), ``kernels`` by kernel time model (:data:`KERNELS`)."""

    label: str
    fla: dict[str, FlaTime] = field(default_factory=dict)
    kernels: dict[str, KernelTime] = field(default_factory=dict)


# -- the H200 (benchmarks/results/h200_fwd.json, D = 128, bf16, and the per-pass timings of PERF.md) ----------------

# FLA 0.6.0's chunk_gated_delta_rule: about 1.65 ns per token-head (B1 T8192 H64 1.66, B2 T16384 H64 1.62), never
# under its host time per call on tiny inputs (0.38 ms), nor under 1.75 us per chunk of the longest sequence
# (B1 T65536 H8: 1024 chunks, 1.795 ms in an earlier run, 1.800 ms in the JSON).
H200_FLA_GDN = FlaTime(ns_per_token_head=1.65, min_ms=0.38, chunk_us=1.75)
# FLA's chunk_kda (safe_gate, lower_bound=-5): about 3.2 ns per token-head; its minimum per call is taken from
# GDN's; one long sequence walks its chunks in series at about 2.9 us each (B1 T65536 H8: 2.976 ms in an earlier run,
# 2.942 ms in the JSON).
H200_FLA_KDA = FlaTime(ns_per_token_head=3.2, min_ms=0.38, chunk_us=2.9)

# GDN: one CTA walks its chunks in series at about 3.7 us each (B2 T16384 H64: 256 chunks per CTA in one wave, ~0.94
# ms through the public entry); with qk_l2norm (the norms folded into the gates) 3.9 us: 0.968 ms against 0.912
# without, same process.
H200_GDN_CHUNK_US = 3.7
H200_GDN_L2NORM_CHUNK_US = 3.9
# A split sequence's first pass saves each chunk's Tinv and P, the later passes load them and run the state chain
# alone. Per chunk (B1 T65536 H8 cut every 64 chunks, 128 CTAs, events around each launch): first pass 3.47 us,
# correction 2.61 (2.34 at B1 T32768 H16), transition 1.40; at 64 CTAs 3.32 / 2.06 / 1.14 (correction taken as
# 2.3). A split call spends ~25 us more once and ~0.5 us per link of the start chain and value head; on the skewed
# varlen mixes (H32) each CTA wave beyond a pass's first costs ~7 us. These fit ten split and unsplit timings within
# ~10 %. With qk_l2norm the later passes are taken as 0.2 us per chunk slower (fits the measured B1 T65536 H8, B1
# T32768 H16 and B1 T8192 H64 calls). A sequence walked by few CTAs runs faster than at full load: 3.2-3.36 us per
# chunk at 8-32 CTAs (``lone``).
_GDN_LONE = 3.25 / H200_GDN_CHUNK_US
H200_GDN_SPLIT = SplitCost.from_us(
    H200_GDN_CHUNK_US, 2.3, 1.4, 0.5, cached=True, first=3.47, fixed=25, wave=7, lone=_GDN_LONE
)
H200_GDN_L2NORM_SPLIT = SplitCost.from_us(
    H200_GDN_L2NORM_CHUNK_US, 2.5, 1.6, 0.5, cached=True, fixed=25, wave=7, lone=_GDN_LONE
)._replace(first=H200_GDN_SPLIT.first)  # the same fraction of a whole chunk as without qk_l2norm

# KDA: about 8.2 us per chunk and CTA (the benchmark's setting: 2.094 ms at B2 T16384 H64 = 256 chunks per CTA in
# one wave). A split sequence's first pass also saves its B tiles and 2^G_last; the later passes load them and make
# only the state products. Per chunk (B1 T8192 H64 and B1 T65536 H8, 128 CTAs per pass): first pass 9.01-9.11 us,
# correction 3.93-4.08, transition 2.55; a link of the start chain ~0.5 us per value head.
H200_KDA_CHUNK_US = 8.2
H200_KDA_SPLIT = SplitCost.from_us(H200_KDA_CHUNK_US, 4.0, 2.55, 0.5, cached=True, first=9.05)

H200 = DeviceTimes(
    "H200",
    fla={"gdn": H200_FLA_GDN, "kda": H200_FLA_KDA},
    kernels={
        "gdn": KernelTime(H200_GDN_CHUNK_US, H200_GDN_SPLIT),
        "gdn_l2norm": KernelTime(H200_GDN_L2NORM_CHUNK_US, H200_GDN_L2NORM_SPLIT),
        "kda": KernelTime(H200_KDA_CHUNK_US, H200_KDA_SPLIT),
    },
)

# -- the H100 SXM (benchmarks/results/h100_gdn_fwd_flashinfer.json: GDN forward only, D = 128, bf16, the kernel code
# and software of the H200's JSON) --------------------------------------------------------------------------------

# FLA's GDN: 2.05 ns per token-head, the mean of its B1 T8192 H64 and B2 T16384 H64 rows (2.07, 2.03), as the H200's
# 1.65 is about the mean of the same rows there (its H32 and varlen rows: 2.11-2.17); 1.86 us per chunk from B1
# T65536 H8 (1.900 ms over 1024 chunks). Its minimum per call is host time, more the host's than the GPU's, and was not measured apart: the H200's.
# The GDN kernel: 3.57 us per chunk from B2 T16384 H64 (0.915 ms over 256 chunks per CTA in one wave), the row the
# H200's 3.7 was fitted to (there ~0.94 ms in that run, 0.896 ms in the H200's JSON). Its split passes were not timed
# apart: the H200's fractions of a chunk. (The model runs 14-24 % under the N=20 mixes and B1 T65536 H8, which spent
# 40-64 % of their time issuing the call on the host.)
# GLA (benchmarks/results/h100_gla_fwd.json): 5.6 us per chunk from B2 T16384 H64 (1.432 ms over 256 chunks per CTA
# in one wave). Its split passes are uncached and were not timed apart; estimated from what they skip: a correction
# pass makes no P (~70 % of a chunk), a transition pass neither P nor output (~50 %); GDN's link, fixed and wave costs.
H100_GLA_CHUNK_US = 5.6
H100_GLA_SPLIT = SplitCost.from_us(H100_GLA_CHUNK_US, 3.9, 2.8, 0.5, fixed=25, wave=7)
# KDA and GDN with the q/k norm (benchmarks/results/h100_fwd.json, the four forwards in one run), fitted as GDN's:
# the KDA kernel 7.9 us per chunk and the normed GDN kernel 3.74 from B2 T16384 H64 (2.024 and 0.959 ms over 256
# chunks per CTA in one wave), with the H200's split fractions; FLA's KDA 4.05 ns per token-head (the mean of its B1
# T8192 H64 and B2 T16384 H64 rows, 4.09 and 4.00) and 3.18 us per chunk from B1 T65536 H8 (3.261 ms over 1024
# chunks), its minimum the H200's. Against that run's KDA rows the model gives FLA within 5 %, and the kernel within
# 5 % on the unsplit rows and 10-21 % under on those the planner splits, as GDN's.
H100_SXM = DeviceTimes(
    "H100 SXM",
    fla={
        "gdn": FlaTime(ns_per_token_head=2.05, min_ms=H200_FLA_GDN.min_ms, chunk_us=1.86),
        "kda": FlaTime(ns_per_token_head=4.05, min_ms=H200_FLA_KDA.min_ms, chunk_us=3.18),
    },
    kernels={
        "gdn": KernelTime(3.57, H200_GDN_SPLIT),
        "gdn_l2norm": KernelTime(3.74, H200_GDN_L2NORM_SPLIT),
        "kda": KernelTime(7.9, H200_KDA_SPLIT),
        "gla": KernelTime(H100_GLA_CHUNK_US, H100_GLA_SPLIT),
    },
)

TABLE = {"NVIDIA H200": H200, "NVIDIA H100 80GB HBM3": H100_SXM}


def default_times(table: dict[str, DeviceTimes]) -> DeviceTimes:
    """The time models for a GPU not in ``table``, and for what a row lacks: each of FLA's constants at its smallest
    measured value, each kernel at its largest measured chunk time (with that row's split costs, which the rows share
    today). The kernel is then chosen only where it is expected to win on every measured GPU; the kernel's side
    counts the device's own SMs (DESIGN.md, "Dispatch", says why nothing else is scaled)."""
    rows = list(table.values())
    fla = {}
    for op in OPS:
        measured = [row.fla[op] for row in rows if op in row.fla]
        fla[op] = FlaTime(
            min(m.ns_per_token_head for m in measured),
            min(m.min_ms for m in measured),
            min(m.chunk_us for m in measured),
        )
    kernels = {
        name: max((row.kernels[name] for row in rows if name in row.kernels), key=lambda k: k.chunk_us)
        for name in KERNELS
    }
    return DeviceTimes("default", fla, kernels)


DEFAULT = default_times(TABLE)


# Each row completed by the default, made once (dispatch and the split planner ask several times a call): row name ->
# (the row, the default, the completed row), made again when either is replaced (tests pretend to other rows)
_COMPLETED: dict[str, tuple[DeviceTimes, DeviceTimes, DeviceTimes]] = {}


def times_for(device: torch.device | int | None = None) -> DeviceTimes:
    """The time models of ``device`` (a CUDA device, by its name): its row completed by :data:`DEFAULT`, or
    :data:`DEFAULT` for a GPU not in :data:`TABLE`. Shared: callers leave it unchanged."""
    name = runtime.device_properties(device).name
    row = TABLE.get(name)
    if row is None:
        return DEFAULT
    seen = _COMPLETED.get(name)
    if seen is None or seen[0] is not row or seen[1] is not DEFAULT:
        completed = DeviceTimes(row.label, {**DEFAULT.fla, **row.fla}, {**DEFAULT.kernels, **row.kernels})
        seen = _COMPLETED[name] = (row, DEFAULT, completed)
    return seen[2]
