"""Native torch backend: the kernels of ``torch_methods`` over a DSparseTensor.

Runs on any device and dtype, with collectives through mpi4py, and needs no
petsc4py on one rank. Preconditioners act on the rank's diagonal block (block
Jacobi across ranks): ``none``, ``jacobi``, ``bjacobi``/``ilu`` (ILU(0)),
``icc`` (IC(0)) or a user callable. Built once per values and cached.
"""
from __future__ import annotations

import time


import torch

from .. import _log
from .._comm import check_collective
from ..registry import krylov_method, preconditioner
from . import torch_methods, torch_operator, torch_pc
from .base import KrylovSolver

__all__ = ["TorchKrylov", "torch_kernel"]


def torch_kernel(method: str):
    """Local. The kernel of :mod:`slasolve.krylov.torch_methods` for the registered ``method``;
    ``ValueError`` when it runs on the petsc backend only."""
    m = krylov_method(method)
    if m.torch_kernel is None:
        raise ValueError(f"method {method!r} is not available in the torch backend (use backend='petsc')")
    return getattr(torch_methods, m.torch_kernel)


def _jacobi(d: torch.Tensor, have: torch.Tensor):
    """Point Jacobi from the owned diagonal (what ``torch_pc.jacobi`` builds from the diagonal
    block's CSR, without a copy of the block)."""
    bad = ~have | (d == 0)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise ValueError(f"jacobi: diagonal entry of local row {i} is {'missing' if not bool(have[i]) else 'zero'}")
    return torch_pc._apply_diag(1.0 / d)


def _build_pc(dA, pc, transpose: bool, diag=None):
    if pc is None or pc == "none":
        return None
    if callable(pc):
        return torch_pc.from_callable(pc)
    if pc == "jacobi":  # the diagonal is the transpose's too
        return _jacobi(*(diag if diag is not None else dA._layout.diagonal(dA.values.detach(), present=True)))
    D = dA.diag.scalar()
    if transpose:
        D = D.T
    ip, ix, v, n = D.indptr, D.indices, D.values.detach(), D.M
    if pc == "jacobi":
        return torch_pc.jacobi(ip, ix, v, n)
    if pc in ("bjacobi", "ilu"):
        return torch_pc.block_jacobi_ilu(ip, ix, v, n, kind="ilu0")
    if pc == "icc":
        return torch_pc.block_jacobi_ilu(ip, ix, v, n, kind="ic0")
    preconditioner(pc, "torch")   # raises, naming the torch backend's preconditioners
    raise AssertionError(f"pc {pc!r} is registered for the torch backend but not built here")


class TorchKrylov(KrylovSolver):
    """Collective (constructor). Native Krylov solves for one operator and method.

    The preconditioner is rebuilt whenever the matrix values differ from the values it
    was built from (compared with ``torch.equal`` against a private copy, so writes
    that do not bump the tensor's version, ``.data`` or NumPy views, are seen too).
    """

    backend = "torch"

    def __init__(self, dA, method: str, pc, *, restart: int = 30, **_ignored):
        super().__init__()
        self._kernel = torch_kernel(method)
        self.symmetric = krylov_method(method).symmetric
        if not callable(pc):
            preconditioner(pc, "torch")
        self.method = method
        self.comm = dA.comm
        self._pc_spec = pc
        self._restart = int(restart)
        self._pcs = {}
        self._snapshot = None
        self.norm = "unpreconditioned"
        self.setup_time = 0.0

    def set_callable(self, fn) -> None:
        """Local. Use ``fn`` as the preconditioner from now on."""
        if fn is not self._pc_spec:
            self._pc_spec = fn
            self._pcs.clear()

    def _pc(self, dA, transpose: bool, reuse: bool = False):
        """Collective. The preconditioner for ``dA``'s current values (one check_collective);
        with ``reuse`` the one built for earlier values, if any."""
        spec = self._pc_spec
        diag = None
        if reuse and self._pcs:
            pass
        elif spec is None or spec == "none" or callable(spec):
            pass  # nothing built from the values
        else:
            # the snapshot holds what the preconditioner is built from: the diagonal for
            # Jacobi (n values, not a copy of the matrix), else the values
            if spec == "jacobi":
                diag = dA._layout.diagonal(dA.values.detach(), present=True)
                vals = diag[0]
            else:
                vals = dA.values.detach()
            snap = self._snapshot
            if snap is None or snap.shape != vals.shape or snap.dtype != vals.dtype or \
                    snap.device != vals.device or not torch.equal(snap, vals):
                self._pcs.clear()
                self._snapshot = vals.clone()
        key = transpose and not self.symmetric
        err = None
        if key not in self._pcs:
            t0 = time.perf_counter()
            try:
                self._pcs[key] = _build_pc(dA, spec, key, diag)
            except (ValueError, TypeError) as e:
                err = e
                self._snapshot = None
            self.setup_time = time.perf_counter() - t0
        # the rebuild decision is per rank (each rank's own rows), so the check is unconditional
        check_collective(self.comm, err)
        return self._pcs[key]

    def _run(self, dA, b, x0, transpose, *, rtol, atol, maxiter, callback, record_history, reuse_pc=False):
        comm = self.comm
        op = (dA.rmatvec if transpose and not self.symmetric
              else torch_operator.krylov_matvec(dA, b))
        t0 = time.perf_counter()
        with _log.phase("setup", _log.event("slaPCSetUp")):
            M = self._pc(dA, transpose, reuse_pc)
        t1 = time.perf_counter()
        kw = dict(x0=x0, rtol=rtol, atol=atol, maxiter=maxiter, M=M,
                  reduce_sum=torch_operator.krylov_reducer(comm), callback=callback,
                  record_history=record_history)
        if krylov_method(self.method).restart:
            kw["restart"] = self._restart
        with torch.no_grad(), _log.phase("solve"):
            x, info = self._kernel(op, b.detach(), **kw)
        info.setup_time, info.solve_time = t1 - t0, time.perf_counter() - t1
        info.backend = "torch"
        spec = self._pc_spec
        info.pc = "callable" if callable(spec) else ("none" if spec is None else spec)
        return x, info

    def solve(self, dA, b, x0=None, **kw):
        """Collective. Solve ``A x = b`` for one right-hand side (``dA`` shares the layout)."""
        return self._run(dA, b, x0, False, **kw)

    def solve_transpose(self, dA, b, x0=None, **kw):
        """Collective. Solve ``A^T x = b`` (``A^T`` products by reverse halo exchange)."""
        return self._run(dA, b, x0, True, **kw)

    def destroy(self) -> None:
        """Local. Drop the preconditioners."""
        self._pcs.clear()
