"""CuTe DSL compile/launch machinery shared by every cuLA kernel.

Kernels are compiled once per set of compile-time constants with fake tensors whose batch/length modes are
``cute.sym_int()``, through the TVM-FFI path: the compiled executor then takes torch tensors directly and launches
on the current torch stream (about 7 us host time per call instead of ~60 us through ``from_dlpack``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import tempfile
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

_CACHE: dict[Hashable, Any] = {}
_CACHE_LOCK = threading.Lock()
_KEEP = threading.local()


@contextlib.contextmanager
def keeping_artifacts():
    """Inside this block every :func:`compile_kernel` keeps PTX and cubin (``compiled.artifacts``), so a
    ``compile_fn(arch)`` registered without a keep flag can still be inspected by the compile check."""
    prev = getattr(_KEEP, "on", False)
    _KEEP.on = True
    try:
        yield
    finally:
        _KEEP.on = prev


def compile_options(arch: str | None = None, keep_artifacts: bool = False, dump_dir: str | None = None) -> str:
    """The option string handed to ``cute.compile``."""
    opts = ["--enable-tvm-ffi"]
    if arch is not None:
        opts.append(f"--gpu-arch {arch}")
    if keep_artifacts:
        # --keep-* also writes files: send them to a private folder instead of the current one
        opts += ["--keep-ptx", "--keep-cubin", f"--dump-dir={dump_dir or tempfile.mkdtemp(prefix='cula_')}"]
    return " ".join(opts)


def compile_kernel(kernel_obj: Any, fake_args: Sequence[Any], arch: str | None = None, keep_artifacts: bool = False):
    """``cute.compile(kernel_obj, *fake_args)`` with the TVM-FFI calling convention.

    ``fake_args`` are fake tensors/streams (see :func:`fake_tensor`, :func:`fake_stream`) and plain Python scalars.
    With ``arch`` (e.g. ``"sm_90a"``) the kernel is compiled for that target, which works without a GPU.
    """
    import cutlass.cute as cute

    keep = keep_artifacts or getattr(_KEEP, "on", False)
    return cute.compile(kernel_obj, *fake_args, options=compile_options(arch, keep))


def fake_tensor(dtype, shape: Sequence[Any], stride_order: Sequence[int] | None = None, align: int = 16):
    """A compact fake tensor; pass ``cute.sym_int()`` for dynamic modes. ``shape`` is in torch order (last mode
    contiguous) unless ``stride_order`` says otherwise."""
    import cutlass.cute as cute

    if stride_order is None:
        stride_order = tuple(range(len(shape) - 1, -1, -1))
    return cute.runtime.make_fake_compact_tensor(
        dtype, tuple(shape), stride_order=tuple(stride_order), assumed_align=align
    )


def fake_stream():
    """A fake stream bound at run time to the current torch CUDA stream."""
    import cutlass.cute as cute

    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def sym_int():
    import cutlass.cute as cute

    return cute.sym_int()


def get_or_compile(key: Hashable, build_fn: Callable[[], Any]) -> Any:
    """Process-wide cache of compiled executors, keyed only by compile-time constants (class, dims, dtypes,
    flags, arch). Compiles lazily, on first use."""
    fn = _CACHE.get(key)
    if fn is None:
        with _CACHE_LOCK:
            fn = _CACHE.get(key)
            if fn is None:
                fn = build_fn()
                _CACHE[key] = fn
    return fn


def clear_cache() -> None:
    with _CACHE_LOCK:
        _CACHE.clear()


def device_plan_cache(maxsize: int):
    """An LRU cache for ``fn(device, *hashable)`` that makes small tensors on the host and copies them to ``device`` by
    :func:`host_to_device`. An entry serves calls on the CUDA stream that made it (the asynchronous copy is ordered on
    that stream: another stream could read it before it lands), and any call while a stream captures a CUDA graph
    (``torch.cuda.graph`` synchronises the device before capturing, so every entry has landed); a plan first made
    during a capture is not kept (its copy runs only when the graph replays). ``cache_clear`` empties it."""

    def wrap(fn):
        entries: collections.OrderedDict = collections.OrderedDict()  # (device, *args) -> (stream id, plan)
        lock = threading.Lock()

        @functools.wraps(fn)
        def call(device, *args):
            import torch

            key = (device, *args)
            stream, capturing = None, False
            if device is not None and torch.device(device).type == "cuda":
                capturing = torch.cuda.is_current_stream_capturing()
                stream = None if capturing else torch.cuda.current_stream(device).stream_id
            with lock:
                hit = entries.get(key)
                if hit is not None and (capturing or hit[0] == stream):
                    entries.move_to_end(key)
                    return hit[1]
            plan = fn(device, *args)
            if not capturing:
                with lock:
                    entries[key] = (stream, plan)
                    entries.move_to_end(key)
                    while len(entries) > maxsize:
                        entries.popitem(last=False)
            return plan

        def cache_clear():
            with lock:
                entries.clear()

        call.cache_clear = cache_clear
        return call

    return wrap


# The pinned sources of copies captured into a CUDA graph: every replay copies from them again, so they must outlive
# the call that made them (a freed pinned block goes back to torch's host cache, to be reused for other data)
_CAPTURED_SOURCES: list = []


def host_to_device(x, device):
    """The CPU tensor ``x``, made on the host, on ``device`` without waiting for the GPU: copied from pinned memory,
    asynchronously (a copy from pageable memory waits for everything queued on the stream, and stalls a training
    step's host path behind its forward). ``x`` itself as it is for a CPU ``device`` or None. A copy made while a CUDA
    graph is being captured keeps its pinned source for the process (:data:`_CAPTURED_SOURCES`)."""
    import torch

    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        return x
    pinned = x.pin_memory()
    if torch.cuda.is_current_stream_capturing():
        _CAPTURED_SOURCES.append(pinned)
    return pinned.to(device, non_blocking=True)


# What torch.cuda reports of each device, read once: dispatch asks for a GPU's name, capability and SM count several
# times a call, each read a few microseconds of host time (a decode step's whole host path is ~50-150 us). Keyed by
# (what, device index), and by (what, device) for a device that always names the same GPU (a tensor's), whose index
# then need not be worked out again.
_PROPERTIES: dict[tuple[str, Any], Any] = {}


def _device_index(device) -> int:
    import torch

    if isinstance(device, int):
        return device
    device = None if device is None else torch.device(device)
    if device is not None and device.index is not None:
        return device.index
    if device is not None and device.type != "cuda":
        return 0  # a CPU tensor a test pretends is on a GPU
    # the current device (0 until CUDA is initialised, as it is by any tensor on a GPU)
    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0


def _read_once(what: str, device, read: Callable[[int], Any]) -> Any:
    value = _PROPERTIES.get((what, device))
    if value is not None:
        return value
    key = (what, _device_index(device))
    value = _PROPERTIES.get(key)
    if value is None:
        value = _PROPERTIES[key] = read(key[1])
    if _names_one_gpu(device):
        _PROPERTIES[(what, device)] = value
    return value


def _names_one_gpu(device) -> bool:
    """Whether ``device`` names the same GPU whatever the current device: a ``torch.device`` with an index, or one
    that is no CUDA device (a tensor a test pretends is on a GPU). A string or a bare ``cuda`` names the current one."""
    import torch

    return isinstance(device, torch.device) and (device.index is not None or device.type != "cuda")


def device_properties(device=None):
    """``torch.cuda.get_device_properties(device)``, read once per device."""
    import torch

    return _read_once("properties", device, lambda index: torch.cuda.get_device_properties(index))


def device_capability(device=None) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(device)``, read once per device."""
    import torch

    return _read_once("capability", device, lambda index: torch.cuda.get_device_capability(index))


def sm_count(device=None) -> int:
    """The device's number of SMs."""
    return device_properties(device).multi_processor_count


def forget_devices() -> None:
    """Forget what was read of the devices (tests that pretend to have another GPU)."""
    _PROPERTIES.clear()


def device_arch(device=None) -> str:
    """``"sm_90a"`` / ``"sm_100a"`` for the given (or current) CUDA device."""
    major, minor = device_capability(device)
    return f"sm_{major}{minor}a"


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """A kernel the compile check builds on a CPU: ``compile_fn(arch)`` returns an executor compiled with fake
    tensors for ``arch``; ``expected_ptx`` lists instruction substrings that must appear in its PTX; ``clean_sass``:
    no local memory and no ptxas-injected ``warpgroup.arrive`` in its machine code beyond ``sass_allowed`` (local-memory
    instructions, injected arrives: kept only where measured to cost nothing per chunk or less than the clean
    alternative)."""

    name: str
    archs: tuple[str, ...]
    compile_fn: Callable[..., Any]
    expected_ptx: tuple[str, ...]
    clean_sass: bool = False
    sass_allowed: tuple[int, int] = (0, 0)


_REGISTRY: dict[str, KernelSpec] = {}


def register_kernel(
    name: str,
    archs: Sequence[str],
    compile_fn: Callable[..., Any],
    expected_ptx: Sequence[str] = (),
    clean_sass: bool = False,
    sass_allowed: tuple[int, int] = (0, 0),
) -> KernelSpec:
    """Register a kernel for ``python -m cula.compile_check``. ``compile_fn(arch)`` must compile through
    :func:`compile_kernel` without a GPU; the check runs it inside :func:`keeping_artifacts`. ``clean_sass``: the
    check also fails if the machine code uses local memory (register spills) or if ptxas had to insert
    ``warpgroup.arrive`` before a wgmma (C7519), two silent slow-downs, beyond ``sass_allowed`` of each."""
    spec = KernelSpec(name, tuple(archs), compile_fn, tuple(expected_ptx), clean_sass, tuple(sass_allowed))
    _REGISTRY[name] = spec
    return spec


def registered_kernels() -> dict[str, KernelSpec]:
    return dict(_REGISTRY)
