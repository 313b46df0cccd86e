"""nonlinear_solve: solutions vs SciPy / an analytic Bratu solution, quadratic convergence,
rank-count independence, IFT gradients vs finite differences and gradcheck, failures raised on
every rank, per-call settings that do not leak."""
import numpy as np
import pytest
import scipy.optimize as so
import torch
from mpi4py import MPI

import slasolve
from slasolve import ConvergenceError, DSparseTensor, NonlinearConvergenceError, nonlinear_solve
from slasolve.testing import local_slice, replicate

pytestmark = pytest.mark.mpi
BACKENDS = ["petsc", "torch"]
F64 = torch.float64


def _split(n, comm):
    offs = np.linspace(0, n, comm.Get_size() + 1).round().astype(int)
    return int(offs[comm.Get_rank()]), int(offs[comm.Get_rank() + 1])


class FD1D:
    """Finite differences on (0, 1), u(0) = u(1) = 0, n interior points, a contiguous row
    shard; neighbours come through DSparseTensor shift products (halo exchange):
    ``-(k(u) u')' + c u^3 - f`` with ``k(u) = 1 + a u^2`` (flux form), or Bratu
    ``-u'' - lam exp(u)``."""

    def __init__(self, n, comm, dtype=F64):
        self.n, self.comm, self.dtype = n, comm, dtype
        self.lo, self.hi = _split(n, comm)
        self.h = 1.0 / (n + 1)
        g = np.arange(self.lo, self.hi)

        def shift(d):
            cols = g + d
            keep = (cols >= 0) & (cols < n)
            return DSparseTensor.from_local_rows(np.concatenate([[0], np.cumsum(keep)]), cols[keep],
                                                 torch.ones(int(keep.sum()), dtype=dtype), (n, n), comm)
        self.L, self.R = shift(-1), shift(1)
        cols = np.stack([g - 1, g, g + 1], 1)
        keep = (cols >= 0) & (cols < n)
        self.keep = torch.as_tensor(keep.reshape(-1))
        self.J0 = DSparseTensor.from_local_rows(np.concatenate([[0], np.cumsum(keep.sum(1))]), cols[keep],
                                                torch.zeros(int(keep.sum()), dtype=dtype), (n, n), comm)
        self.x = torch.as_tensor((g + 1) * self.h, dtype=dtype)

    def _tri(self, left, diag, right):
        return self.J0.with_values(torch.stack([left, diag, right], 1).reshape(-1)[self.keep])

    def residual(self, u, f, c, a):
        ul, ur = self.L @ u, self.R @ u
        kp, km = 1 + a * ((u + ur) / 2) ** 2, 1 + a * ((u + ul) / 2) ** 2
        return (-kp * (ur - u) + km * (u - ul)) / self.h ** 2 + c * u ** 3 - f

    def jacobian(self, u, f, c, a):
        ul, ur = self.L @ u, self.R @ u
        sp_, sm = (u + ur) / 2, (u + ul) / 2
        kp, km = 1 + a * sp_ ** 2, 1 + a * sm ** 2
        h2 = self.h ** 2
        return self._tri((a * sm * (u - ul) - km) / h2,
                         (-a * sp_ * (ur - u) + kp + a * sm * (u - ul) + km) / h2 + 3 * c * u ** 2,
                         (-a * sp_ * (ur - u) - kp) / h2)

    @staticmethod
    def residual_np(U, F, c, a, h):
        """Serial NumPy version (no halo) for SciPy's root finder."""
        Up = np.concatenate([[0.0], U, [0.0]])
        u, ul, ur = Up[1:-1], Up[:-2], Up[2:]
        kp, km = 1 + a * ((u + ur) / 2) ** 2, 1 + a * ((u + ul) / 2) ** 2
        return (-kp * (ur - u) + km * (u - ul)) / h ** 2 + c * u ** 3 - F

    def bratu(self, u, lam):
        return (2 * u - self.L @ u - self.R @ u) / self.h ** 2 - lam * torch.exp(u)

    def bratu_jacobian(self, u, lam):
        e = torch.full_like(u, -1.0 / self.h ** 2)
        return self._tri(e, 2.0 / self.h ** 2 - lam * torch.exp(u), e)

    def gather(self, u):
        return self.J0.gather(u, root=None)


def _data(P):
    f = 50 * torch.sin(np.pi * P.x) + 20
    return f, torch.tensor(5.0, dtype=F64), torch.tensor(2.0, dtype=F64)


