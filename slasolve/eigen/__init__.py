"""Symmetric eigensolvers (``slasolve.eigen``).

* :func:`eigsh` -- public, differentiable front end (standard and generalized
  symmetric problems; backends ``"slepc"`` and ``"torch"``), in
  :mod:`slasolve.eigen.eigsh`.
* :mod:`slasolve.eigen.slepc_backend` -- SLEPc EPS configuration (needs slepc4py).
* :mod:`slasolve.eigen.autograd` -- the adjoint (collective backward).
* :mod:`slasolve.eigen.torch_methods` -- native, operator-agnostic torch kernels
  (block LOBPCG and thick-restart Lanczos) that receive callables, so the same
  code runs on one rank and on many, on any device and dtype.
* :mod:`slasolve.eigen.info` -- :class:`EigenInfo` and :class:`EigenConvergenceError`.
"""
from .info import EigenConvergenceError, EigenInfo
from .eigsh import default_backend, eigsh

__all__ = ["eigsh", "EigenInfo", "EigenConvergenceError", "default_backend"]
