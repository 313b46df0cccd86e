"""``LinearTimeProblem(method="direct", backend="scipy")`` on several ranks (issue 22): every rank
factorises the gathered step matrix with SuperLU and a step's solve is one Allgatherv. Its steps
against SciPy's own steps on the global matrices, its gradients (symmetric and non-symmetric ``K``,
every scheme) against central finite differences and the Taylor test, and against the distributed
MUMPS path; on one rank it is the ordinary SuperLU path.

Run serially and under mpirun -n 2 / 4 with --with-mpi.
"""
import numpy as np
import pytest
import torch
from mpi4py import MPI

import slasolve
from slasolve.timestepping import LinearTimeProblem, integrate

from heat_line import check_fd_and_taylor, distributed_line, line_matrices, rank_random, scipy_steps

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
DT = torch.float64
N_GRID = 13


def allsum(t):
    return slasolve.global_sum(t, COMM)








@pytest.mark.parametrize("convection", [0.0, 3.0])
@pytest.mark.parametrize("sch", ["cn", "bdf2", 0.7])
def test_steps_match_scipy(sch, convection):
    dM, dK, x = distributed_line(COMM, N_GRID, convection)
    P = LinearTimeProblem(dM, dK, lambda t, q: q * (1.0 + t), scheme=sch, method="direct", backend="scipy")
    dt, N = 0.01, 7
    uN = integrate(P, torch.cos(2 * x), torch.sin(3 * x), dt=dt, n_steps=N)
    M, K = line_matrices(N_GRID, convection)
    xg = np.linspace(0, 1, N_GRID + 2)[1:-1]
    ref = scipy_steps(M, K, sch, dt, N, np.cos(2 * xg), np.sin(3 * xg))
    got = dK.gather(uN, root=None).numpy()
    assert np.abs(got - ref).max() <= 1e-12 * np.abs(ref).max()


@pytest.mark.parametrize("convection", [0.0, 3.0])
@pytest.mark.parametrize("sch", ["cn", "bdf2"])
def test_gradients_fd_taylor_and_mumps(sch, convection):
    """Gradients of u0, the source and M's and K's values with 3 snapshots: central finite
    differences, the Taylor test, and (several ranks) the distributed MUMPS path's gradient."""
    dM, dK, x = distributed_line(COMM, N_GRID, convection)
    u0, q, Mv, Kv = torch.cos(2 * x), torch.sin(3 * x), dM.values.clone(), dK.values.clone()
    N, dt = 17, 0.005

    def loss(u0, q, Mv, Kv, backend="scipy"):
        P = LinearTimeProblem(dM.with_values(Mv), dK.with_values(Kv), lambda t, q: torch.tanh(q) * (1.0 + t),
                              scheme=sch, method="direct", backend=backend)
        mid, end = integrate(P, u0, q, dt=dt, n_steps=N, outputs=[6, N], checkpoints=3)
        return allsum((end ** 2).sum() + (mid * x).sum())

    m = (u0, q, Mv, Kv)
    grads = {}
    for backend in ["scipy"] + (["petsc"] if COMM.size > 1 and slasolve.krylov.default_backend() == "petsc" else []):
        leaves = [t.clone().requires_grad_(True) for t in m]
        loss(*leaves, backend=backend).backward()
        grads[backend] = torch.cat([t.grad for t in leaves])
    g = grads["scipy"]
    if "petsc" in grads:
        scale = float(allsum(g.abs().max()))
        assert float(allsum((grads["petsc"] - g).abs().max())) <= 1e-10 * scale
    d = [rank_random(u0.shape, 1, COMM), rank_random(q.shape, 2, COMM), 0.1 * rank_random(Mv.shape, 3, COMM),
         10 * rank_random(Kv.shape, 4, COMM)]
    dd = torch.cat(d)
    ad = float(allsum((g * dd).sum()))
    check_fd_and_taylor(loss, m, d, ad)
