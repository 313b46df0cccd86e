"""Krylov solvers (cg, gmres, minres, bicgstab), preconditioners and SolveInfo.

The native torch kernels live in :mod:`slasolve.krylov.torch_methods`, the
local preconditioner builders in :mod:`slasolve.krylov.torch_pc` and the
result record in :mod:`slasolve.krylov.info`.
"""
