"""The backward of ``nonlinear_solve`` (petsc backend, with a Jacobian) solves ``J(u*)^T lam = g``
with the Newton solve's own kept KSP and preconditioner (the tangent at the solution written into
its Jacobian Mat; GAMG keeps its prolongators), as DOLFINx's hand adjoints do. References: central
finite differences of the objective and the from-scratch adjoint (``slasolve.solve``'s transpose
solve); the kept path falls back to the latter when it cannot be used or does not converge."""
import pytest
import torch
from mpi4py import MPI

import slasolve
import slasolve.nonlinear.petsc_snes as ps
from slasolve.fem import Assembler, DirichletBC, NonlinearDiffusion, boundary_dofs, box_mesh

pytestmark = pytest.mark.mpi
F64 = torch.float64
LS = dict(method="gmres", pc="gamg", rtol=1e-12)


def _problem(comm, n=6):
    sp = Assembler(box_mesh(n, cell="triangle", comm=comm))
    bd = boundary_dofs(sp)
    P = NonlinearDiffusion(sp, DirichletBC(sp, bd, torch.zeros(len(bd), dtype=F64)), source=10.0)
    E = sp.mesh.n_local_cells
    g = torch.Generator().manual_seed(7 + comm.rank)
    theta = 0.3 * torch.rand(E, generator=g, dtype=F64) - 0.15
    d = torch.rand(E, generator=g, dtype=F64) - 0.5
    return sp, P, theta, d


def _objective(sp, P, theta, ls=LS, jacobian=None):
    u = slasolve.nonlinear_solve(P.residual, sp.zeros(), torch.exp(theta),
                                 jacobian=P.jacobian if jacobian is None else jacobian, rtol=1e-12,
                                 linear_solver=ls)
    w = torch.linspace(0.5, 1.5, u.shape[0], dtype=F64)    # a non-symmetric weight: g is no multiple of u
    return slasolve.global_sum(0.5 * (w * u * u).sum(), sp.comm)


def _gradient(sp, P, theta, **kw):
    t = theta.clone().requires_grad_(True)
    _objective(sp, P, t, **kw).backward()
    return t.grad


class _Spy:
    """Records what ``adjoint_solve_kept`` returned (None: the from-scratch path ran)."""

    def __init__(self, monkeypatch, disable=False):
        self.results = []
        real = ps.adjoint_solve_kept

        def spy(*a, **k):
            out = None if disable else real(*a, **k)
            self.results.append(out is not None)
            return out
        monkeypatch.setattr(ps, "adjoint_solve_kept", spy)


def _dot(comm, a, b):
    return comm.allreduce(float(a @ b), op=MPI.SUM)


def test_kept_adjoint_matches_finite_differences_and_scratch(comm, monkeypatch):
    sp, P, theta, d = _problem(comm)
    spy = _Spy(monkeypatch)
    g = _gradient(sp, P, theta)
    assert spy.results == [True]          # the kept KSP was used
    h = 1e-6
    with torch.no_grad():
        fd = (float(_objective(sp, P, theta + h * d)) - float(_objective(sp, P, theta - h * d))) / (2 * h)
    gd = _dot(comm, g, d)
    assert abs(gd - fd) <= 1e-6 * abs(fd)
    monkeypatch.undo()
    scratch = _Spy(monkeypatch, disable=True)
    g_ref = _gradient(sp, P, theta)
    assert scratch.results == [False]
    err = comm.allreduce(float((g - g_ref).abs().max()), op=MPI.MAX)
    scale = comm.allreduce(float(g_ref.abs().max()), op=MPI.MAX)
    assert err <= 1e-8 * scale


def test_kept_adjoint_in_a_loop_of_changing_parameters(comm, monkeypatch):
    # an optimisation loop: new parameters each iteration, the kept SNES (and its GAMG prolongators)
    # reused by every forward and backward; each gradient equals the from-scratch one
    sp, P, theta, _ = _problem(comm)
    spy = _Spy(monkeypatch)
    grads = []
    for k in range(3):
        grads.append(_gradient(sp, P, theta * (1 + 0.5 * k)))
    assert spy.results == [True] * 3
    monkeypatch.undo()
    _Spy(monkeypatch, disable=True)
    for k in range(3):
        ref = _gradient(sp, P, theta * (1 + 0.5 * k))
        err = comm.allreduce(float((grads[k] - ref).abs().max()), op=MPI.MAX)
        assert err <= 1e-8 * comm.allreduce(float(ref.abs().max()), op=MPI.MAX)


