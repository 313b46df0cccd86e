"""Nonlinear time steps: ``residual(u_new, u_old, t, *params) = 0`` solved by Newton.

The user writes the discrete step (any one-step scheme, ``dt`` in the closure); each step is
one :func:`slasolve.nonlinear_solve` started from ``u_old``. The adjoint of a step at the
stored ``(u_old, u_new)`` is one transposed solve with the Jacobian at ``u_new`` and one
vector-Jacobian product of the residual (no Newton iteration is repeated); without a
``jacobian`` the step is re-solved from ``u_new`` and differentiated by
:func:`slasolve.nonlinear_solve`'s own adjoint.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .._comm import check_collective, get_comm, user_code

__all__ = ["NonlinearTimeProblem"]


class NonlinearTimeProblem:
    """Collective (constructor). Time steps defined by ``residual(u_new, u_old, t, *params) = 0``.

    Parameters
    ----------
    residual : callable ``(u_new, u_old, t, *params) -> r``
        The owned rows of the step's residual (e.g. backward Euler
        ``M (u_new - u_old) / dt + F(u_new, t)``); ``t`` is the new time ``t_{n+1}``. Torch
        operations, differentiable in ``u_old`` and the tensor ``params``; it may communicate.
    jacobian : callable ``(u_new, u_old, t, *params) -> DSparseTensor``, optional
        ``d residual / d u_new`` (exact: the adjoint is as right as it is). ``None``:
        Jacobian-free Newton-Krylov, and an adjoint step that re-solves the step from the
        known ``u_new`` (about one Newton step more per adjoint step).
    linear_solver : dict, optional
        :func:`slasolve.nonlinear_solve`'s inner solver settings; the adjoint's transposed
        solves use them with ``rtol`` at most ``1e-10`` (float32 ``1e-5``).
    comm : MPI.Comm, optional
        Default ``MPI.COMM_WORLD``.
    **newton
        Further :func:`slasolve.nonlinear_solve` arguments (``rtol``, ``atol``, ``stol``,
        ``maxiter``, ``backend``, ``line_search``, ...).
    """

    history = 1

    def __init__(self, residual: Callable, jacobian: Optional[Callable] = None, *,
                 linear_solver: Optional[dict] = None, comm=None, **newton):
        comm = get_comm(comm)
        err = None
        if not callable(residual):
            err = TypeError(f"residual must be callable, got {type(residual).__name__}")
        elif jacobian is not None and not callable(jacobian):
            err = TypeError(f"jacobian must be callable or None, got {type(jacobian).__name__}")
        elif linear_solver is not None and not isinstance(linear_solver, dict):
            err = TypeError(f"linear_solver must be a dict, got {type(linear_solver).__name__}")
        check_collective(comm, err, agree={"jacobian given": jacobian is not None,
                                           "newton": sorted((k, repr(v)) for k, v in newton.items())})
        self.comm = comm
        self.residual = user_code(comm, residual, "residual")
        self.jacobian = user_code(comm, jacobian, "jacobian")
        self.linear_solver = dict(linear_solver or {})
        self.newton = dict(newton)
        self.newton_iterations = 0
        self.linear_solves = 0
        self.transposed_solves = 0

    def inputs(self):
        """Local. No tensors besides ``u0`` and ``params``."""
        return ()

    def begin(self, dt: float) -> "NonlinearTimeProblem":
        """Local. A copy of this problem that integrates with step ``dt`` (its own counters)."""
        import copy
        st = copy.copy(self)
        st._dt = float(dt)
        st.newton_iterations = st.linear_solves = st.transposed_solves = 0
        return st

    def _step_solve(self, u_old, t, params, guess):
        from ..nonlinear import nonlinear_solve
        R, J = self.residual, self.jacobian
        jac = None if J is None else (lambda u, *p: J(u, u_old, t, *p))
        u, info = nonlinear_solve(lambda u, *p: R(u, u_old, t, *p), guess, *params, jacobian=jac,
                                  linear_solver=self.linear_solver, return_info=True, comm=self.comm,
                                  **self.newton)
        self.newton_iterations += info.iterations
        self.linear_solves += info.iterations
        return u

    def advance(self, state, n: int, t0: float, params) -> torch.Tensor:
        """Collective. ``u_{n+1}`` from ``state = (u_n,)`` (no autograd)."""
        t = t0 + (n + 1) * self._dt
        with torch.no_grad():
            return self._step_solve(state[0], t, params, state[0]).detach()

    def adjoint(self, state, u_new, n: int, t0: float, lam, params, want_inputs, want_params):
        """Collective. ``(dL/dstate, (), dL/dparams)`` of step ``n`` given ``lam = dL/du_{n+1}``."""
        t = t0 + (n + 1) * self._dt
        u_old = state[0].detach()
        with torch.enable_grad():
            h = u_old.clone().requires_grad_(True)
            ps = [p.detach().requires_grad_(True) if w else p for p, w in zip(params, want_params)]
            leaves = [h] + [p for p, w in zip(ps, want_params) if w]
            if self.jacobian is None:
                # nonlinear_solve differentiates in its params: u_old is passed as one
                R = self.residual
                from ..nonlinear import nonlinear_solve
                u = nonlinear_solve(lambda u, uo, *p: R(u, uo, t, *p), u_new.detach(), h, *ps,
                                    linear_solver=self.linear_solver, comm=self.comm, **self.newton)
                grads = torch.autograd.grad(u, leaves, lam, allow_unused=True)
                self.transposed_solves += 1
            else:
                mu = self._solve_transposed(u_new, u_old, t, params, lam)
                r = self.residual(u_new.detach(), h, t, *ps)
                grads = torch.autograd.grad(r, leaves, -mu, allow_unused=True)
        it = iter(grads[1:])
        d_params = [next(it) if w else None for w in want_params]
        return [grads[0]], [], d_params

    def _solve_transposed(self, u_new, u_old, t, params, g):
        from ..krylov.solve import solve
        ls = dict(self.linear_solver)
        tight = 1e-10 if g.dtype == torch.float64 else 1e-5
        ls["rtol"] = min(float(ls.get("rtol", tight)), tight)
        method = ls.pop("method", "gmres")
        with torch.no_grad():
            J = self.jacobian(u_new.detach(), u_old, t, *[p.detach() if isinstance(p, torch.Tensor) else p
                                                         for p in params]).detach()
        self.transposed_solves += 1
        # J^{-T} g is the adjoint of x = J^{-1} b at b = 0 (free: b == 0 returns x = 0 at once)
        with torch.enable_grad():
            b = torch.zeros_like(g).requires_grad_(True)
            x = solve(J, b, method, backend=self.newton.get("backend"), **ls)
            (mu,) = torch.autograd.grad(x, b, g)
        return mu
