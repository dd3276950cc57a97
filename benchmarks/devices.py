"""Peak rates the benchmark's floor is counted against: bf16 dense matmul TFLOP/s and device-to-device copy GB/s,
measured per GPU (a rate reached in practice, not the datasheet's), with a default for GPUs not in the table.

To add a GPU: time a large bf16 ``torch.matmul`` and a large ``Tensor.copy_`` on it (read + write bytes over time)
and add an entry under its name as ``torch.cuda.get_device_name()`` spells it. (Dispatch's time model per GPU,
``cula/devices.py``, is keyed by the same names.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peaks:
    name: str
    tflops: float  # bf16 dense matmul
    gbps: float  # device copy, bytes read + written per second
    measured: bool  # False: the default, not measured on this GPU

    @property
    def how(self) -> str:
        return f"measured on the {self.name}" if self.measured else "default, not measured on this GPU"

    def describe(self) -> str:
        return f"{self.tflops:g} TFLOP/s bf16 matmul, {self.gbps:g} GB/s copy ({self.how})"


# By the exact device name: a near name is another part (the H100 PCIe and NVL, the GH200, the H200 NVL run at other
# clocks and power limits) and gets the default.
TABLE = {
    "NVIDIA H200": Peaks("H200", 687.0, 4300.0, True),
    "NVIDIA H100 80GB HBM3": Peaks("H100 SXM", 798.0, 3000.0, True),
}

# Elsewhere: the fastest measured rate of each kind, so that a GPU slower than those in the table never shows
# a larger fraction of its floor than it reaches (a faster one's fraction is overstated: the output says so).
DEFAULT = Peaks("default", max(p.tflops for p in TABLE.values()), max(p.gbps for p in TABLE.values()), measured=False)


def peaks_for(device_name: str) -> Peaks:
    """The table's entry for a GPU named ``device_name`` (``torch.cuda.get_device_name``), else ``DEFAULT``."""
    return TABLE.get(device_name, DEFAULT)
