"""Distributed, differentiable Krylov solvers: ``solve``, ``cg``, ``gmres``, ``minres``, ``bicgstab``,
``cgs``, ``tfqmr``.

Backends: ``"petsc"`` (KSP, the default when petsc4py imports) and ``"torch"``
(native, any device). See :func:`solve`.
"""
from .info import ConvergenceError, SolveInfo
from .solve import bicgstab, cg, cgs, default_backend, gmres, minres, solve, tfqmr

__all__ = ["solve", "cg", "gmres", "minres", "bicgstab", "cgs", "tfqmr", "SolveInfo", "ConvergenceError", "default_backend"]
