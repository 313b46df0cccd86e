"""Distributed Newton-Krylov: :func:`nonlinear_solve` (PETSc SNES or native torch), differentiable
by the implicit function theorem."""
from .info import NonlinearConvergenceError, NonlinearInfo
from .solve import nonlinear_solve

__all__ = ["nonlinear_solve", "NonlinearInfo", "NonlinearConvergenceError"]
