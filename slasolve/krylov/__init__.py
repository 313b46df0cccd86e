"""Distributed, differentiable Krylov solvers: ``solve``, ``cg``, ``gmres``, ``minres``, ``bicgstab``.

Backends: ``"petsc"`` (KSP, the default when petsc4py imports) and ``"torch"``
(native, any device). See :func:`solve`.
"""
from .info import ConvergenceError, SolveInfo
from .solve import bicgstab, cg, default_backend, gmres, minres, solve

__all__ = ["solve", "cg", "gmres", "minres", "bicgstab", "SolveInfo", "ConvergenceError", "default_backend"]