def _same_everywhere(comm, value):
    vals = comm.allgather(value)
    assert all(v == vals[0] for v in vals), vals


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("matrix_free", [False, True])
def test_solution_matches_scipy_root(comm, backend, matrix_free):
    n = 24 if matrix_free else 40
    P = FD1D(n, comm)
    f, c, a = _data(P)
    u, info = nonlinear_solve(P.residual, torch.zeros_like(P.x), f, c, a,
                              jacobian=None if matrix_free else P.jacobian, backend=backend,
                              return_info=True, rtol=1e-10)
    assert info.converged and info.reason == "CONVERGED_FNORM_RELATIVE"
    assert info.backend == backend and info.residual_norm <= 1e-10 * info.residual_history[0]
    assert len(info.residual_history) == info.iterations + 1
    assert len(info.linear_iterations_per_step) == info.iterations
    assert info.linear_iterations == sum(info.linear_iterations_per_step)
    ug = P.gather(u).numpy()
    fg = (50 * np.sin(np.pi * np.arange(1, n + 1) * P.h) + 20)
    ref = so.root(FD1D.residual_np, np.zeros(n), args=(fg, 5.0, 2.0, P.h), method="hybr", tol=1e-13)
    assert ref.success
    assert np.abs(FD1D.residual_np(ref.x, fg, 5.0, 2.0, P.h)).max() < 1e-6
    np.testing.assert_allclose(ug, ref.x, rtol=1e-8, atol=1e-10)
    _same_everywhere(comm, (info.iterations, info.reason))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bratu_matches_analytic_solution(comm, backend):
    # -u'' = lam exp(u), u(0) = u(1) = 0: u = -2 log(cosh((x - 1/2) t / 2) / cosh(t / 4)),
    # t = sqrt(2 lam) cosh(t / 4) (lower branch); second-order finite differences
    lam = 1.0
    t = so.brentq(lambda t: t - np.sqrt(2 * lam) * np.cosh(t / 4), 0.1, 4.0)
    errs = []
    for n in (31, 63):
        P = FD1D(n, comm)
        u, info = nonlinear_solve(P.bratu, torch.zeros_like(P.x), lam, jacobian=P.bratu_jacobian,
                                  backend=backend, return_info=True, linear_solver={"pc": "ilu"})
        xs = np.arange(1, n + 1) * P.h
        exact = -2 * np.log(np.cosh((xs - 0.5) * t / 2) / np.cosh(t / 4))
        errs.append(np.abs(P.gather(u).numpy() - exact).max())
        assert info.iterations <= 6
    assert errs[0] < 2e-4 and 3.5 < errs[0] / errs[1] < 4.5  # O(h^2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_quadratic_convergence(comm, backend):
    P = FD1D(40, comm)
    f, c, a = _data(P)
    u, info = nonlinear_solve(P.residual, torch.zeros_like(P.x), f, c, a, jacobian=P.jacobian,
                              backend=backend, return_info=True)
    r = np.asarray(info.residual_history)
    # the last three steps are full Newton steps in the quadratic regime: r_{k+1} <= C r_k^2
    ratios = r[-3:] / r[-4:-1] ** 2
    assert np.all(ratios < 1e-3), ratios
    assert r[-1] / r[-2] < 1e-4 and r[-2] / r[-3] < 1e-2
    # the same problem with a loose inner tolerance converges only linearly: the test can fail
    _, slow = nonlinear_solve(P.residual, torch.zeros_like(P.x), f, c, a, jacobian=P.jacobian,
                              backend=backend, return_info=True, linear_solver={"rtol": 0.2})
    rs = np.asarray(slow.residual_history)
    assert slow.converged and slow.iterations > info.iterations
    assert (rs[-1] / rs[-2] ** 2) > 1.0
    # the gradient does not inherit the loose inner tolerance (the adjoint solve is tight)
    cs = [c.clone().requires_grad_(True) for _ in range(2)]
    grads = []
    for cc, ls in zip(cs, ({"rtol": 0.2, "pc": "jacobi"}, {"pc": "jacobi"})):
        uu = nonlinear_solve(P.residual, torch.zeros_like(P.x), f, cc, a, jacobian=P.jacobian, backend=backend,
                             rtol=1e-12, linear_solver=ls)
        grads.append(torch.autograd.grad(slasolve.global_sum(uu.sum(), comm), cc)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-8, atol=0)
    _same_everywhere(comm, list(np.round(r / r[0], 6)))


def test_backends_and_rank_counts_agree(comm):
    # the history with an exact Jacobian is the same on both backends and any rank count
    P = FD1D(40, comm)
    f, c, a = _data(P)
    hs, us = [], []
    for backend in BACKENDS:
        u, info = nonlinear_solve(P.residual, torch.zeros_like(P.x), f, c, a, jacobian=P.jacobian,
                                  backend=backend, return_info=True, rtol=1e-10)
        hs.append(np.asarray(info.residual_history))
        us.append(P.gather(u))
    assert len(hs[0]) == len(hs[1]) == 10
    np.testing.assert_allclose(hs[0][:-1], hs[1][:-1], rtol=1e-6)
    torch.testing.assert_close(us[0], us[1], rtol=1e-10, atol=1e-12)
    # u* at 1 rank (a serial solve on COMM_SELF) equals the distributed one
    S = FD1D(40, MPI.COMM_SELF)
    fs, cs, as_ = _data(S)
    us_ = nonlinear_solve(S.residual, torch.zeros_like(S.x), fs, cs, as_, jacobian=S.jacobian,
                          backend="torch", rtol=1e-10, comm=MPI.COMM_SELF)
    torch.testing.assert_close(us[0], us_, rtol=1e-10, atol=1e-12)


