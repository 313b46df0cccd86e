"""The 1-D heat equation the time-stepping tests share (not a test file): FD stiffness ``K`` (plus
an optional central convection term) and P1 mass ``M`` on ``n`` interior points of ``[0, 1]``,
distributed by rows, the source ``q (1 + t)``, and SciPy's own steps of a scheme as the reference."""
import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch

import slasolve
from slasolve.testing import taylor_test
from slasolve.timestepping import scheme

DT = torch.float64


def line_matrices(n: int = 12, convection: float = 0.0):
    """Global SciPy ``(M, K)``."""
    K = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n)) * (n + 1) ** 2
    if convection:
        K = K + convection * (n + 1) * sp.diags([-1.0, 1.0], [-1, 1], shape=(n, n))
    M = sp.diags([1 / 6, 2 / 3, 1 / 6], [-1, 0, 1], shape=(n, n))
    return M.tocsr(), K.tocsr()


def distributed_line(comm, n: int = 12, convection: float = 0.0):
    """Collective. ``(dM, dK, x)``: the matrices distributed by contiguous rows, and this rank's
    rows of the grid points."""
    M, K = line_matrices(n, convection)
    dM, dK = slasolve.DSparseTensor.from_global(M, comm), slasolve.DSparseTensor.from_global(K, comm)
    r0, r1 = dK.row_range
    return dM, dK, torch.linspace(0, 1, n + 2, dtype=DT)[1:-1][r0:r1]


def source(t, q):
    return q * (1.0 + t)


def rank_random(shape, seed: int, comm):
    """Standard normal numbers, different on every rank (directions of derivative checks)."""
    g = torch.Generator().manual_seed(100 * seed + comm.rank)
    return torch.randn(shape, generator=g, dtype=DT)


def scipy_steps(M, K, sch, dt: float, n_steps: int, u0: np.ndarray, q: np.ndarray) -> np.ndarray:
    """SciPy's own ``n_steps`` steps of scheme ``sch`` from ``u0`` (and as many equal starting
    values as the scheme keeps) with the source ``q (1 + t)``: the final state."""
    S = scheme(sch)
    us = [u0] * S.history
    for m in range(n_steps):
        a, b = S.coefficients(m)
        rhs = sum(-(a[j] * M + dt * b[j] * K) @ us[j - 1] for j in range(1, len(a)))
        rhs = rhs + dt * sum(b[j] * q * (1 + (m + 1 - j) * dt) for j in range(len(b)))
        us = [spla.spsolve((a[0] * M + dt * b[0] * K).tocsc(), rhs)] + us[:-1]
    return us[0]


def check_fd_and_taylor(loss, params, directions, dJdm: float, h: float = 1e-5) -> None:
    """Collective. ``dJdm`` (the adjoint's directional derivative) against the central finite
    difference of ``loss`` along ``directions`` (to 1e-7 relative) and the Taylor test (rate > 1.9)."""
    with torch.no_grad():
        fd = float(loss(*[t + h * e for t, e in zip(params, directions)])
                   - loss(*[t - h * e for t, e in zip(params, directions)])) / (2 * h)
    assert abs(dJdm - fd) <= 1e-7 * abs(dJdm), (dJdm, fd)
    r = taylor_test(loss, list(params), directions, dJdm=dJdm, steps=3)
    assert r.rate > 1.9, r
