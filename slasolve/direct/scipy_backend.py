"""SciPy SuperLU (``scipy.sparse.linalg.splu``) for :mod:`slasolve.direct`: one rank,
no petsc4py needed.

SuperLU has no separate numeric refactorisation: new values mean a new ``splu``
(analysis included). Transposed solves reuse the factors (``trans="T"``); a
``(n, k)`` right-hand side is one ``SuperLU.solve`` call. ``factorization="cholesky"``
is served by LU (SciPy has no sparse Cholesky); :attr:`FactorizationInfo.factorization`
says ``"lu"``.
"""
from __future__ import annotations

import time
import warnings

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch

from ._common import changed_anywhere
from .info import FactorizationError, FactorizationInfo, failed_info

__all__ = ["SuperLUFactor", "PIVOT_TOL"]

#: a pivot ``|u_ii| <= PIVOT_TOL * n * ||A||_inf`` means "numerically singular"
PIVOT_TOL = 2.220446049250313e-16


class SuperLUFactor:
    """Local (one rank). SuperLU factors of one operator's values."""

    backend = "scipy"

    def __init__(self, dA, factorization: str = "auto", petsc_options=None):
        if dA.comm.Get_size() != 1:
            raise ValueError("the scipy (SuperLU) direct solver runs on one rank only")
        self.comm = dA.comm
        self.lu = None
        self.snapshot = None
        self.kind = "lu"
        L = dA._layout
        self.info = FactorizationInfo(backend="scipy", solver="superlu", factorization="lu",
                                      n=int(dA.global_shape[0] * L.br),
                                      nnz=int(dA.values.shape[0]) * L.br * L.bc)

    def ensure(self, dA) -> bool:
        """Local. Refactorise when the values differ from the last factorised ones."""
        vals = dA.values.detach()
        if self.lu is not None and not changed_anywhere(self.comm, self.snapshot, vals):
            return False
        self.lu, self.snapshot = None, None
        if not bool(torch.isfinite(vals).all()):
            raise ValueError("A has NaN or infinite values: cannot factorise")
        C = dA.local.detach().to(torch.float64).to_scipy("csr")
        C = sp.csc_matrix(C)
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", sp.SparseEfficiencyWarning)
                lu = spla.splu(C)
        except RuntimeError as e:  # "Factor is exactly singular"
            raise FactorizationError(failed_info("scipy", "lu"),
                                     f"direct solve: SuperLU factorisation failed: {e} "
                                     "(A is singular)") from None
        dt = time.perf_counter() - t0
        # SuperLU raises only on an exactly zero pivot; a rounding-level one (a numerically
        # singular matrix) would give a huge "solution" with a tiny residual
        piv = np.abs(lu.U.diagonal())
        anorm = float(abs(C).sum(axis=1).max()) if C.nnz else 0.0
        tol = PIVOT_TOL * max(C.shape[0], 1) * anorm
        nulls = int((piv <= tol).sum())
        if nulls:
            raise FactorizationError(failed_info("scipy", "lu"),
                                     f"direct solve: SuperLU: matrix is numerically singular ({nulls} "
                                     f"pivot(s) below n * eps * ||A||_inf = {tol:.2e})")
        self.lu, self.snapshot = lu, vals.clone()
        info = self.info
        info.symbolic_factorizations += 1
        info.numeric_factorizations += 1
        info.factor_time += dt
        info.factor_nnz = int(lu.L.nnz + lu.U.nnz)
        info.fill = info.factor_nnz / max(info.nnz, 1)
        return True

    def solve(self, b: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        """Local. ``A^{-1} b`` (``A^{-T} b``), ``b`` ``(n,)`` or ``(n, k)``: one SuperLU call."""
        t0 = time.perf_counter()
        arr = np.ascontiguousarray(b.detach().to(dtype=torch.float64, device="cpu").numpy())
        x = torch.from_numpy(np.array(self.lu.solve(arr, trans="T" if transpose else "N"), copy=True))
        if transpose:
            self.info.transpose_solves += 1
        else:
            self.info.solves += 1
        self.info.solve_time += time.perf_counter() - t0
        return x