def _loss_fn(P, backend, matrix_free, rtol=1e-12):
    w = torch.cos(torch.arange(P.n, dtype=F64))

    def loss(f_global, c, a):
        f = local_slice(f_global, P.lo, P.hi, P.comm)
        cc = local_slice(c, 0, 1, P.comm)[0]  # replicated scalar: ranks' shares summed in backward
        aa = local_slice(a, 0, 1, P.comm)[0]
        u = nonlinear_solve(P.residual, torch.zeros_like(P.x), f, cc, aa, backend=backend, rtol=rtol,
                            jacobian=None if matrix_free else P.jacobian,
                            linear_solver=None if matrix_free else {"pc": "ilu"})
        return (w * replicate(u, P.comm)).sum()
    return loss


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("matrix_free", [False, True])
def test_ift_gradient_vs_finite_differences(comm, backend, matrix_free):
    P = FD1D(16, comm)
    fg = 10 * torch.sin(np.pi * torch.arange(1, 17, dtype=F64) * P.h) + 5
    c = torch.tensor([2.0], dtype=F64, requires_grad=True)
    a = torch.tensor([1.0], dtype=F64, requires_grad=True)
    fg.requires_grad_(True)
    loss = _loss_fn(P, backend, matrix_free)
    L = loss(fg, c, a)
    gf, gc, ga = torch.autograd.grad(L, (fg, c, a))
    eps = 1e-5
    with torch.no_grad():
        for g, p in ((gc, c), (ga, a)):
            d = ((loss(fg, *(q + eps if q is p else q for q in (c, a))) -
                  loss(fg, *(q - eps if q is p else q for q in (c, a)))) / (2 * eps))
            assert abs(float(g[0]) - float(d)) < 1e-5 * max(1.0, abs(float(d))), (float(g[0]), float(d))
        for i in (0, 15):
            e = torch.zeros_like(fg)
            e[i] = eps
            d = (loss(fg + e, c, a) - loss(fg - e, c, a)) / (2 * eps)
            assert abs(float(gf[i]) - float(d)) < 1e-6 * max(1.0, abs(float(d)))
    _same_everywhere(comm, [round(float(gc[0]), 8), round(float(ga[0]), 8)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck(comm, backend):
    P = FD1D(8, comm)
    fg = (3 * torch.sin(np.pi * torch.arange(1, 9, dtype=F64) * P.h) + 1).requires_grad_(True)
    c = torch.tensor([1.5], dtype=F64, requires_grad=True)
    a = torch.tensor([0.7], dtype=F64, requires_grad=True)
    loss = _loss_fn(P, backend, False, rtol=1e-13)
    assert torch.autograd.gradcheck(loss, (fg, c, a), eps=1e-6, atol=1e-6, rtol=1e-4)
    loss_mf = _loss_fn(P, backend, True, rtol=1e-13)
    assert torch.autograd.gradcheck(lambda c: loss_mf(fg.detach(), c, a.detach()), (c,), eps=1e-6,
                                    atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_wrt_matrix_param(comm, backend):
    # F(u) = A u + u^3 - b with A a DSparseTensor param: d<w, u>/dA_ij = -lam_i u_j, J^T lam = w
    P = FD1D(16, comm)
    A0 = P._tri(*(torch.full_like(P.x, v / P.h ** 2) for v in (-1.0, 2.0, -1.0)))
    vals = A0.values.clone().requires_grad_(True)
    b = 20 * torch.cos(3 * P.x)
    w = torch.sin(5 * P.x)

    def res(u, A, b):
        return A @ u + u ** 3 - b

    rows = torch.repeat_interleave(torch.arange(P.hi - P.lo), torch.diff(A0.local.indptr))
    diag_mask = (A0.local.indices == rows + P.lo).to(F64)

    def jac(u, A, b):
        return A.with_values(A.values + diag_mask * 3 * u[rows] ** 2)

    def loss(v):
        A = A0.with_values(v)
        u = nonlinear_solve(res, torch.zeros_like(P.x), A, b, jacobian=jac, backend=backend, rtol=1e-13,
                            linear_solver={"pc": "ilu"})
        return slasolve.global_sum((w * u).sum(), comm), u
    L, u = loss(vals)
    (g,) = torch.autograd.grad(L, vals)
    # closed form with an independent transpose solve (SciPy, gathered)
    import scipy.sparse as sps
    n = P.n
    ug = P.gather(u.detach()).numpy()
    main = 2.0 / P.h ** 2 + 3 * ug ** 2
    Jg = sps.diags([np.full(n - 1, -1 / P.h ** 2), main, np.full(n - 1, -1 / P.h ** 2)], [-1, 0, 1]).tocsc()
    lam = sps.linalg.spsolve(Jg.T.tocsc(), P.gather(w).numpy())
    cols = A0.local.indices.numpy()
    expect = -lam[rows.numpy() + P.lo] * ug[cols]
    np.testing.assert_allclose(g.numpy(), expect, rtol=1e-7, atol=1e-12)
    # and a finite difference on one stored value on the last rank
    e = torch.zeros_like(vals)
    if comm.Get_rank() == comm.Get_size() - 1:
        e[0] = 1e-3
    with torch.no_grad():
        d = (loss(vals + e)[0] - loss(vals - e)[0]) / 2e-3
    gsum = slasolve.global_sum((g * e).sum() / 1e-3, comm)
    assert abs(float(d) - float(gsum)) < 1e-6 * max(1.0, abs(float(d)))
    with pytest.raises(TypeError, match="separate params"):
        nonlinear_solve(res, torch.zeros_like(P.x), A0, [b.clone().requires_grad_(True)], jacobian=jac)


def test_create_graph_raises(comm):
    P = FD1D(8, comm)
    f, c, a = _data(P)
    c.requires_grad_(True)
    u = nonlinear_solve(P.residual, torch.zeros_like(P.x), f, c, a, jacobian=P.jacobian, backend="torch")
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(slasolve.global_sum(u.sum(), comm), c, create_graph=True)
    assert not u.detach().requires_grad


class Diagonal:
    """Elementwise residuals F(u)_i = phi(u_i) with a diagonal Jacobian."""

    def __init__(self, n, comm, phi, dphi):
        self.lo, self.hi = _split(n, comm)
        m = self.hi - self.lo
        self.J0 = DSparseTensor.from_local_rows(np.arange(m + 1), np.arange(self.lo, self.hi),
                                                torch.zeros(m, dtype=F64), (n, n), comm)
        self.phi, self.dphi = phi, dphi
        self.m = m

    def residual(self, u):
        return self.phi(u)

    def jacobian(self, u):
        return self.J0.with_values(self.dphi(u))


def _expect_failure(comm, reasons, params=(), **kw):
    with pytest.raises(NonlinearConvergenceError) as ei:
        nonlinear_solve(kw.pop("residual"), kw.pop("u0"), *params, **kw)
    assert isinstance(ei.value, ConvergenceError)
    info = ei.value.info
    assert not info.converged and info.reason in reasons, info.reason
    assert info.reason in str(ei.value)
    _same_everywhere(comm, (info.reason, info.iterations))
    return info


@pytest.mark.parametrize("backend", BACKENDS)
def test_failures_raise_on_every_rank(comm, backend):
    n = 12
    # singular Jacobian at u0: F = u^2 - 1, u0 = 0
    D = Diagonal(n, comm, lambda u: u * u - 1, lambda u: 2 * u)
    _expect_failure(comm, ("DIVERGED_LINEAR_SOLVE", "DIVERGED_LINE_SEARCH"), residual=D.residual,
                    u0=torch.zeros(D.m, dtype=F64), jacobian=D.jacobian, backend=backend)
    # u^3 - 2u + 2 from u0 = 0: full Newton steps cycle 0 -> 1 -> 0 ...
    C = Diagonal(n, comm, lambda u: u ** 3 - 2 * u + 2, lambda u: 3 * u ** 2 - 2)
    info = _expect_failure(comm, ("DIVERGED_MAX_IT",), residual=C.residual, u0=torch.zeros(C.m, dtype=F64),
                           jacobian=C.jacobian, backend=backend, line_search="basic", maxiter=20)
    assert info.iterations == 20
    np.testing.assert_allclose(info.residual_history[::2], 2.0 * np.sqrt(n), rtol=1e-12)
    # ... with the line search Newton stalls at the local minimum of |F| (F > 0, F' = 0)
    _expect_failure(comm, ("DIVERGED_LINE_SEARCH", "DIVERGED_LINEAR_SOLVE", "DIVERGED_MAX_IT",
                           "DIVERGED_LOCAL_MIN"), residual=C.residual, u0=torch.zeros(C.m, dtype=F64),
                    jacobian=C.jacobian, backend=backend)
    # a good initial guess converges to the real root (the same functions: nothing is left over)
    u = nonlinear_solve(C.residual, torch.full((C.m,), -2.0, dtype=F64), jacobian=C.jacobian, backend=backend)
    root = so.brentq(lambda x: x ** 3 - 2 * x + 2, -3, -1)
    np.testing.assert_allclose(u.numpy(), root, rtol=1e-12)
    # maxiter
    P = FD1D(40, comm)
    f, c, a = _data(P)
    _expect_failure(comm, ("DIVERGED_MAX_IT",), params=(f, c, a), residual=P.residual,
                    u0=torch.zeros_like(P.x), jacobian=P.jacobian, backend=backend, maxiter=3)
    u, info = nonlinear_solve(P.residual, torch.zeros_like(P.x), f, c, a, jacobian=P.jacobian, backend=backend,
                              maxiter=3, raise_on_fail=False, return_info=True)
    assert info.reason == "DIVERGED_MAX_IT" and info.iterations == 3 and not info.converged
    cg = c.clone().requires_grad_(True)  # no gradient through a result that did not converge
    u = nonlinear_solve(P.residual, torch.zeros_like(P.x), f, cg, a, jacobian=P.jacobian, backend=backend,
                        maxiter=3, raise_on_fail=False)
    with pytest.raises(RuntimeError, match="did not converge"):
        torch.autograd.grad(slasolve.global_sum(u.sum(), comm), cg)
    # NaN in the residual on the last rank only
    last = comm.Get_size() - 1
    N = Diagonal(n, comm, lambda u: u - 1 if comm.Get_rank() != last else (u - 1) * float("nan"),
                 lambda u: torch.ones_like(u))
    _expect_failure(comm, ("DIVERGED_FNORM_NAN",), residual=N.residual, u0=torch.zeros(N.m, dtype=F64),
                    jacobian=N.jacobian, backend=backend)


def test_validation_is_collective(comm):
    P = FD1D(16, comm)
    f, c, a = _data(P)
    u0 = torch.zeros_like(P.x)
    rank, size = comm.Get_rank(), comm.Get_size()
    with pytest.raises(ValueError, match="linear_solver"):
        nonlinear_solve(P.residual, u0, f, c, a, jacobian=P.jacobian,
                        linear_solver={"methd": "gmres"} if rank == size - 1 else {"method": "gmres"})
    if size > 1:
        with pytest.raises(ValueError, match="differ"):
            nonlinear_solve(P.residual, u0, f, c, a, jacobian=P.jacobian, rtol=1e-8 if rank else 1e-6)
    with pytest.raises(ValueError, match="line_search"):
        nonlinear_solve(P.residual, u0, f, c, a, line_search="cubic")
    with pytest.raises(ValueError, match="owned rows"):  # a residual of the wrong length on one rank
        nonlinear_solve(lambda u, *p: torch.cat([P.residual(u, *p), u[:1]]) if rank == size - 1
                        else P.residual(u, *p), u0, f, c, a, jacobian=P.jacobian)
    if size > 1:  # a row shard of a sub-communicator while the solve runs on COMM_WORLD
        S = FD1D(16, MPI.COMM_SELF)
        with pytest.raises(ValueError, match="communicator"):
            nonlinear_solve(lambda u: u - 1, torch.zeros(S.n // size + (rank < S.n % size)),
                            jacobian=lambda u: S.J0)
    with pytest.raises(ValueError, match="matrix-free"):
        nonlinear_solve(P.residual, u0, f, c, a, linear_solver={"pc": "jacobi"})
    for backend in BACKENDS:
        _check_pattern_change(comm, P, u0, f, c, a, backend)
        # an exception from the user's residual mid-solve (on every rank) comes out as itself,
        # also from inside SNES's callbacks
        count = []

        def flaky(u, *p):
            count.append(1)
            if len(count) > 3:
                raise ArithmeticError("residual failed on purpose")
            return P.residual(u, *p)
        with pytest.raises(ArithmeticError, match="on purpose"):
            nonlinear_solve(flaky, u0, f, c, a, jacobian=P.jacobian, backend=backend)


def _check_pattern_change(comm, P, u0, f, c, a, backend):
    rank = comm.Get_rank()
    with pytest.raises(ValueError, match="pattern"):  # a Jacobian whose pattern changes
        calls = []

        def jac(u, *p):
            calls.append(1)
            J = P.jacobian(u, *p)
            if len(calls) < 2:
                return J
            ip, ix, v = J.local_rows_csr()
            keep = torch.ones_like(ix, dtype=torch.bool)
            if rank == 0:
                keep[1] = False  # drop one stored entry on rank 0 only
            rows = torch.repeat_interleave(torch.arange(ip.numel() - 1), torch.diff(ip))
            counts = torch.zeros(ip.numel() - 1, dtype=torch.long).index_add(0, rows, keep.long())
            newp = torch.cat([ip.new_zeros(1), torch.cumsum(counts, 0)])
            return DSparseTensor.from_local_rows(newp, ix[keep], v[keep], J.global_shape, comm)
        nonlinear_solve(P.residual, u0, f, c, a, jacobian=jac, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_settings_do_not_leak(comm, backend):
    P = FD1D(24, comm)
    f, c, a = _data(P)
    u0 = torch.zeros_like(P.x)
    ref, rinfo = nonlinear_solve(P.residual, u0, f, c, a, jacobian=P.jacobian, backend=backend, rtol=1e-10,
                                 return_info=True)
    if backend == "petsc":
        # an entry in the options database (as from the command line) overrides the keyword
        from slasolve.petsc import PETSc
        PETSc.Options().setValue("snes_max_it", 2)
        try:
            _, i0 = nonlinear_solve(P.residual, u0, f, c, a, jacobian=P.jacobian, backend=backend, maxiter=50,
                                    raise_on_fail=False, return_info=True)
        finally:
            PETSc.Options().delValue("snes_max_it")
        assert i0.reason == "DIVERGED_MAX_IT" and i0.iterations == 2
        # a prefix keeps per-call options apart from unprefixed ones
        _, ip = nonlinear_solve(P.residual, u0, f, c, a, jacobian=P.jacobian, backend=backend,
                                options_prefix="nl_", petsc_options={"snes_max_it": 1}, raise_on_fail=False,
                                return_info=True)
        assert ip.iterations == 1 and not PETSc.Options("nl_").hasName("snes_max_it")
        # ksponly (one linear solve, SNES says CONVERGED_ITS): named by the residual test it passes or fails
        lin = Diagonal(12, comm, lambda u: 3 * u - 1, lambda u: torch.full_like(u, 3.0))
        ul, il = nonlinear_solve(lin.residual, torch.zeros(lin.m, dtype=F64), jacobian=lin.jacobian,
                                 backend=backend, petsc_options={"snes_type": "ksponly"}, return_info=True)
        assert il.reason == "CONVERGED_FNORM_RELATIVE" and il.method == "ksponly"
        torch.testing.assert_close(ul, torch.full_like(ul, 1 / 3))
        _, ik = nonlinear_solve(P.residual, u0, f, c, a, jacobian=P.jacobian, backend=backend,
                                petsc_options={"snes_type": "ksponly"}, return_info=True, raise_on_fail=False)
        assert ik.reason == "DIVERGED_MAX_IT" and not ik.converged
        # per-call options: one Newton step, then full steps; neither reaches the next call
        _, i1 = nonlinear_solve(P.residual, u0, f, c, a, jacobian=P.jacobian, backend=backend,
                                petsc_options={"snes_max_it": 1}, raise_on_fail=False, return_info=True)
        assert i1.reason == "DIVERGED_MAX_IT" and i1.iterations == 1
        _, i2 = nonlinear_solve(P.residual, u0, f, c, a, jacobian=P.jacobian, backend=backend,
                                petsc_options={"snes_linesearch_type": "basic", "ksp_type": "bcgs",
                                               "pc_type": "jacobi"}, return_info=True, raise_on_fail=False)
        assert i2.line_search == "basic" and i2.linear_method == "bicgstab" and i2.pc == "jacobi"
    for ls in ({"method": "bicgstab", "pc": "jacobi"}, {"method": "gmres", "pc": "ilu", "restart": 5},
               {"method": "cg", "pc": "jacobi"}, {}):
        # the Jacobian is symmetric at the solution only approximately: cg may fail; others match
        u, info = nonlinear_solve(P.residual, u0, f, c, a, jacobian=P.jacobian, backend=backend, rtol=1e-10,
                                  linear_solver=ls, raise_on_fail=False, return_info=True)
        if ls.get("method") != "cg":
            assert info.converged and info.line_search == "bt", info.summary()
            torch.testing.assert_close(u, ref, rtol=1e-9, atol=1e-11)
    u, info = nonlinear_solve(P.residual, u0, f, c, a, jacobian=P.jacobian, backend=backend, rtol=1e-10,
                              return_info=True)
    assert info.iterations == rinfo.iterations and info.line_search == "bt" and info.linear_method == "gmres"
    assert info.residual_history == rinfo.residual_history
    torch.testing.assert_close(u, ref, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_direct_inner_solves(comm, backend):
    P = FD1D(40, comm)
    f, c, a = _data(P)
    c = c.clone().requires_grad_(True)
    ref = nonlinear_solve(P.residual, torch.zeros_like(P.x), f, c.detach(), a, jacobian=P.jacobian,
                          backend="petsc", rtol=1e-10, linear_solver={"pc": "ilu"})
    kw = dict(jacobian=P.jacobian, backend=backend, rtol=1e-10, linear_solver={"method": "direct"},
              return_info=True)
    if backend == "torch" and comm.Get_size() > 1:  # SciPy SuperLU: one rank only, said on every rank
        with pytest.raises(ValueError, match="one rank"):
            nonlinear_solve(P.residual, torch.zeros_like(P.x), f, c, a, **kw)
        return
    u, info = nonlinear_solve(P.residual, torch.zeros_like(P.x), f, c, a, **kw)
    assert info.linear_method == "direct" and info.linear_iterations_per_step == [1] * info.iterations
    torch.testing.assert_close(u.detach(), ref, rtol=1e-10, atol=1e-12)
    # the adjoint through the direct transpose solve matches the Krylov one
    (g,) = torch.autograd.grad(slasolve.global_sum(u.sum(), comm), c)
    u2 = nonlinear_solve(P.residual, torch.zeros_like(P.x), f, c, a, jacobian=P.jacobian, backend="petsc",
                         rtol=1e-10, linear_solver={"pc": "ilu"})
    (g2,) = torch.autograd.grad(slasolve.global_sum(u2.sum(), comm), c)
    torch.testing.assert_close(g, g2, rtol=1e-8, atol=1e-12)
    D = Diagonal(12, comm, lambda u: u * u - 1, lambda u: 2 * u)  # singular: the factorisation fails
    _expect_failure(comm, ("DIVERGED_LINEAR_SOLVE",), residual=D.residual, u0=torch.zeros(D.m, dtype=F64),
                    jacobian=D.jacobian, backend=backend, linear_solver={"method": "direct"})


@pytest.mark.parametrize("backend", BACKENDS)
def test_progress_prints_on_rank0(comm, backend, capsys):
    P = FD1D(16, comm)
    f, c, a = _data(P)
    _, info = nonlinear_solve(P.residual, torch.zeros_like(P.x), f, c, a, jacobian=P.jacobian, backend=backend,
                              progress=True, return_info=True)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("Newton")]
    assert len(lines) == (info.iterations if comm.Get_rank() == 0 else 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_callback_and_step_test(comm, backend):
    P = FD1D(20, comm, dtype=torch.float32)
    f = (50 * torch.sin(np.pi * P.x) + 20).float()
    seen = []
    u, info = nonlinear_solve(P.residual, torch.zeros_like(P.x), f, 5.0, 2.0, jacobian=P.jacobian,
                              backend=backend, rtol=1e-4, return_info=True,
                              callback=lambda it, rn: seen.append((it, rn)))
    assert u.dtype == torch.float32 and info.converged
    assert [s[0] for s in seen] == list(range(1, info.iterations + 1))
    np.testing.assert_allclose([s[1] for s in seen], info.residual_history[1:], rtol=1e-12)
    P64 = FD1D(20, comm)
    ref = nonlinear_solve(P64.residual, torch.zeros_like(P64.x), f.double(), 5.0, 2.0, jacobian=P64.jacobian,
                          backend=backend, rtol=1e-10)
    assert float((u.double() - ref).abs().max()) < 1e-4
    # the step test (stol) stops before the residual test, with PETSc's reason name
    _, si = nonlinear_solve(P64.residual, torch.zeros_like(P64.x), f.double(), 5.0, 2.0, jacobian=P64.jacobian,
                            backend=backend, rtol=1e-14, stol=1e-3, return_info=True)
    assert si.converged and si.reason == "CONVERGED_SNORM_RELATIVE" and si.residual_norm > 1e-14 * \
        si.residual_history[0]


def test_without_petsc4py(comm):
    # the torch backend is the default without petsc4py (one rank, a subprocess)
    if comm.Get_size() > 1:
        return
    import os
    import subprocess
    import sys
    script = (
        "import sys; sys.modules['petsc4py'] = None; sys.modules['slepc4py'] = None\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "import torch, slasolve\n"
        "from mpi4py import MPI\n"
        "from test_nonlinear import FD1D, _data\n"
        "assert 'petsc4py.PETSc' not in sys.modules\n"
        "P = FD1D(30, MPI.COMM_WORLD); f, c, a = _data(P); c.requires_grad_(True)\n"
        "u, info = slasolve.nonlinear_solve(P.residual, torch.zeros_like(P.x), f, c, a, jacobian=P.jacobian,"
        " return_info=True)\n"
        "assert info.backend == 'torch' and info.converged, info\n"
        "u.sum().backward(); assert c.grad is not None\n"
        "print('OK', info.iterations)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK 9" in out.stdout


def test_gamg_redo_after_a_failed_linear_solve(comm, monkeypatch):
    """GAMG keeps its prolongators between Newton steps; a DIVERGED_LINEAR_SOLVE is redone once
    from u0 with GAMG rebuilt for every tangent (none when the user set the option), and a
    failure the rebuild cannot avoid is still reported as it was."""
    from slasolve.nonlinear import petsc_snes
    runs = []
    real = petsc_snes._snes_run

    def counting(*args, **kwargs):
        runs.append(dict(args[-1]))
        return real(*args, **kwargs)
    monkeypatch.setattr(petsc_snes, "_snes_run", counting)
    P = FD1D(16, comm)
    f, c, a = _data(P)
    kw = dict(jacobian=P.jacobian, backend="petsc", linear_solver={"method": "gmres", "pc": "gamg", "maxiter": 1,
                                                                   "rtol": 1e-12})
    _expect_failure(comm, ("DIVERGED_LINEAR_SOLVE",), (f, c, a), residual=P.residual, u0=torch.zeros_like(P.x), **kw)
    assert runs == [{}, petsc_snes._REBUILD_ENTRIES]
    runs.clear()
    _expect_failure(comm, ("DIVERGED_LINEAR_SOLVE",), (f, c, a), residual=P.residual, u0=torch.zeros_like(P.x),
                    petsc_options={"pc_gamg_reuse_interpolation": "true"}, **kw)
    assert runs == [{}]
    runs.clear()
    u, info = nonlinear_solve(P.residual, torch.zeros_like(P.x), f, c, a, jacobian=P.jacobian, backend="petsc",
                              rtol=1e-10, linear_solver={"method": "gmres", "pc": "gamg"}, return_info=True)
    assert info.converged and runs == [{}]


def _kept(P):
    """The SNES solvers kept on the problem's Jacobian layout."""
    return P.J0._layout.cache("nonlinear_solvers")


def test_kept_snes_honours_every_setting_and_value(comm):
    """With a Jacobian the SNES is kept per layout and settings: a repeated call reuses it and
    gives the same answer; new parameter values (also changed in place), settings and options
    database entries are honoured, each answer equal to a fresh SNES's; the kept SNES holds
    nothing of a finished call; a callback error drops it."""
    from slasolve.petsc import PETSc
    P = FD1D(24, comm)
    f, c, a = _data(P)
    u0 = torch.zeros_like(P.x)
    kw = dict(jacobian=P.jacobian, backend="petsc", rtol=1e-10, return_info=True)

    def fresh(*params, **extra):
        _kept(P).clear()
        return nonlinear_solve(P.residual, u0, *params, **kw, **extra)

    ref, rinfo = fresh(f, c, a)
    assert len(_kept(P)) == 1
    (solver,) = _kept(P).values()
    assert solver.calls.cb is None    # nothing of the finished call (problem, params) is kept
    u, info = nonlinear_solve(P.residual, u0, f, c, a, **kw)
    assert len(_kept(P)) == 1 and next(iter(_kept(P).values())) is solver
    assert torch.equal(u, ref) and info.residual_history == rinfo.residual_history
    # new values: a new parameter, then one changed in place
    a2 = torch.tensor(3.0, dtype=F64)
    u, info = nonlinear_solve(P.residual, u0, f, c, a2, **kw)
    fr, finfo = fresh(f, c, a2)
    assert info.iterations == finfo.iterations
    torch.testing.assert_close(u, fr, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(u, ref)
    f2 = f.clone()
    nonlinear_solve(P.residual, u0, f2, c, a, **kw)
    f2.mul_(0.5)
    u, info = nonlinear_solve(P.residual, u0, f2, c, a, **kw)
    fr, finfo = fresh(f * 0.5, c, a)
    assert info.iterations == finfo.iterations
    torch.testing.assert_close(u, fr, rtol=1e-12, atol=1e-14)
    # other settings: their own SNES, each configured as asked
    fresh(f, c, a)
    _, i1 = nonlinear_solve(P.residual, u0, f, c, a, **{**kw, "rtol": 1e-3})
    _, i2 = nonlinear_solve(P.residual, u0, f, c, a, **kw, linear_solver={"method": "bicgstab", "pc": "jacobi"})
    _, i3 = nonlinear_solve(P.residual, u0, f, c, a, **kw, maxiter=1, raise_on_fail=False)
    _, i4 = nonlinear_solve(P.residual, u0, f, c, a, **kw, petsc_options={"snes_linesearch_type": "basic"})
    assert len(_kept(P)) == 4    # SNES_CACHE_SIZE: the least recently used (rtol=1e-10) dropped
    assert i1.rtol == 1e-3 and i1.iterations < rinfo.iterations
    assert i2.linear_method == "bicgstab" and i2.pc == "jacobi" and i2.converged
    assert i3.reason == "DIVERGED_MAX_IT" and i3.iterations == 1
    assert i4.line_search == "basic" and i4.converged
    # an options database entry set, then removed, between calls with the same arguments
    PETSc.Options().setValue("snes_max_it", 2)
    try:
        _, i5 = nonlinear_solve(P.residual, u0, f, c, a, **kw, raise_on_fail=False)
    finally:
        PETSc.Options().delValue("snes_max_it")
    assert i5.reason == "DIVERGED_MAX_IT" and i5.iterations == 2
    u, info = nonlinear_solve(P.residual, u0, f, c, a, **kw)
    assert info.converged and info.iterations == rinfo.iterations
    torch.testing.assert_close(u, ref, rtol=1e-12, atol=1e-14)
    # an error raised inside a callback (on every rank) drops the SNES it stopped
    n_before = len(_kept(P))
    calls = [0]

    def failing(u, *p):
        calls[0] += 1
        if calls[0] == 3:
            raise ValueError("boom")
        return P.residual(u, *p)
    with pytest.raises(ValueError, match="boom"):
        nonlinear_solve(failing, u0, f, c, a, **kw)
    assert len(_kept(P)) == n_before - 1
    u, info = nonlinear_solve(P.residual, u0, f, c, a, **kw)
    torch.testing.assert_close(u, ref, rtol=1e-12, atol=1e-14)


def test_kept_snes_gradients_and_gamg_across_calls(comm):
    """On a kept SNES GAMG keeps its prolongators from one call to the next (as DOLFINx's
    NewtonSolver does): Newton steps and the answer equal a fresh SNES's for new values, and the
    implicit-function gradient through a repeated call equals the first call's."""
    P = FD1D(40, comm)
    f, c, a = _data(P)
    u0 = torch.zeros_like(P.x)
    ls = {"method": "gmres", "pc": "gamg", "rtol": 1e-11}
    kw = dict(jacobian=P.jacobian, backend="petsc", rtol=1e-10, linear_solver=ls, return_info=True)
    grads, infos = [], []
    for k in range(2):
        fg = f.clone().requires_grad_(True)
        u, info = nonlinear_solve(P.residual, u0, fg, c, a, **kw)
        slasolve.global_sum((u * u).sum(), comm).backward()
        grads.append(fg.grad.clone())
        infos.append(info)
    assert len(_kept(P)) == 1 and infos[0].iterations == infos[1].iterations
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-8, atol=1e-12 * float(grads[0].abs().max()))
    for scale in (0.3, 2.0):
        u, info = nonlinear_solve(P.residual, u0, f * scale, c, a, **kw)
        _kept(P).clear()
        fr, finfo = nonlinear_solve(P.residual, u0, f * scale, c, a, **kw)
        assert info.converged and info.iterations == finfo.iterations
        torch.testing.assert_close(u, fr, rtol=1e-9, atol=1e-12)


def test_nested_call_on_a_kept_snes(comm):
    """A nonlinear_solve from inside a callback of another, on the same layout and settings, gets
    a SNES of its own (the kept one is busy): both answers equal the plain solve's."""
    P = FD1D(24, comm)
    f, c, a = _data(P)
    u0 = torch.zeros_like(P.x)
    kw = dict(jacobian=P.jacobian, backend="petsc", rtol=1e-10)
    ref = nonlinear_solve(P.residual, u0, f, c, a, **kw)
    inner, calls = [], [0]

    def residual(u, *p):
        calls[0] += 1
        if calls[0] == 2:   # the first evaluation inside SNES (F(u0) was evaluated before it)
            inner.append(nonlinear_solve(P.residual, u0, *p, **kw))
        return P.residual(u, *p)
    u = nonlinear_solve(residual, u0, f, c, a, **kw)
    torch.testing.assert_close(inner[0], ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(u, ref, rtol=1e-12, atol=1e-14)
    assert len(inner) == 1 and len(_kept(P)) == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("matrix_free", [False, True])
@pytest.mark.parametrize("kind, at", [("raise", 1), ("raise", 3), ("shape", 1), ("shape", 4), ("dtype", 2)])
def test_residual_problem_on_one_rank_raises_everywhere(comm, backend, matrix_free, kind, at):
    """A residual that raises, or returns the wrong shape or dtype, on ONE rank only -- at u0 or
    mid-solve -- raises on every rank (at u0 the petsc backend defers the check to the collective
    check of the Jacobian at u0, or of its own without a Jacobian); the next call, on the same
    kept SNES settings, solves."""
    P = FD1D(16, comm)
    f, c, a = _data(P)
    u0 = torch.zeros_like(P.x)
    rank, size = comm.Get_rank(), comm.Get_size()
    calls = []

    def bad(u, *p):
        r = P.residual(u, *p)   # the halo exchange runs on every rank: the problem comes after it
        calls.append(1)
        if rank == size - 1 and len(calls) == at:
            if kind == "raise":
                raise ArithmeticError("residual failed on purpose")
            return torch.cat([r, r[:1]]) if kind == "shape" else r.float()
        return r
    expected = {"raise": (ArithmeticError, "on purpose"), "shape": (ValueError, "owned rows"),
                "dtype": (TypeError, "dtype")}[kind]
    kw = dict(jacobian=None if matrix_free else P.jacobian, backend=backend, rtol=1e-10)
    outcome = None
    try:
        nonlinear_solve(bad, u0, f, c, a, raise_on_fail=False, **kw)
    except Exception as e:   # noqa: BLE001 - compared below on every rank
        outcome = (type(e).__name__, bool(__import__("re").search(expected[1], str(e))))
    _same_everywhere(comm, outcome)
    assert outcome == (expected[0].__name__, True), outcome
    u, info = nonlinear_solve(P.residual, u0, f, c, a, return_info=True, **kw)
    ref = nonlinear_solve(P.residual, u0, f, c, a, **dict(kw, backend="torch"))
    assert info.converged
    torch.testing.assert_close(u, ref, rtol=1e-6, atol=1e-8)
