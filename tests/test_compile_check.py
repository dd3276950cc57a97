"""The CPU compile check must fail on what it is meant to catch: missing PTX instructions and compile errors."""

from __future__ import annotations

import pytest

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402

from cula import compile_check, runtime  # noqa: E402


class AddOne:
    """x[i] += 1 for the 32 threads of one warp: the smallest kernel that leaves a global store in its PTX."""

    @cute.jit
    def __call__(self, x: cute.Tensor, stream):
        self.kernel(x).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        x[tidx] = x[tidx] + cutlass.Float32(1.0)


def compile_add_one(arch):
    fake = [runtime.fake_tensor(cutlass.Float32, (runtime.sym_int(),)), runtime.fake_stream()]
    return runtime.compile_kernel(AddOne(), fake, arch=arch)


def broken(arch):
    raise RuntimeError("does not compile")


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(runtime, "_REGISTRY", {})
    monkeypatch.setattr(compile_check, "import_kernel_modules", lambda: [])

    def add(name, fn, expected):
        runtime.register_kernel(name, ["sm_90a"], fn, expected)

    return add


def test_passes_and_counts_what_is_there(registered):
    registered("add_one", compile_add_one, ["st.global"])
    report = compile_check.check_kernel("add_one", "sm_90a")
    assert report.ok and report.counts["st.global"] >= 1 and report.registers is not None


def test_fails_on_missing_instructions_and_compile_errors(registered, capsys):
    registered("add_one", compile_add_one, ["wgmma.mma_async"])
    registered("broken", broken, [])
    assert "missing in PTX: ['wgmma.mma_async']" in compile_check.check_kernel("add_one", "sm_90a").error
    assert "does not compile" in compile_check.check_kernel("broken", "sm_90a").error
    assert compile_check.main([]) == 1
    assert "FAIL" in capsys.readouterr().out