def test_two_graphs_backward_in_reverse_order(comm, monkeypatch):
    # the second forward overwrites the kept SNES's Mat; the first graph's backward writes its own
    # tangent again: both gradients right
    sp, P, theta, _ = _problem(comm)
    spy = _Spy(monkeypatch)
    t1, t2 = theta.clone().requires_grad_(True), (2 * theta).requires_grad_(True)
    J1, J2 = _objective(sp, P, t1), _objective(sp, P, t2)
    J2.backward()
    J1.backward()
    assert spy.results == [True, True]
    monkeypatch.undo()
    _Spy(monkeypatch, disable=True)
    for t, ref_theta in ((t1, theta), (t2, 2 * theta)):
        ref = _gradient(sp, P, ref_theta)
        err = comm.allreduce(float((t.grad - ref).abs().max()), op=MPI.MAX)
        assert err <= 1e-8 * comm.allreduce(float(ref.abs().max()), op=MPI.MAX)


def test_dropped_snes_falls_back_to_scratch(comm, monkeypatch):
    # the kept SNES is evicted (other settings fill the cache) before the backward: the weak
    # reference is gone on every rank and the from-scratch adjoint runs, with the same answer
    sp, P, theta, _ = _problem(comm)
    ref = _gradient(sp, P, theta)
    spy = _Spy(monkeypatch)
    t = theta.clone().requires_grad_(True)
    J = _objective(sp, P, t)
    for k in range(ps.SNES_CACHE_SIZE + 1):   # other tolerances: other kept SNESs
        slasolve.nonlinear_solve(P.residual, sp.zeros(), jacobian=P.jacobian, rtol=1e-6 * (k + 2),
                                 linear_solver=LS)
    J.backward()
    assert spy.results == [False]
    err = comm.allreduce(float((t.grad - ref).abs().max()), op=MPI.MAX)
    assert err <= 1e-8 * comm.allreduce(float(ref.abs().max()), op=MPI.MAX)


def test_jacobian_on_another_layout_falls_back(comm, monkeypatch):
    # a user Jacobian returning a tensor on a new layout at every call: the kept Mat's pattern is not
    # known to be its pattern, so the from-scratch adjoint runs (same answer)
    sp, P, theta, _ = _problem(comm)
    ref = _gradient(sp, P, theta)

    def fresh(u, kappa):
        J = P.jacobian(u, kappa)
        loc = J.local
        return slasolve.DSparseTensor.from_local_rows(loc.indptr, loc.indices, loc.values, tuple(J.global_shape),
                                                      comm)
    spy = _Spy(monkeypatch)
    g = _gradient(sp, P, theta, jacobian=fresh)
    assert spy.results == [False]
    err = comm.allreduce(float((g - ref).abs().max()), op=MPI.MAX)
    assert err <= 1e-8 * comm.allreduce(float(ref.abs().max()), op=MPI.MAX)


def test_kept_adjoint_short_budget_gives_none_on_every_rank(comm, monkeypatch):
    # one inner iteration cannot reach rtol 1e-12: None on every rank (the caller then solves from
    # scratch); with the budget the same call returns J^T lam = g to the tolerance
    sp, P, theta, _ = _problem(comm)
    seen = []
    real = ps.adjoint_solve_kept

    def capture(*a, **k):
        seen.append(a)
        return real(*a, **k)
    monkeypatch.setattr(ps, "adjoint_solve_kept", capture)
    _gradient(sp, P, theta)
    kept, c, J, g = seen[0][:4]
    assert ps.adjoint_solve_kept is capture and kept.solver() is not None
    assert real(kept, c, J, g, 1e-12, 0.0, 1) is None
    lam = real(kept, c, J, g, 1e-12, 0.0, None)
    assert lam is not None
    r = g - J.rmatvec(lam)
    rn = comm.allreduce(float(r @ r), op=MPI.SUM) ** 0.5
    gn = comm.allreduce(float(g @ g), op=MPI.SUM) ** 0.5
    assert rn <= 1e-10 * gn
