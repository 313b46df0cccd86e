"""``LinearTimeProblem(method="direct", backend="scipy")`` on several ranks (issue 22): every rank
factorises the gathered step matrix with SuperLU and a step's solve is one Allgatherv. Its steps
against SciPy's own steps on the global matrices, its gradients (symmetric and non-symmetric ``K``,
every scheme) against central finite differences and the Taylor test, and against the distributed
MUMPS path; on one rank it is the ordinary SuperLU path.

Run serially and under mpirun -n 2 / 4 with --with-mpi.
"""
import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch
from mpi4py import MPI

import slasolve
from slasolve.testing import taylor_test
from slasolve.timestepping import LinearTimeProblem, integrate, scheme

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
DT = torch.float64
N_GRID = 13


def allsum(t):
    return slasolve.global_sum(t, COMM)


def rank_random(shape, seed):
    g = torch.Generator().manual_seed(100 * seed + COMM.rank)
    return torch.randn(shape, generator=g, dtype=DT)


def matrices(convection: float):
    n = N_GRID
    K = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n)) * (n + 1) ** 2
    K = (K + convection * (n + 1) * sp.diags([-1.0, 1.0], [-1, 1], shape=(n, n))).tocsr()
    M = sp.diags([1 / 6, 2 / 3, 1 / 6], [-1, 0, 1], shape=(n, n)).tocsr()
    return M, K


def distributed(convection: float):
    M, K = matrices(convection)
    dM, dK = slasolve.DSparseTensor.from_global(M, COMM), slasolve.DSparseTensor.from_global(K, COMM)
    r0, r1 = dK.row_range
    return dM, dK, torch.linspace(0, 1, N_GRID + 2, dtype=DT)[1:-1][r0:r1]


@pytest.mark.parametrize("convection", [0.0, 3.0])
@pytest.mark.parametrize("sch", ["cn", "bdf2", 0.7])
def test_steps_match_scipy(sch, convection):
    dM, dK, x = distributed(convection)
    P = LinearTimeProblem(dM, dK, lambda t, q: q * (1.0 + t), scheme=sch, method="direct", backend="scipy")
    dt, N = 0.01, 7
    uN = integrate(P, torch.cos(2 * x), torch.sin(3 * x), dt=dt, n_steps=N)
    M, K = matrices(convection)
    xg = np.linspace(0, 1, N_GRID + 2)[1:-1]
    S = scheme(sch)
    us = [np.cos(2 * xg)] * S.history
    for m in range(N):
        a, b = S.coefficients(m)
        rhs = sum(-(a[j] * M + dt * b[j] * K) @ us[j - 1] for j in range(1, len(a)))
        rhs = rhs + dt * sum(b[j] * np.sin(3 * xg) * (1 + (m + 1 - j) * dt) for j in range(len(b)))
        us = [spla.spsolve((a[0] * M + dt * b[0] * K).tocsc(), rhs)] + us[:-1]
    got = dK.gather(uN, root=None).numpy()
    assert np.abs(got - us[0]).max() <= 1e-12 * np.abs(us[0]).max()


@pytest.mark.parametrize("convection", [0.0, 3.0])
@pytest.mark.parametrize("sch", ["cn", "bdf2"])
def test_gradients_fd_taylor_and_mumps(sch, convection):
    """Gradients of u0, the source and M's and K's values with 3 snapshots: central finite
    differences, the Taylor test, and (several ranks) the distributed MUMPS path's gradient."""
    dM, dK, x = distributed(convection)
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
    d = [rank_random(u0.shape, 1), rank_random(q.shape, 2), 0.1 * rank_random(Mv.shape, 3),
         10 * rank_random(Kv.shape, 4)]
    dd = torch.cat(d)
    ad = float(allsum((g * dd).sum()))
    h = 1e-5
    with torch.no_grad():
        fd = float(loss(*[t + h * e for t, e in zip(m, d)]) - loss(*[t - h * e for t, e in zip(m, d)])) / (2 * h)
    assert abs(ad - fd) <= 1e-7 * abs(ad), (ad, fd)
    r = taylor_test(loss, list(m), d, dJdm=ad, steps=3)
    assert r.rate > 1.9
