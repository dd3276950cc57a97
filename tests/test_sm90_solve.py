"""The chunk kernels' triangular inverse (cula.sm90.solve: solve_clear, solve_diag16, solve_merge, and the
one-warpgroup solve_diag16_per_warp, solve_merge_to_bf16) alone: a test kernel inverts a batch of 64 x 64
unit-lower-triangular matrices the way the SM90 kernels do (on 256 threads, the diagonal blocks on warps 0-1; or on the
128 threads of the GDN four-role kernel's aux warpgroup), compiled on the CPU (its merge must use the warp MMA in tf32)
and checked on an SM90 GPU against an fp64 inverse."""

import pytest
import torch
from delta_rule_recurrence import needs_sm90

cutlass = pytest.importorskip("cutlass")
cute = pytest.importorskip("cutlass.cute")

from cula import runtime  # noqa: E402
from cula.sm90 import solve  # noqa: E402

C = 64
A_STRIDE = 68  # as the kernels pad A^T's rows


class SolveTest:
    """One CTA per matrix: ``a`` [N, C, C] fp32 (strictly lower) -> ``t`` [N, C, C] bf16 = (I + A)^-1, through
    shared memory laid out as in the chunk kernels (A^T fp32 with padded rows, T bf16). ``one_warpgroup``: the
    four-role kernel's solve, into a T buffer that starts as NaN but for the 32-block above the diagonal (zeros, as
    its caller clears it once), so every other element must be written."""

    def __init__(self, one_warpgroup: bool = False):
        self.one_warpgroup = one_warpgroup
        self.threads = 128 if one_warpgroup else 256

    @cute.jit
    def __call__(self, mA, mT, stream):
        smem = C * A_STRIDE * 4 + C * C * 2 + 256
        self.kernel(mA, mT).launch(grid=(mA.shape[0], 1, 1), block=(self.threads, 1, 1), smem=smem, stream=stream)

    @cute.kernel
    def kernel(self, mA, mT):
        tidx, _, _ = cute.arch.thread_idx()
        n, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        smem = cutlass.memory.SmemAllocator()
        sA = smem.allocate_tensor(
            cutlass.Float32, cute.make_layout((C, A_STRIDE), stride=(A_STRIDE, 1)), byte_alignment=16
        )
        sT = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout((C, C), stride=(C, 1)), byte_alignment=16)
        for it in cutlass.range_constexpr(C * C // self.threads):
            idx = tidx + it * self.threads
            i, j = idx // C, idx % C
            sA[j, i] = mA[n, i, j]  # stored transposed, as the kernels store A
        if cutlass.const_expr(self.one_warpgroup):
            for it in cutlass.range_constexpr(C * C // self.threads):
                idx = tidx + it * self.threads
                i, j = idx // C, idx % C
                sT[i, j] = cutlass.BFloat16(0.0) if i < 32 and j >= 32 else cutlass.BFloat16(float("nan"))
        else:
            solve.solve_clear(sT, tidx, self.threads)
        cute.arch.sync_threads()
        if cutlass.const_expr(self.one_warpgroup):
            solve.solve_diag16_per_warp(sA, tidx)
            cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
            solve.solve_merge_to_bf16(sA, sT, tidx, 1)
        else:
            if warp < 2:
                solve.solve_diag16(sA, sT, tidx)
            cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
            solve.solve_merge(sA, sT, tidx, 1, self.threads)
        cute.arch.sync_threads()
        for it in cutlass.range_constexpr(C * C // self.threads):
            idx = tidx + it * self.threads
            mT[n, idx // C, idx % C] = sT[idx // C, idx % C]


def _compile(arch=None, keep=False, one_warpgroup=False):
    fake = [
        runtime.fake_tensor(cutlass.Float32, (runtime.sym_int(), C, C)),
        runtime.fake_tensor(cutlass.BFloat16, (runtime.sym_int(), C, C)),
        runtime.fake_stream(),
    ]
    return runtime.compile_kernel(SolveTest(one_warpgroup), fake, arch=arch, keep_artifacts=keep)


@pytest.mark.parametrize("one_warpgroup", [False, True])
def test_solve_compiles_with_tf32_warp_mma(one_warpgroup):
    ptx = _compile("sm_90a", keep=True, one_warpgroup=one_warpgroup).artifacts.PTX
    assert ptx.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") > 0


def _chunk_matrices(n, decay, beta_max, device):
    """A = strictly lower diag(beta) (K K^T * exp(G_i - G_j)) for l2-normalised keys, as in a GDN chunk."""
    k = torch.nn.functional.normalize(torch.randn(n, C, 128, device=device, dtype=torch.float64), dim=-1)
    beta = torch.rand(n, C, 1, device=device, dtype=torch.float64) * beta_max
    G = torch.cumsum(-decay * torch.rand(n, C, device=device, dtype=torch.float64), dim=1)
    gamma = torch.exp(G[:, :, None] - G[:, None, :]).tril(-1)
    return beta * (k @ k.transpose(1, 2)) * gamma


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("decay,beta_max", [(0.0, 1.0), (0.05, 1.0), (0.5, 2.0)])
@pytest.mark.parametrize("one_warpgroup", [False, True])
def test_solve_matches_fp64_inverse(decay, beta_max, one_warpgroup):
    A = _chunk_matrices(24, decay, beta_max, "cuda")
    eye = torch.eye(C, device="cuda", dtype=torch.float64)
    ref = torch.linalg.inv(eye + A)
    got = torch.full((A.shape[0], C, C), float("nan"), device="cuda", dtype=torch.bfloat16)
    _compile(one_warpgroup=one_warpgroup)(A.float(), got)
    torch.cuda.synchronize()
    assert not got.isnan().any()
    err = (got.double() - ref).norm(dim=(1, 2)) / ref.norm(dim=(1, 2))
    # bf16 output rounding alone is ~0.0011 (relative, RMS); tf32 products add less than that
    assert err.max() < 0.003, err.max()
