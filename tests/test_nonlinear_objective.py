"""``nonlinear_solve(..., objective=P.energy)``: the line search's merit function is the energy
whose gradient the residual is (PETSc's ``SNESSetObjective``; the torch backend's own
backtracking), checked against Newton with sparse direct inner solves and full steps (a
reference without any line search), on both backends at any rank count; a bad objective
raises on every rank."""
import pytest
import torch

import slasolve
from slasolve.fem import Assembler, DirichletBC, NeoHookean, boundary_dofs, box_mesh

pytestmark = pytest.mark.mpi
RTOL = 1e-10


def _solid(comm, n):
    sp = Assembler(box_mesh((n, n), cell="triangle", comm=comm), 2)
    bd = boundary_dofs(sp, where=lambda x: x[:, 0] < 1e-12)
    P = NeoHookean(sp, DirichletBC(sp, bd, torch.zeros(len(bd), dtype=torch.float64)), mu=1.0, lmbda=1.5,
                   body_force=torch.tensor([0.0, -0.2], dtype=torch.float64))
    mu = (1.0 + 0.5 * sp.cell_coords.mean(1)[:, 0]).to(torch.float64)
    return sp, P, mu


def _run(sp, P, mu, **kw):
    m = mu.clone().requires_grad_()
    u, info = slasolve.nonlinear_solve(P.residual, sp.zeros(), m, jacobian=P.jacobian, rtol=RTOL,
                                       return_info=True, **kw)
    slasolve.global_sum((u ** 2).sum(), sp.comm).backward()
    return u.detach(), m.grad, info


def _close(a, b, rel, comm):
    num = float(slasolve.global_sum(((a - b) ** 2).sum(), comm).sqrt())
    return num <= rel * float(slasolve.global_sum((b ** 2).sum(), comm).sqrt())


@pytest.mark.parametrize("backend", ["petsc", "torch"])
def test_energy_line_search_matches_full_newton_steps(comm, backend):
    if backend == "petsc":
        pytest.importorskip("petsc4py")
    sp, P, mu = _solid(comm, max(8, comm.size))
    # full Newton steps with sparse direct inner solves (SciPy's on one rank, else MUMPS)
    from slasolve.krylov import default_backend
    ref_backend = "torch" if comm.size == 1 or default_backend() != "petsc" else "petsc"
    u_ref, g_ref, ref = _run(sp, P, mu, line_search="basic", linear_solver=dict(method="direct"),
                             backend=ref_backend)
    u, g, info = _run(sp, P, mu, objective=P.energy, linear_solver=dict(method="cg", rtol=RTOL), backend=backend)
    assert ref.converged and info.converged
    assert _close(u, u_ref, 1e-8, comm) and _close(g, g_ref, 1e-7, comm)
    # ||F|| backtracking converges to the same solution (in more steps here)
    u2, _, info2 = _run(sp, P, mu, linear_solver=dict(method="cg", rtol=RTOL), backend=backend)
    assert info2.converged and _close(u2, u_ref, 1e-8, comm)


@pytest.mark.parametrize("backend", ["petsc", "torch"])
@pytest.mark.parametrize("case", ["local value", "vector", "raises on last rank", "not callable"])
def test_bad_objective_raises_on_every_rank(comm, backend, case):
    if backend == "petsc":
        pytest.importorskip("petsc4py")
    sp, P, mu = _solid(comm, max(4, comm.size))
    if case == "local value":
        if comm.size == 1:
            pytest.skip("needs 2+ ranks")
        objective, error, match = (lambda u, m: (u ** 2).sum() + comm.rank), ValueError, "different values"
    elif case == "vector":
        objective, error, match = (lambda u, m: u), TypeError, "real scalar"
    elif case == "raises on last rank":
        def objective(u, m):
            e = P.energy(u, m)    # collective: every rank takes part before one raises
            if comm.rank == comm.size - 1:
                raise RuntimeError("objective failed here")
            return e
        error, match = RuntimeError, "objective failed here"
    else:
        objective, error, match = 3.0, TypeError, "objective must be callable"
    with pytest.raises(error, match=match):
        slasolve.nonlinear_solve(P.residual, sp.zeros(), mu, jacobian=P.jacobian, objective=objective,
                                 linear_solver=dict(method="cg"), backend=backend)


@pytest.mark.parametrize("backend", ["petsc", "torch"])
@pytest.mark.parametrize("case", ["energy", "energy with rounding noise", "not a merit function"])
def test_objective_line_search_stalling_continues_on_the_residual(comm, backend, case):
    """At rtol 1e-12 the energy's decrease along the last Newton steps (~||F|| ||du||, 1e-24 here)
    is far below the rounding of its value: PETSc's backtracking on it rejected every step
    (DIVERGED_LINE_SEARCH at ||F|| ~ 1e-12 ||F(u0)||). nonlinear_solve then continues from that
    iterate with the line search on ||F|| toward the same tolerance, and converges to the
    answer of the run without an objective -- also for a noisy or wrong objective."""
    if backend == "petsc":
        pytest.importorskip("petsc4py")
    import math
    sp, P, mu = _solid(comm, max(8, comm.size))

    def noisy(u, m):   # +-2 ulp of deterministic noise, the same value on every rank
        e = P.energy(u, m)
        return e * (1 + 4e-16 * math.sin(1e9 * float(slasolve.global_sum(u.sum(), comm))))

    objective = {"energy": P.energy, "energy with rounding noise": noisy,
                 "not a merit function": lambda u, m: -P.energy(u, m)}[case]
    kw = dict(jacobian=P.jacobian, rtol=1e-12, linear_solver=dict(method="cg", rtol=1e-12), backend=backend,
              return_info=True)
    u_ref, ref = slasolve.nonlinear_solve(P.residual, sp.zeros(), mu, **kw)
    u, info = slasolve.nonlinear_solve(P.residual, sp.zeros(), mu, objective=objective, **kw)
    assert ref.converged and info.converged, info.summary()
    assert info.residual_norm <= 1e-12 * info.residual_history[0]
    assert len(info.residual_history) == info.iterations + 1
    assert _close(u, u_ref, 1e-9, comm)
