"""SciPy SuperLU (``scipy.sparse.linalg.splu``) for :mod:`slasolve.direct`: one rank,
no petsc4py needed.

The matrix is equilibrated first (Ruiz: rows and columns scaled to largest entry 1), so
the test for numerically singular matrices (a pivot below ``n eps`` of the scaled
matrix) does not mistake a badly scaled matrix for a singular one. SuperLU has no
separate numeric refactorisation: new values mean a new ``splu``
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

#: a pivot ``|u_ii| <= PIVOT_TOL * n * ||B||_inf`` of the equilibrated matrix ``B`` means
#: "numerically singular"
PIVOT_TOL = 2.220446049250313e-16


def _inv_sqrt(m: np.ndarray) -> np.ndarray:
    """1 / sqrt(m), with 1 where m is 0 (an empty row / column: SuperLU reports it singular)."""
    out = np.ones_like(m)
    nz = m > 0
    out[nz] = 1.0 / np.sqrt(m[nz])
    return out


def _ruiz(C, iterations: int = 30, tol: float = 1e-3):
    """``(r, c, B)``: Ruiz equilibration ``B = diag(r) C diag(c)``, every nonempty row and
    column of ``B`` with largest magnitude within ``tol`` of 1 (a few O(nnz) sweeps;
    one-pass row-then-column scaling fails on e.g. ``A diag(10^-2k)``)."""
    B = sp.csr_matrix(C, copy=True)
    n, m = B.shape
    r, c = np.ones(n), np.ones(m)
    for _ in range(iterations):
        absB = abs(B)
        rm = absB.max(axis=1).toarray().ravel()
        cm = absB.max(axis=0).toarray().ravel()
        if np.all(np.abs(rm[rm > 0] - 1) <= tol) and np.all(np.abs(cm[cm > 0] - 1) <= tol):
            break
        dr, dc = _inv_sqrt(rm), _inv_sqrt(cm)
        r, c = r * dr, c * dc
        B = sp.csr_matrix(sp.diags(dr) @ B @ sp.diags(dc))
    return r, c, B


class SuperLUFactor:
    """Local (one rank). SuperLU factors of one operator's values."""

    backend = "scipy"

    def __init__(self, dA, factorization: str = "auto", petsc_options=None):
        if dA.comm.Get_size() != 1:
            raise ValueError("the scipy (SuperLU) direct solver runs on one rank only")
        self.comm = dA.comm
        self.requested = factorization
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
        C = sp.csr_matrix(dA.local.detach().to(torch.float64).to_scipy("csr"))
        if self.requested == "cholesky":  # served by LU, but the request must make sense
            sym = (C != C.T).nnz == 0
            self.info.symmetric = bool(sym)
            if not sym:
                raise ValueError("factorization='cholesky' needs an exactly symmetric matrix; A is not "
                                 "symmetric (use factorization='lu' or None)")
        t0 = time.perf_counter()
        # equilibrate (B = D_r A D_c, rows then columns of largest magnitude 1) so that the
        # pivot test below is scale-free: diag(1, 1e-20) is not "singular"
        r, c, C = _ruiz(C)
        C = sp.csc_matrix(C)
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
        self.lu, self.snapshot, self.scale = lu, vals.clone(), (r, c)
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
        arr = b.detach().to(dtype=torch.float64, device="cpu").numpy()
        r, c = self.scale
        if arr.ndim == 2:
            r, c = r[:, None], c[:, None]
        # A = D_r^-1 B D_c^-1:  A x = b -> x = D_c B^-1 D_r b;  A^T x = b -> x = D_r B^-T D_c b
        if transpose:
            x = r * self.lu.solve(np.ascontiguousarray(c * arr), trans="T")
        else:
            x = c * self.lu.solve(np.ascontiguousarray(r * arr), trans="N")
        x = torch.from_numpy(np.ascontiguousarray(x))
        self.info.count_solve(transpose, time.perf_counter() - t0)
        return x
