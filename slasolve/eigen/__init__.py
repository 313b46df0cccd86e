"""Symmetric eigensolvers (``slasolve.eigen``).

Kernels:

* :mod:`slasolve.eigen.torch_methods` -- native, operator-agnostic torch kernels
  (block LOBPCG and thick-restart Lanczos) that receive callables, so the same
  code runs on one rank and on many, on any device and dtype.
* :mod:`slasolve.eigen.info` -- :class:`EigenInfo` and :class:`EigenConvergenceError`.

The public ``eigsh`` front end (SLEPc and native backends) is wired here by the
package lead.
"""
