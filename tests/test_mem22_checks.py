"""The time steps' batched solve checks after issue 22's memory changes (one preallocated buffer
instead of a tensor per solve, the source's batched vector-Jacobian product without its values
kept): gradients independent of the batch sizes and equal to SciPy's steps' finite differences,
and a non-finite source found in any batch, the last partial one included, raised on every rank.

Run serially and under mpirun -n 2 with --with-mpi.
"""

import numpy as np
import pytest
import torch
from mpi4py import MPI

import slasolve
import slasolve.timestepping.linear as tlinear
from slasolve.timestepping import LinearTimeProblem, integrate

from heat_line import distributed_line, line_matrices, scipy_steps, source

pytestmark = [pytest.mark.mpi, pytest.mark.petsc]

COMM = MPI.COMM_WORLD
N_STEPS = 23
DT_STEP = 0.01


def _loss_and_grad(check_batch: int, adjoint_batch: int, monkeypatch, sch: str = "cn", entries: int = 1 << 16):
    monkeypatch.setattr(tlinear, "CHECK_BATCH", check_batch)
    monkeypatch.setattr(tlinear, "ADJOINT_BATCH", adjoint_batch)
    monkeypatch.setattr(tlinear, "SOURCE_VJP_ENTRIES", entries)
    dM, dK, x = distributed_line(COMM)
    P = LinearTimeProblem(dM, dK, source, scheme=sch, method="direct")
    u0 = torch.cos(2 * x).requires_grad_(True)
    q = torch.sin(3 * x).requires_grad_(True)
    u = integrate(P, u0, q, dt=DT_STEP, n_steps=N_STEPS)
    J = slasolve.global_sum((u * u).sum())
    J.backward()
    return float(J.detach()), u0.grad.clone(), q.grad.clone(), x


@pytest.mark.parametrize("sch", ["cn", "bdf2"])
def test_gradients_independent_of_batches(sch, monkeypatch):
    """The same loss and gradients (to rounding: the batched checks change no value) whatever
    CHECK_BATCH (1, 4: several flushes and a partial last batch; 256: one) and ADJOINT_BATCH
    (1, 5, 32) are, and with the source's VJP batch cut by SOURCE_VJP_ENTRIES (12 rows: 3 levels
    per rank and batch at one rank, 6 at 2); the loss equals SciPy's own steps and q's gradient
    its central difference."""
    ref = _loss_and_grad(256, 32, monkeypatch, sch)
    for cb, ab, entries in ((1, 1, 1 << 16), (4, 5, 1 << 16), (7, 32, 1 << 16), (256, 32, 36)):
        J, gu, gq, _ = _loss_and_grad(cb, ab, monkeypatch, sch, entries)
        assert abs(J - ref[0]) <= 1e-13 * abs(ref[0])
        for g, r in ((gu, ref[1]), (gq, ref[2])):
            scale = float(slasolve.global_sum(r.abs().sum()))
            assert float(slasolve.global_sum((g - r).abs().sum())) <= 1e-13 * scale
    # SciPy's steps: the loss, and q's gradient along a direction by central differences
    M, K = line_matrices()
    xg = np.linspace(0, 1, 14)[1:-1]
    u0, q = np.cos(2 * xg), np.sin(3 * xg)
    uN = scipy_steps(M, K, sch, DT_STEP, N_STEPS, u0, q)
    assert abs(float(uN @ uN) - ref[0]) <= 1e-10 * abs(ref[0])
    d = np.cos(xg)
    h = 1e-6
    fd = (float(np.sum(scipy_steps(M, K, sch, DT_STEP, N_STEPS, u0, q + h * d) ** 2))
          - float(np.sum(scipy_steps(M, K, sch, DT_STEP, N_STEPS, u0, q - h * d) ** 2))) / (2 * h)
    x = ref[3]
    dq = float(slasolve.global_sum((ref[2] * torch.cos(x)).sum()))
    assert abs(dq - fd) <= 1e-7 * abs(fd)


@pytest.mark.parametrize("bad_step", [2, 9, 22])
def test_nonfinite_source_in_any_batch(bad_step, monkeypatch):
    """CHECK_BATCH 4: a NaN source on the last rank at a step of the first, a middle or the last
    (partial) batch raises ValueError on every rank, never a result."""
    monkeypatch.setattr(tlinear, "CHECK_BATCH", 4)
    dM, dK, x = distributed_line(COMM)
    t_bad = (bad_step + 1) * DT_STEP

    def src(t, q):
        bad = COMM.rank == COMM.size - 1 and abs(t - t_bad) < 1e-12
        return q * float("nan") if bad else q

    P = LinearTimeProblem(dM, dK, src, scheme="be", method="direct")
    q = torch.sin(3 * x).requires_grad_(True)
    with pytest.raises(ValueError, match="NaN or infinite"):
        integrate(P, torch.cos(2 * x), q, dt=DT_STEP, n_steps=N_STEPS)
