"""Time stepping with checkpointed adjoints.

* :mod:`slasolve.timestepping.schemes` -- backward Euler, Crank-Nicolson, theta-methods, BDF2
  (:func:`scheme`).
* :mod:`slasolve.timestepping.linear` -- :class:`LinearTimeProblem`, ``M du/dt + K u = f(t)``
  with the step matrix formed and factorised (or its Krylov preconditioner set up) once.
* :mod:`slasolve.timestepping.nonlinear` -- :class:`NonlinearTimeProblem`, user step residuals
  ``residual(u_new, u_old, t, *params)`` solved by :func:`slasolve.nonlinear_solve`.
* :mod:`slasolve.timestepping.checkpointing` -- binomial / Revolve / multistage schedules
  (the ``checkpoint_schedules`` package) and the optimal recomputation count.
* :mod:`slasolve.timestepping.trajectory` -- :func:`integrate` (collective, differentiable,
  bounded memory) and :class:`TrajectoryInfo`.
"""
from .schemes import Scheme, scheme
from .linear import LinearTimeProblem
from .nonlinear import NonlinearTimeProblem
from .checkpointing import optimal_recomputations
from .trajectory import TrajectoryInfo, integrate

__all__ = ["integrate", "TrajectoryInfo", "LinearTimeProblem", "NonlinearTimeProblem", "Scheme", "scheme",
           "optimal_recomputations"]
