"""``nonlinear_solve``'s final residual check on the petsc backend takes ``||F(u)||`` from SNES's own
function Vec (no reduction) where ``newtonls`` with ``bt`` / ``basic`` computing norms left ``F(u)``
there and nothing changed since (``_Callbacks.final_norm``); elsewhere (another SNES type or line
search, norms off, a failed line search) the previous check runs. Either way ``residual_norm`` is
``||F(u)||`` of the returned ``u``, recomputed here by the problem's methods."""
import math

import pytest
import torch

import slasolve
from mpi4py import MPI
from slasolve.nonlinear import petsc_snes

from nl_problems import F64, LU, diffusion, solid

pytestmark = pytest.mark.mpi


def _spy(monkeypatch):
    """The answers of ``_Callbacks.final_norm`` (None: the previous check ran)."""
    seen = []
    real = petsc_snes._Callbacks.final_norm

    def spy(self, *a):
        out = real(self, *a)
        seen.append(out)
        return out
    monkeypatch.setattr(petsc_snes._Callbacks, "final_norm", spy)
    return seen


def _norm(comm, r):
    return math.sqrt(comm.allreduce(float((r * r).sum()), op=MPI.SUM))


CASES = [
    (dict(), True),
    (dict(line_search="basic"), True),
    (dict(stol=1e-3), True),
    (dict(maxiter=2, raise_on_fail=False), True),
    (dict(maxiter=0, raise_on_fail=False), True),
    (dict(linear_solver=dict(method="gmres", maxiter=1), raise_on_fail=False), True),   # failed KSP
    (dict(petsc_options={"snes_linesearch_damping": 0.7}, maxiter=100), True),
    (dict(petsc_options={"snes_type": "ksponly"}, raise_on_fail=False), False),
    (dict(petsc_options={"snes_linesearch_type": "l2"}), False),
    (dict(petsc_options={"snes_linesearch_type": "basic", "snes_linesearch_norms": "false"}, maxiter=8,
          raise_on_fail=False), False),
]


@pytest.mark.parametrize("kw, fast", CASES)
def test_final_norm_is_the_residual_of_the_returned_u(comm, monkeypatch, kw, fast):
    sp, P = diffusion(comm)
    seen = _spy(monkeypatch)
    kw = dict(kw)
    ls = kw.pop("linear_solver", LU)
    u, info = slasolve.nonlinear_solve(P.residual, sp.zeros(), jacobian=P.jacobian, rtol=1e-10,
                                       linear_solver=ls, return_info=True, **kw)
    assert len(seen) == 1 and (seen[0] is not None) == fast
    with torch.no_grad():
        true = _norm(comm, P.residual(u))
    # the kernels' F(u) and the method's agree to rounding of the terms (|F(u0)| ~ 1)
    assert abs(info.residual_norm - true) <= 1e-13 * info.residual_history[0]
    # the same number as the previous check's (SNES's last evaluation at u, summed by one reduction)
    monkeypatch.setattr(petsc_snes._Callbacks, "final_norm", lambda self, *a: None)
    u2, info2 = slasolve.nonlinear_solve(P.residual, sp.zeros(), jacobian=P.jacobian, rtol=1e-10,
                                         linear_solver=ls, return_info=True, **kw)
    # (the two calls' iterates agree to rounding: several ranks need not sum alike from call to call)
    d = comm.allreduce(float((u - u2).abs().max()) if u.numel() else 0.0, op=MPI.MAX)
    scale = comm.allreduce(float(u2.abs().max()) if u2.numel() else 0.0, op=MPI.MAX)
    assert d <= 1e-10 * scale and info.reason == info2.reason and info.iterations == info2.iterations
    assert abs(info.residual_norm - info2.residual_norm) <= 1e-12 * info2.residual_history[0]


@pytest.mark.parametrize("line_search", ["bt", "basic"])
def test_final_norm_with_an_objective(comm, monkeypatch, line_search):
    sp, P = solid(comm, 0.5)
    seen = _spy(monkeypatch)
    u, info = slasolve.nonlinear_solve(P.residual, sp.zeros(), jacobian=P.jacobian, objective=P.energy,
                                       rtol=1e-10, line_search=line_search, linear_solver=dict(method="direct"),
                                       return_info=True)
    assert info.converged and seen and seen[-1] is not None
    with torch.no_grad():
        true = _norm(comm, P.residual(u))
    assert abs(info.residual_norm - true) <= 1e-13 * info.residual_history[0]
    assert info.residual_norm <= 1e-10 * info.residual_history[0] * (1 + 1e-8)
