"""cula.runtime's host-side helpers: device properties read once, and plans made on the host and copied to a GPU kept
per stream, never while a stream captures a CUDA graph."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from cula import runtime
from cula.ops import chunk_backward


def test_a_devices_properties_are_read_once(monkeypatch):
    reads = []

    def properties(device=None):
        reads.append(device)
        return SimpleNamespace(multi_processor_count=132, name="NVIDIA H200")

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    assert runtime.sm_count(torch.device("cuda:1")) == 132
    assert runtime.device_properties(1).name == "NVIDIA H200"
    assert reads == [1]
    runtime.forget_devices()
    runtime.sm_count(torch.device("cuda:1"))
    assert reads == [1, 1]


def test_a_device_that_names_no_index_follows_the_current_device(monkeypatch):
    """A tensor's device (with its index) is read once and then found as it is; a bare ``cuda`` is the current device,
    whichever that is at the call."""
    reads, current = [], [0]

    def capability(index):
        reads.append(index)
        return (9, index)

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    assert runtime.device_capability(torch.device("cuda:1")) == (9, 1)
    assert runtime.device_capability(torch.device("cuda:1")) == (9, 1) and reads == [1]
    assert runtime.device_capability(torch.device("cuda")) == (9, 0)
    current[0] = 1
    assert runtime.device_capability(torch.device("cuda")) == (9, 1)
    assert runtime.device_capability("cuda") == (9, 1) and runtime.device_capability(None) == (9, 1)
    assert reads == [1, 0]


def test_device_plans_are_kept_per_stream_and_read_by_any_capture(monkeypatch):
    made = []

    @runtime.device_plan_cache(maxsize=2)
    def plan(device, n):
        made.append(n)
        return object()

    stream = SimpleNamespace(stream_id=1)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    first = plan("cuda:0", 3)
    assert plan("cuda:0", 3) is first and made == [3]
    stream.stream_id = 2  # another stream: made again (the first copy may not have landed there)
    second = plan("cuda:0", 3)
    assert second is not first and made == [3, 3]
    capturing[0] = True  # a capture reads what eager calls made (the device synchronised before it)
    assert plan("cuda:0", 3) is second and made == [3, 3]
    fresh = plan("cuda:0", 4)  # first made while capturing: not kept
    assert plan("cuda:0", 4) is not fresh and made == [3, 3, 4, 4]
    capturing[0] = False
    plan("cuda:0", 5)
    plan("cuda:0", 6)  # two entries at most: 3's is gone
    assert plan("cuda:0", 3) is not second and made[-1] == 3
    assert plan("cpu", 3) is plan("cpu", 3)  # off CUDA: one per device


def test_a_copy_captured_in_a_cuda_graph_keeps_its_pinned_source(monkeypatch):
    """A graph's replays copy from the pinned buffer again: the one made during a capture is held, an eager one is
    not (torch's host cache takes it back once the copy is done)."""
    pinned = []

    class Host(torch.Tensor):
        def pin_memory(self):
            pinned.append(self.clone())
            return pinned[-1]

    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: self)  # no GPU here: the copy is the source
    monkeypatch.setattr(runtime, "_CAPTURED_SOURCES", [])
    runtime.host_to_device(torch.arange(3).as_subclass(Host), "cuda:0")
    assert runtime._CAPTURED_SOURCES == []
    capturing[0] = True
    runtime.host_to_device(torch.arange(3).as_subclass(Host), "cuda:0")
    assert len(runtime._CAPTURED_SOURCES) == 1 and runtime._CAPTURED_SOURCES[0] is pinned[-1]
    assert runtime.host_to_device(torch.arange(3), "cpu").tolist() == [0, 1, 2]  # a CPU device: the tensor itself


def test_the_chunk_rows_index_is_kept_per_batch_layout():
    index, rows, kernel_rows = chunk_backward.chunk_rows([0, 100, 200], True)
    again = chunk_backward.chunk_rows([0, 100, 200], True)
    other, other_rows, _ = chunk_backward.chunk_rows([0, 100, 201], False)
    assert again.index is index and rows == 4
    # the per-chunk kernels' view of the rows comes with the index, made once per layout too
    assert again.kernel_rows is kernel_rows
    assert kernel_rows.tolist() == [[0, 64], [64, 36], [100, 64], [164, 36]]
    assert other is not index and other_rows == 4  # rows 0-1 and 2-3 (offsets[n] // 64 + n)
