"""MUMPS LU / Cholesky (LDL^T) through PETSc, for :mod:`slasolve.direct`.

One :class:`PetscFactor` owns a private AIJ Mat (block tensors: AIJ with the block
size set; MUMPS' Cholesky does not take BAIJ) and a PCLU / PCCHOLESKY with
``MATSOLVERMUMPS``. When the values change it refills the Mat in place (same
nonzero pattern) and calls ``PCSetUp`` again: PETSc sees ``SAME_NONZERO_PATTERN``
and redoes only the numeric factorisation (MUMPS keeps its analysis; the PETSc log
events ``MatLUFactorSym`` / ``MatCholFctrSym`` do not move). A failed
factorisation drops the PC, so the next attempt starts from a fresh analysis.
Multi-RHS solves are one ``MatMatSolve`` with a dense Mat; transposed solves reuse
the factors (``MatSolveTranspose``; for several columns MUMPS' ICNTL(9)=0 around
``MatMatSolve``).
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch
from mpi4py import MPI

from ..symmetry import exactly_symmetric
from ..petsc import PETSc, create_petsc_mat, fill_petsc_mat, garbage_cleanup, temporary_options
from ._common import changed_anywhere, raise_factor_error_collective
from .info import MUMPS_ERRORS, FactorizationError, FactorizationInfo, failed_info

__all__ = ["PetscFactor", "OPTIONS_PREFIX", "shifted_inertia"]

#: options prefix of the direct solver's PC (``-direct_mat_mumps_icntl_14 100``)
OPTIONS_PREFIX = "direct_"


def _global_scalar_nnz(dA) -> int:
    L = dA._layout
    local = int(dA.values.shape[0]) * L.br * L.bc
    comm = dA.comm
    from .._comm import allreduce_int
    return allreduce_int(comm, local)



def _exactly_symmetric(mat, dA=None) -> bool:
    """Collective. ``A == A^T`` exactly (pattern and values): with ``dA``
    :func:`slasolve.symmetry.exactly_symmetric` (mirror permutation and multiset hash);
    without it PETSc's explicit transpose (``||A^T - A||_max == 0``; PETSc 3.18's
    ``MatIsSymmetric`` on MPIAIJ segfaulted on a structurally nonsymmetric 3x3 matrix
    at 2 ranks), which costs ~7-15% of a MUMPS Cholesky forward."""
    if dA is not None:
        return exactly_symmetric(dA)
    At = PETSc.Mat()
    mat.transpose(At)       # into a new Mat: never the cached operator in place
    try:
        At.axpy(-1.0, mat, structure=PETSc.Mat.Structure.DIFFERENT_NONZERO_PATTERN)
        return At.norm(PETSc.NormType.INFINITY) == 0.0
    finally:
        At.destroy()


class PetscFactor:
    """Collective (every method). MUMPS factors of one row-sharded operator's values."""

    backend = "petsc"

    def __init__(self, dA, factorization: str = "auto", petsc_options: Optional[dict] = None):
        self.comm = dA.comm
        self.requested = factorization
        self.petsc_options = dict(petsc_options or {})
        self.mat = None
        self.pc = None
        self.kind: Optional[str] = None
        self.snapshot: Optional[torch.Tensor] = None
        self._vecs = None   # (b, x) Vecs of one column, made once: placeArray per solve (no layout set-up)
        L = dA._layout
        n = dA.global_shape[0] * L.br
        self.n_local = dA.n_local
        self.info = FactorizationInfo(backend="petsc", solver="mumps", n=int(n), nnz=_global_scalar_nnz(dA))

    # -- factorisation --------------------------------------------------------------
    def ensure(self, dA) -> bool:
        """Collective. Make the factors those of ``dA``'s current values (refactor when
        they differ from the values last factorised on any rank). True when it refactored."""
        vals = dA.values.detach()
        if self.pc is not None and not changed_anywhere(self.comm, self.snapshot, vals):
            return False
        err = None
        if not bool(torch.isfinite(vals).all()):
            err = ValueError("A has NaN or infinite values: cannot factorise")
        raise_factor_error_collective(self.comm, err)
        if self.mat is None:
            self.mat = create_petsc_mat(dA, "aij")
        else:
            fill_petsc_mat(self.mat, dA)
        self.snapshot = None  # set only once the factorisation succeeded
        kind, sym = self._choose_kind(dA)
        self.info.symmetric = sym
        if self.pc is not None and kind != self.kind:
            self._drop_pc()
        t0 = time.perf_counter()
        fresh = self.pc is None
        err = None
        try:
            if fresh:
                garbage_cleanup(self.comm)
                self.pc = self._make_pc(kind)
                with temporary_options(self.petsc_options, OPTIONS_PREFIX):
                    self.pc.setFromOptions()
                    self._force_type(kind)
                    self.pc.setFactorSetUpSolverType()
                    # null-pivot detection: a numerically singular matrix (rounding-level
                    # pivot, e.g. a Laplacian's constant null space) is reported in
                    # INFOG(28) instead of giving a huge "solution" with a tiny residual
                    F = self.pc.getFactorMatrix()
                    if not self._user_set("mat_mumps_icntl_24"):
                        F.setMumpsIcntl(24, 1)
                    self.pc.setUp()
            else:
                self.pc.setUp()  # same Mat, same pattern: PETSc refactors numerically only
        except PETSc.Error as e:
            err = FactorizationError(failed_info("petsc", kind),
                                     f"MUMPS {kind} factorisation failed in PETSc: error code {e.ierr}")
        code = None
        if err is None:
            F = self.pc.getFactorMatrix()
            code = int(F.getMumpsInfog(1))  # INFOG: global, the same on every rank
            if code < 0:
                what = MUMPS_ERRORS.get(code, "MUMPS error")
                detail = int(F.getMumpsInfog(2))
                err = FactorizationError(failed_info("petsc", kind),
                                         f"direct solve: MUMPS {kind} factorisation failed: {what} "
                                         f"(INFOG(1) = {code}, INFOG(2) = {detail})", code)
            elif int(F.getMumpsIcntl(24)) == 1 and int(F.getMumpsInfog(28)) > 0:
                nulls = int(F.getMumpsInfog(28))
                err = FactorizationError(failed_info("petsc", kind),
                                         f"direct solve: MUMPS {kind} factorisation: matrix is numerically "
                                         f"singular ({nulls} null pivot(s) detected, INFOG(28) = {nulls})", -10)
        if err is not None:
            self._drop_pc()
        raise_factor_error_collective(self.comm, err, "petsc", kind)
        dt = time.perf_counter() - t0
        self.kind = kind
        self.snapshot = vals.clone()
        info = self.info
        info.factorization = kind
        if fresh:
            info.symbolic_factorizations += 1
            info.analysis_time += dt
        else:
            info.factor_time += dt
        info.numeric_factorizations += 1
        F = self.pc.getFactorMatrix()
        fnnz = int(F.getMumpsInfog(29))
        info.factor_nnz = fnnz if fnnz >= 0 else -fnnz * 10 ** 6  # negative: millions
        info.fill = info.factor_nnz / max(info.nnz, 1)
        info.memory_mb = float(F.getMumpsInfog(22))
        return True

    def _choose_kind(self, dA=None):
        if self.requested == "lu":
            return "lu", None
        sym = _exactly_symmetric(self.mat, dA)  # exact: Cholesky reads one triangle only
        if self.requested == "cholesky" and not sym:
            # the same answer on every rank (isSymmetric is collective)
            raise ValueError("factorization='cholesky' needs an exactly symmetric matrix; A is not "
                             "symmetric (use factorization='lu' or None)")
        return ("cholesky" if sym else "lu"), sym

    def _user_set(self, name: str) -> bool:
        from ..petsc import option_entries
        return name in option_entries(self.petsc_options) or \
            PETSc.Options(OPTIONS_PREFIX).hasName(name)

    def _make_pc(self, kind):
        pc = PETSc.PC().create(comm=self.comm)
        pc.setOptionsPrefix(OPTIONS_PREFIX)
        pc.setOperators(self.mat)
        return pc

    def _force_type(self, kind):
        self.pc.setType(kind)
        self.pc.setFactorSolverType("mumps")

    def _drop_pc(self):
        if self.pc is not None:
            self.pc.destroy()
        self.pc, self.kind = None, None

    def close(self) -> None:
        """Collective. Destroy the PC (factors) and the private Mat now."""
        self._drop_pc()
        if self._vecs is not None:
            for v in self._vecs:
                v.destroy()
            self._vecs = None
        if self.mat is not None:
            self.mat.destroy()
            self.mat = None

    # -- solves -------------------------------------------------------------------
    def solve(self, b: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        """Collective. ``A^{-1} b`` (``A^{-T} b``) for ``b`` ``(n_local,)`` or
        ``(n_local, k)`` float64; the ``k`` columns go to MUMPS in one call."""
        F = self.pc.getFactorMatrix()
        t0 = time.perf_counter()
        b = b.detach().to(dtype=torch.float64, device="cpu")
        m, N = self.n_local, self.info.n
        if b.dim() == 1:
            arr = b.contiguous().numpy()
            if self._vecs is None:
                bv = PETSc.Vec().createMPI((m, N), comm=self.comm)
                self._vecs = (bv, bv.duplicate())
            bv, xv = self._vecs
            bv.placeArray(arr)
            try:
                (F.solveTranspose if transpose else F.solve)(bv, xv)
            finally:
                bv.resetArray()
            x = torch.from_numpy(np.array(xv.getArray(readonly=True), copy=True))
        else:
            k = int(b.shape[1])
            arr = np.asfortranarray(b.numpy())
            B = PETSc.Mat().createDense(((m, N), (None, k)), array=arr, comm=self.comm)
            B.assemble()
            X = PETSc.Mat().createDense(((m, N), (None, k)), comm=self.comm)
            X.setUp()
            X.assemble()
            if transpose and self.kind != "cholesky":
                F.setMumpsIcntl(9, 0)  # MUMPS solves A^T X = B with the same factors
                try:
                    F.matSolve(B, X)
                finally:
                    F.setMumpsIcntl(9, 1)
            else:
                F.matSolve(B, X)
            x = torch.from_numpy(np.array(X.getDenseArray(), copy=True).reshape(m, k))
            B.destroy()
            X.destroy()
        self.info.count_solve(transpose, time.perf_counter() - t0)
        return x


def shifted_inertia(dA, shift: float) -> Optional[tuple]:
    """Collective. The inertia ``(negative, zero, positive)`` of ``A - shift I`` from a MUMPS
    LDL^T factorisation (Sylvester: ``negative`` eigenvalues of ``A`` lie below ``shift``),
    or None when it cannot be had: ``A`` not exactly symmetric, a main-diagonal entry not
    stored, the factorisation failing or numerically singular (a null pivot: ``shift`` within
    rounding of an eigenvalue). The same answer on every rank.

    The computed inertia is the exact inertia of ``A - shift I + E`` with ``||E||`` of the
    order of ``eps ||A||`` (LDL^T with threshold pivoting is backward stable), so it counts
    correctly every eigenvalue farther than that from ``shift``."""
    from .._comm import allreduce_int
    L = dA._layout
    rows, pos = L._diagonal_entries()
    vals = dA.values.detach().to(torch.float64).clone()
    n_local = L.rend - L.rstart
    if allreduce_int(dA.comm, int(rows.numel() != n_local), MPI.MAX):
        return None
    if L.block:
        d = torch.arange(L.br, device=vals.device)
        sub = vals[pos]
        sub[:, d, d] -= shift
        vals[pos] = sub
    else:
        vals[pos] -= shift
    dS = dA.with_values(vals)
    # AMF ordering: its analysis took 0.1 s against PORD's 0.7 s (MUMPS' automatic choice here
    # without METIS) on the 2-D Poisson matrix, and no solve follows; ICNTL(13) = 1: global inertia
    options = {"mat_mumps_icntl_7": 2}
    if dA.comm.Get_size() > 1:
        options["mat_mumps_icntl_13"] = 1
    factor = PetscFactor(dS, "auto", petsc_options=options)
    try:
        try:
            factor.ensure(dS)
        except FactorizationError:
            return None
        if factor.kind != "cholesky":
            return None
        nneg, nzero, npos = factor.pc.getFactorMatrix().getInertia()
        return int(nneg), int(nzero), int(npos)
    finally:
        factor.close()
