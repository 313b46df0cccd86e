"""slasolve.timestepping: schemes against a SciPy reference and analytic decay, convergence
orders, checkpointed adjoints equal to full storage, against finite differences and the Taylor
test, recomputation counts at the binomial optimum, nonlinear steps, FEM heat equation.

Run serially and under mpirun -n 2 / 4 with --with-mpi.
"""

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from mpi4py import MPI

import slasolve
from slasolve.fem import Assembler, box_mesh
from slasolve.testing import taylor_test
from slasolve.timestepping import LinearTimeProblem, NonlinearTimeProblem, integrate, optimal_recomputations

from heat_line import distributed_line, line_matrices, rank_random, scipy_steps, source

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
DT = torch.float64
N_GRID = 12
SOLVERS = [pytest.param("direct", marks=pytest.mark.petsc), pytest.param("cg", marks=pytest.mark.petsc),
           "cg-torch"]


def allsum(t):
    return slasolve.global_sum(t, COMM)


def needs_schedules():
    pytest.importorskip("checkpoint_schedules")








def problem(method, sch, Kvalues=None):
    """``method``: "direct", "cg" (petsc backend) or "cg-torch" (the native torch backend)."""
    dM, dK, _ = distributed_line(COMM)
    K = dK if Kvalues is None else dK.with_values(Kvalues)
    method, _, backend = method.partition("-")
    return LinearTimeProblem(dM, K, source, scheme=sch, method=method, pc="jacobi", rtol=1e-13,
                             backend=backend or None)




@pytest.mark.parametrize("method", SOLVERS)
@pytest.mark.parametrize("sch", ["be", "cn", "bdf2", 0.7])
def test_steps_match_scipy(method, sch):
    dM, dK, x = distributed_line(COMM)
    P = problem(method, sch)
    q, u0 = torch.sin(3 * x), torch.cos(2 * x)
    dt, N = 0.01, 6
    uN = integrate(P, u0, q, dt=dt, n_steps=N)
    M, K = line_matrices()
    xg = np.linspace(0, 1, N_GRID + 2)[1:-1]
    ref = scipy_steps(M, K, sch, dt, N, np.cos(2 * xg), np.sin(3 * xg))
    got = dK.gather(uN, root=None).numpy()
    assert np.abs(got - ref).max() <= 1e-10 * np.abs(ref).max()


@pytest.mark.parametrize("sch,order", [("be", 1), ("cn", 2), ("bdf2", 2)])
def test_convergence_order_against_exact_decay(sch, order):
    """u0 = sin(pi x) is a generalized eigenvector, K v = lam M v: u(t) = exp(-lam t) v."""
    dM, dK, x = distributed_line(COMM)
    n, h = N_GRID, 1.0 / (N_GRID + 1)
    lam = (2 - 2 * np.cos(np.pi * h)) / h ** 2 / ((4 + 2 * np.cos(np.pi * h)) / 6)
    v = torch.sin(np.pi * x)
    P = LinearTimeProblem(dM, dK, scheme=sch, method="cg", rtol=1e-14)
    T, errs = 0.05, []
    for N in (10, 20, 40):
        u = integrate(P, v, dt=T / N, n_steps=N)
        errs.append(float(allsum(((u - np.exp(-lam * T) * v) ** 2).sum())) ** 0.5)
    rates = np.log2(np.array(errs[:-1]) / np.array(errs[1:]))
    assert (np.abs(rates - order) < 0.15).all(), (errs, rates)


# both backends: MUMPS (petsc) with CN at every size; torch-backend CG with BDF2 at 1 and 2 ranks (test-time budget)
@pytest.mark.parametrize("method,sch", [pytest.param("direct", "cn", marks=pytest.mark.petsc),
                                        pytest.param("cg-torch", "bdf2", marks=pytest.mark.skipif(
                                            COMM.size > 2, reason="test-time budget: 1 and 2 ranks"))])
