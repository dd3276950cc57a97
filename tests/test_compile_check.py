"""The CPU compile check must fail on what it is meant to catch: missing PTX instructions, compile errors, and
local memory in the machine code of a kernel registered as clean."""

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


class Shuffle(AddOne):
    """Reads and writes a per-thread array at run-time indices: local memory (STL/LDL) in the SASS."""

    @cute.kernel
    def kernel(self, x: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        buf = cute.make_rmem_tensor(cute.make_layout(256), cutlass.Float32)
        for i in cutlass.range_constexpr(256):
            buf[i] = x[i] * cutlass.Float32(i)
        buf[(tidx * 3) % 256] = x[tidx]  # written and read at run-time indices: the array lives in local memory
        x[tidx] = buf[(tidx * 7) % 256]


def compiler(kernel_cls):
    """``compile_fn(arch)`` for a one-warp test kernel taking a float32 vector."""

    def compile_fn(arch):
        fake = [runtime.fake_tensor(cutlass.Float32, (runtime.sym_int(),)), runtime.fake_stream()]
        return runtime.compile_kernel(kernel_cls(), fake, arch=arch)

    return compile_fn


compile_add_one, compile_shuffle = compiler(AddOne), compiler(Shuffle)


def broken(arch):
    raise RuntimeError("does not compile")


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(runtime, "_REGISTRY", {})
    monkeypatch.setattr(compile_check, "import_kernel_modules", lambda: [])

    def add(name, fn, expected, clean_sass=False, sass_allowed=(0, 0)):
        runtime.register_kernel(name, ["sm_90a"], fn, expected, clean_sass, sass_allowed)

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


def test_counts_spills_and_injected_arrives():
    sass = "STL [R1+0x4], R2 ;\nLDL.64 R4, [R1] ;\nWARPGROUP.ARRIVE ;\nWARPGROUP.ARRIVE ;\nSTG.E [R2], R4 ;"
    assert compile_check.sass_counts(sass, "wgmma.fence.sync.aligned;") == (2, 1)
    assert compile_check.sass_counts("HGMMA.64x64x16 ;", "") == (0, 0)


def test_sass_roles_split_at_setmaxnreg_and_count_each_part():
    sass = "\n".join(
        f"        /*{a:04x}*/                   {t} ;"
        for a, t in [
            (0x00, "MOV R1, c[0x0][0x28]"),
            (0x10, "USETMAXREG.DEALLOC.CTAPOOL 0x18"),
            (0x20, "MUFU.EX2 R2, R2"),
            (0x30, "STL [R1], R2"),
            (0x40, "@!P0 BRA 0x20"),  # a loop of 3 instructions
            (0x50, "EXIT"),
            (0x60, "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xc0"),
            (0x70, "WARPGROUP.ARRIVE"),
            (0x80, "LDL.LU R4, [R1+0x4]"),
            (0x90, "BRA 0x40"),  # into another part: not a loop of this one
            (0xA0, "EXIT"),
            (0xB0, "BRA 0x70"),  # after the role's EXIT (an mbarrier wait's retry loop): not counted
        ]
    )
    roles = compile_check.sass_roles(sass)
    assert [r.start for r in roles] == [
        "prologue",
        "USETMAXREG.DEALLOC.CTAPOOL 0x18",
        "USETMAXREG.TRY_ALLOC.CTAPOOL 0xc0",
    ]
    assert [(r.instructions, r.local_mem, r.arrives, r.ex2, r.longest_loop) for r in roles] == [
        (1, 0, 0, 0, 0),
        (4, 1, 0, 1, 3),
        (4, 1, 1, 0, 0),
    ]


def test_fails_on_local_memory_in_a_clean_kernel(registered):
    registered("add_one", compile_add_one, ["st.global"], clean_sass=True)
    registered("shuffle", compile_shuffle, ["st.global"], clean_sass=True)
    clean = compile_check.check_kernel("add_one", "sm_90a")
    assert clean.ok and clean.local_mem == 0 and clean.injected_arrives == 0, clean
    spilled = compile_check.check_kernel("shuffle", "sm_90a")
    assert not spilled.ok and spilled.local_mem > 0 and "SASS not clean" in spilled.error, spilled


def test_a_measured_allowance_of_local_memory_passes_up_to_its_count(registered):
    registered("shuffle", compile_shuffle, ["st.global"], clean_sass=True)
    spills = compile_check.check_kernel("shuffle", "sm_90a").local_mem
    assert spills > 0
    registered("shuffle_allowed", compile_shuffle, ["st.global"], clean_sass=True, sass_allowed=(spills, 0))
    assert compile_check.check_kernel("shuffle_allowed", "sm_90a").ok
    registered("shuffle_short", compile_shuffle, ["st.global"], clean_sass=True, sass_allowed=(spills - 1, 0))
    short = compile_check.check_kernel("shuffle_short", "sm_90a")
    assert not short.ok and "allowed" in short.error, short


def test_a_fixed_phase_wait_in_a_loop_is_seen():
    """The check a kernel whose loop does not carry a ring position fails (its waits keep the first phase)."""
    loop = ["$L__BB0_1:", *["add.s32 %r1, %r1, 1;"] * 30]
    wait = "mbarrier.try_wait.parity.shared.b64 P1, [%r166], 0, 10000000;"
    assert compile_check.fixed_phase_waits("\n".join([*loop, wait, "bra.uni $L__BB0_1;"]))
    carried = wait.replace(" 0,", " %r2571,")
    assert not compile_check.fixed_phase_waits("\n".join([*loop, carried, "bra.uni $L__BB0_1;"]))
    assert not compile_check.fixed_phase_waits("\n".join([wait, *loop, "bra.uni $L__BB0_1;"]))  # before the loop
    retry = ["$L__BB0_2:", wait, "@!P1 bra $L__BB0_2;"]  # a wait's own retry loop
    assert not compile_check.fixed_phase_waits("\n".join(retry))


@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_an_sm100_transition_pass_keeps_the_state_operand_in_shared_memory(variant):
    """A split's transition pass makes no output but is no state walk: its state warpgroup writes S^T's bf16 operand
    to shared memory for the chain's products, as the first pass does, and not to ``w`` (there the call's Tinv rows)
    as a walk's checkpoints: no 16-byte global store in its PTX (it has no output, and its final state goes out as
    fp32 scalars)."""
    import importlib

    module = importlib.import_module(f"cula.{variant}.chunk_fwd_sm100")
    compile_fn = getattr(module, f"compile_{variant}_fwd_sm100")
    ptx = compile_fn("sm_100a", keep_artifacts=True, is_varlen=True, mode="transition").artifacts.PTX
    assert ptx.count("st.global.v4") == 0