def test_checkpointed_gradient_equals_full_storage_fd_and_taylor(method, sch):
    needs_schedules()
    dM, dK, x = distributed_line(COMM)
    u0, q, Kv = torch.cos(2 * x), torch.sin(3 * x), dK.values.clone()
    dt, N = 0.01, 8

    def loss(u0, q, Kv, **kw):
        out = integrate(problem(method, sch, Kv), u0, q, dt=dt, n_steps=N, outputs=[N // 2, N], **kw)
        return allsum((out[1] ** 2).sum() + (out[0] * x).sum())

    grads = {}
    # memory-only binomial runs of <= 200 steps use checkpoint_schedules.Revolve's sequence; the
    # memory + disk run uses its MultistageCheckpointSchedule
    for kw in ({}, {"checkpoints": 5}, {"checkpoints": 2, "snapshots_on_disk": 2}):
        leaves = [t.clone().requires_grad_(True) for t in (u0, q, Kv)]
        loss(*leaves, **kw).backward()
        grads[repr(kw)] = torch.cat([t.grad for t in leaves])
    full = grads["{}"]
    scale = float(allsum(full.abs().max()))
    for key, g in grads.items():
        assert float(allsum((g - full).abs().max())) <= 1e-12 * scale, key
    # finite differences along one direction (central, h^2 error ~1e-9 relative)
    d = [rank_random(u0.shape, 1, COMM), rank_random(q.shape, 2, COMM), 10 * rank_random(Kv.shape, 3, COMM)]
    h = 1e-5
    with torch.no_grad():
        fd = (loss(*[t + h * e for t, e in zip((u0, q, Kv), d)], checkpoints=5)
              - loss(*[t - h * e for t, e in zip((u0, q, Kv), d)], checkpoints=5)) / (2 * h)
    n0, nq = u0.shape[0], q.shape[0]
    ad = float(allsum((full[:n0] * d[0]).sum() + (full[n0:n0 + nq] * d[1]).sum() + (full[n0 + nq:] * d[2]).sum()))
    assert abs(ad - float(fd)) <= 1e-7 * abs(ad), (ad, float(fd))
    r = taylor_test(lambda a, b, c: loss(a, b, c, checkpoints=5), [u0, q, Kv], d, steps=3)
    assert r.rate > 1.9


def _optimal_by_dp(l_max, c_max):
    """Griewank's recursion for the fewest forward steps (independent of the closed form):
    F(l, c) = min_j [j + F(l - j, c - 1) + F(j, c)], F(1, c) = 0, F(l, 0) = l (l - 1) / 2, where c
    counts the snapshots besides the initial state (which slasolve's and checkpoint_schedules'
    snapshot counts include)."""
    F = np.zeros((l_max + 1, c_max + 1), dtype=np.int64)
    for ll in range(2, l_max + 1):
        F[ll, 0] = ll * (ll - 1) // 2
        for c in range(1, c_max + 1):
            F[ll, c] = min(j + F[ll - j, c - 1] + F[j, c] for j in range(1, ll))
    return F


def test_recomputations_are_the_binomial_optimum():
    needs_schedules()
    F = _optimal_by_dp(60, 6)
    for n, s in [(7, 2), (30, 3), (60, 5)]:
        assert optimal_recomputations(n, s) == F[n, s - 1]
    dM, dK, x = distributed_line(COMM)
    # K's values require grad: the adjoint reads the states (without, it stores none: test_state_free_adjoint)
    P = LinearTimeProblem(dM, dK.with_values(dK.values.clone().requires_grad_(True)), scheme="be", method="cg",
                          rtol=1e-12)
    for n, s in [(12, 2), (20, 4)]:
        u0 = torch.sin(np.pi * x).requires_grad_(True)
        u, info = integrate(P, u0, dt=1e-3, n_steps=n, checkpoints=s, return_info=True)
        allsum(u.sum()).backward()
        assert info.recomputed_steps == info.optimal_recomputed_steps == F[n, s - 1]
        assert info.adjoint_steps == n and info.transposed_solves == n
        assert info.peak_stored_states <= s + 2       # s snapshots + the step being reversed
    # one factorisation serves every forward, recomputed and adjoint step (BDF2: two matrices)
    if COMM.size == 1 or slasolve.krylov.default_backend() == "petsc":
        for sch, n_mat in (("cn", 1), ("bdf2", 2)):
            P = LinearTimeProblem(dM, dK.with_values(dK.values.clone().requires_grad_(True)), scheme=sch,
                                  method="direct")
            u0 = torch.sin(np.pi * x).requires_grad_(True)
            u, info = integrate(P, u0, dt=1e-3, n_steps=12, checkpoints=3, return_info=True)
            allsum(u.sum()).backward()
            assert info.factorizations == n_mat and info.linear_solves == info.forward_steps
            assert info.transposed_solves == 12


def _diag_mask(A):
    indptr, indices, _ = A.local_rows_csr()
    rows = torch.repeat_interleave(torch.arange(A.row_range[0], A.row_range[1]), indptr[1:] - indptr[:-1])
    return indices == rows, rows - A.row_range[0]


@pytest.mark.skipif(COMM.size > 2, reason="test-time budget: 1 and 2 ranks")
def test_nonlinear_steps():
    """Backward Euler for M du/dt + K u + u^3 = q: Newton per step; the first step against
    nonlinear_solve, gradients with checkpointing equal to full storage, the Taylor test, and
    the Jacobian-free variant (its adjoint re-solves each step) giving the same gradient."""
    needs_schedules()
    dM, dK, x = distributed_line(COMM)
    dt, N = 0.01, 4
    mask, rows = _diag_mask(dK)

    def residual(u, u_old, t, q):
        return dM @ (u - u_old) / dt + dK @ u + u ** 3 - q * (1 + t)

    def jacobian(u, u_old, t, q):
        return dK.with_values(dM.values / dt + dK.values + torch.where(mask, 3 * u[rows] ** 2, 0.0))

    newton = dict(rtol=1e-13, stol=1e-13)
    P = NonlinearTimeProblem(residual, jacobian, linear_solver={"method": "gmres", "rtol": 1e-13, "pc": "jacobi"},
                             **newton)
    # Jacobian-free: finite-difference J v limits the inner tolerance (~1e-8 relative)
    P_free = NonlinearTimeProblem(residual, None, linear_solver={"method": "gmres", "rtol": 1e-9},
                                  rtol=1e-11, stol=1e-12)
    u0, q = 2 * torch.cos(2 * x), 3 * torch.sin(3 * x)

    def loss(P, u0, q, **kw):
        return allsum((integrate(P, u0, q, dt=dt, n_steps=N, **kw) ** 2).sum())

    u1 = integrate(P, u0, q, dt=dt, n_steps=1)
    ref = slasolve.nonlinear_solve(lambda u, q: residual(u, u0, dt, q), u0, q, **newton)
    assert float(allsum((u1 - ref).abs().max())) <= 1e-10
    grads = []
    # the Jacobian-free variant (matrix-free GMRES: many reductions) on one rank only (test-time budget)
    # (PETSc's SNES; the torch backend's finite-difference J v does not reach these inner tolerances)
    free = COMM.size == 1 and slasolve.krylov.default_backend() == "petsc"
    variants = ((P, {}), (P, {"checkpoints": 2})) + (((P_free, {"checkpoints": 2}),) if free else ())
    for prob, kw in variants:
        a, b = u0.clone().requires_grad_(True), q.clone().requires_grad_(True)
        loss(prob, a, b, **kw).backward()
        grads.append(torch.cat([a.grad, b.grad]))
    scale = float(allsum(grads[0].abs().max()))
    assert float(allsum((grads[0] - grads[1]).abs().max())) <= 1e-12 * scale
    # matrix-free: inner GMRES to 1e-13, adjoint to 1e-10 (nonlinear_solve's cap)
    if free:
        assert float(allsum((grads[0] - grads[2]).abs().max())) <= 1e-7 * scale
    assert taylor_test(lambda a, b: loss(P, a, b, checkpoints=2), [u0, q],
                       [rank_random(u0.shape, 4, COMM), rank_random(q.shape, 5, COMM)], steps=3).rate > 1.9


def test_fem_heat_conductivity_gradient():
    """Heat equation on a 4x4 quad mesh: M from Assembler.mass, K from a per-cell
    conductivity; the gradient with respect to the conductivity through 15 CN steps."""
    needs_schedules()
    V = Assembler(box_mesh((4, 4), cell="quad", comm=COMM))
    M = V.mass()
    u0 = V.interpolate(lambda p: torch.sin(np.pi * p[:, 0]) * p[:, 1])
    w = V.interpolate(lambda p: p[:, 0] + p[:, 1] ** 2)
    kappa = 1.0 + 0.5 * torch.cos(3 * V.cell_coords.mean(1)[:, 0])
    f = V.load(lambda p: 1.0 + p[:, 0])

    def J(kappa, u0):
        P = LinearTimeProblem(M, V.stiffness(kappa), lambda t: f, scheme="cn", method="cg", pc="jacobi",
                              rtol=1e-13)
        u = integrate(P, u0, dt=0.02, n_steps=15, checkpoints=4)
        return allsum((w * u).sum() + (u * u).sum())

    assert taylor_test(J, [kappa, u0], [0.3 * rank_random(kappa.shape, 6, COMM), rank_random(u0.shape, 7, COMM)]).rate > 1.9


def test_bad_arguments_raise_on_every_rank():
    dM, dK, x = distributed_line(COMM)
    P = LinearTimeProblem(dM, dK, method="cg")
    with pytest.raises(ValueError, match="dt"):
        integrate(P, torch.zeros_like(x), dt=-1.0 if COMM.rank == 0 else 0.1, n_steps=3)
    with pytest.raises(ValueError, match="owned rows"):
        integrate(P, torch.zeros(x.shape[0] + (COMM.rank == 0)), dt=0.1, n_steps=3)
    with pytest.raises(ValueError, match="pattern"):
        I = slasolve.DSparseTensor.from_global(sp.identity(N_GRID, format="csr"), COMM)
        LinearTimeProblem(I, dK)
    with pytest.raises(ValueError, match="scheme|theta"):
        LinearTimeProblem(dM, dK, scheme=0.3)
    u0 = x.clone().requires_grad_(True)
    u = integrate(P, u0, dt=0.1, n_steps=3)
    loss = allsum(u.sum())
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already"):
        loss.backward()


@pytest.mark.petsc
@pytest.mark.parametrize("checkpoints", [None, 2])
def test_nonfinite_source_raises_on_every_rank(checkpoints):
    """The direct steps' batched checks (one reduction per sweep): a NaN source on one rank
    at one step raises ValueError on every rank at the end of the forward sweep, never a
    result (full storage and checkpointed)."""
    needs_schedules()
    dM, dK, x = distributed_line(COMM)

    def src(t, q):
        bad = COMM.rank == COMM.size - 1 and abs(t - 0.03) < 1e-12
        return q * float("nan") if bad else q

    P = LinearTimeProblem(dM, dK, src, scheme="be", method="direct")
    q = torch.sin(3 * x).requires_grad_(True)
    with pytest.raises(ValueError, match="NaN or infinite"):
        integrate(P, torch.cos(2 * x), q, dt=0.01, n_steps=6, checkpoints=checkpoints)


@pytest.mark.parametrize("method", SOLVERS)
@pytest.mark.parametrize("sch", ["cn", "bdf2"])
def test_state_free_adjoint(method, sch):
    """M and K constant: the adjoint reads no state, so integrate stores and recomputes nothing
    whatever checkpoints asks for; the gradients of u0 and the source equal those of the
    checkpointed schedule (run when K's values require grad) to 1e-12."""
    needs_schedules()
    dM, dK, x = distributed_line(COMM)
    n = 16
    grads, infos = {}, {}
    for kind in ("free", "schedule"):
        Kv = dK.values.clone().requires_grad_(kind == "schedule")
        P = problem(method, sch, Kv)
        u0, q = torch.cos(2 * x).requires_grad_(True), torch.sin(3 * x).requires_grad_(True)
        (mid, end), info = integrate(P, u0, q, dt=0.01, n_steps=n, outputs=[5, n], checkpoints=3, return_info=True)
        allsum((end ** 2).sum() + (mid * x).sum()).backward()
        grads[kind], infos[kind] = torch.cat([u0.grad, q.grad]), info
    free, ref = grads["free"], grads["schedule"]
    assert float(allsum((free - ref).abs().max())) <= 1e-12 * float(allsum(ref.abs().max()))
    assert infos["free"].schedule.startswith("state-free") and infos["free"].recomputed_steps == 0
    assert infos["free"].forward_steps == n and infos["free"].adjoint_steps == n
    assert infos["schedule"].recomputed_steps == infos["schedule"].optimal_recomputed_steps > 0
