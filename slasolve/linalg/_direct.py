"""SciPy-signature ``spsolve`` on :func:`slasolve.spsolve` (MUMPS through PETSc, or SuperLU)."""
from __future__ import annotations

import warnings
from typing import Optional

import numpy as np
import scipy.sparse as sp
import torch
from mpi4py import MPI
from scipy.sparse import SparseEfficiencyWarning
from scipy.sparse.linalg import MatrixRankWarning

from .._comm import allreduce_int, check_collective
from ..dsparse import DSparseTensor
from ._system import digest, gather_rows, row_block, split_rows

__all__ = ["spsolve"]

#: right-hand-side columns solved per backend call for a sparse ``b`` (bounds the dense
#: workspace to ``n x SPARSE_RHS_CHUNK``; the result stays sparse)
SPARSE_RHS_CHUNK = 64


def _complex(what, dt) -> TypeError:
    return TypeError(f"spsolve: complex {what} (dtype {dt}) is not supported: slasolve's direct solvers "
                     "are real; solve the equivalent real system of twice the size")


def _is_singular(e) -> bool:
    return getattr(e, "code", None) in (-6, -10) or "singular" in str(e)


def spsolve(A, b, permc_spec=None, use_umfpack=True, *, comm: Optional[MPI.Comm] = None,
            backend: Optional[str] = None):
    """Collective. :func:`scipy.sparse.linalg.spsolve`: ``x`` with ``A x = b`` by a sparse
    direct factorisation (:func:`slasolve.spsolve`: MUMPS LU / LDL^T through PETSc, any
    number of ranks, or SuperLU on one rank).

    SciPy 1.10's signature and return types: ``b`` a vector (``(N,)`` or ``(N, 1)``)
    gives a 1-D ``x``; a dense ``(N, k)`` ``b`` a dense ``(N, k)`` ``x``; a sparse
    ``(N, k)`` ``b`` a sparse ``x`` of ``A``'s format (CSR or CSC). A singular ``A``
    gives ``MatrixRankWarning("Matrix is exactly singular")`` and ``x`` full of NaN, as
    SciPy; other factorisation failures raise :class:`slasolve.direct.FactorizationError`.
    ``permc_spec`` and ``use_umfpack`` are accepted and ignored (MUMPS/SuperLU choose
    their own ordering). ``comm`` / a DSparseTensor ``A`` as in :mod:`slasolve.linalg`
    (a DSparseTensor ``A`` takes this rank's rows of a dense ``b`` and returns this
    rank's rows of ``x``). Complex input raises ``TypeError``.
    """
    from ..direct import spsolve as _spsolve
    rows_mode = isinstance(A, DSparseTensor)
    if rows_mode:
        ccomm = A.comm
    else:
        ccomm = comm if isinstance(comm, MPI.Comm) else MPI.COMM_SELF
    replicated = not rows_mode and ccomm.Get_size() > 1
    err = None
    settings = {}
    try:
        if comm is not None and not isinstance(comm, MPI.Comm):
            raise TypeError(f"spsolve: comm must be an mpi4py communicator or None, got {type(comm).__name__}")
        if rows_mode:
            if A.dtype.is_complex:
                raise _complex("A", A.dtype)
            M, N = (int(s) for s in A.global_shape[:2])
            a_dtype = np.dtype("float32" if A.dtype == torch.float32 else "float64")
            n_rows = A.n_local
        else:
            if not (sp.isspmatrix_csc(A) or sp.isspmatrix_csr(A)):
                A = sp.csc_matrix(A)
                warnings.warn("spsolve requires A be CSC or CSR matrix format", SparseEfficiencyWarning,
                              stacklevel=2)
            if np.dtype(A.dtype).kind == "c":
                raise _complex("A", A.dtype)
            M, N = A.shape
            a_dtype = A.dtype
            n_rows = M
        if M != N:
            raise ValueError(f"matrix must be square (has shape {(M, N)})")
        b_sparse = sp.issparse(b)
        if not b_sparse:
            b = np.asarray(b)
        if np.dtype(b.dtype).kind == "c":
            raise _complex("b", b.dtype)
        if b.ndim not in (1, 2):
            raise ValueError(f"spsolve: b must be 1-D or 2-D, got shape {b.shape}")
        if n_rows != b.shape[0]:
            raise ValueError(f"matrix - rhs dimension mismatch ({(M, N)} - {b.shape[0]})"
                             + (" (b: this rank's rows)" if rows_mode else ""))
        b_vector = b.ndim == 1 or (b.ndim == 2 and b.shape[1] == 1)
        dt = np.promote_types(a_dtype, b.dtype)
        if dt.kind not in "f" or dt.itemsize < 4:
            dt = np.dtype("float64")   # SciPy's asfptype: integers and bools become float64
        if dt == np.float16:
            dt = np.dtype("float32")
        settings = {"n": M, "b shape": None if rows_mode else tuple(b.shape), "b sparse": b_sparse,
                    "dtype": str(dt), "backend": backend}
        if replicated:
            c = A.tocsr()
            settings["A digest"] = digest(c.indptr, c.indices, c.data)
            settings["b digest"] = digest(*(
                (b.tocsr().indptr, b.tocsr().indices, b.tocsr().data) if b_sparse else (b,)))
        elif rows_mode:
            settings["b columns"] = 1 if b.ndim == 1 else b.shape[1]
    except (TypeError, ValueError) as e:
        err = e
    check_collective(ccomm, err, agree=settings)

    # the operator
    if rows_mode:
        dA, r0, r1, counts = A, None, None, None
        dt = np.dtype("float32" if A.dtype == torch.float32 else "float64")  # b follows A's dtype
    elif replicated and M < ccomm.Get_size():
        # fewer rows than ranks: some rank would own none, which slasolve.spsolve cannot take
        # yet (see the issue note); the tiny system is solved on every rank alike
        replicated = False
        dA, r0, r1, counts = A.astype(dt), 0, M, [M]
    elif replicated:
        r0, r1, counts = split_rows(M, ccomm)
        dA = row_block(A.astype(dt), r0, r1, ccomm)
    else:
        dA, r0, r1, counts = A.astype(dt), 0, M, [M]
    tdt = torch.float32 if dt == np.float32 else torch.float64
    # every rank holds A here: decide LU / Cholesky from it (slasolve.spsolve's own test,
    # MatIsSymmetric on a distributed nonsymmetric Mat, crashed at 2 ranks: see the issue note)
    fact = None
    if not rows_mode:
        fact = "cholesky" if (A - A.T).count_nonzero() == 0 else "lu"
    # an all-zero matrix is singular (MUMPS refuses nnz = 0 with another error code)
    if rows_mode:
        zero = float(dA.values.detach().abs().max()) == 0.0 if dA.values.numel() else True
        zero = bool(allreduce_int(ccomm, int(zero), MPI.MIN))
    else:
        zero = A.count_nonzero() == 0


    def solve_dense(B: np.ndarray) -> np.ndarray:
        """Collective. Solve for the dense ``B`` (global rows, or this rank's rows)."""
        Bl = B if (rows_mode or not replicated) else B[r0:r1]
        bt = torch.as_tensor(np.ascontiguousarray(Bl, dtype=dt))
        from ..direct import FactorizationError
        if zero and M > 0:
            warnings.warn("Matrix is exactly singular", MatrixRankWarning, stacklevel=3)
            x = torch.full(bt.shape, float("nan"), dtype=tdt)
            xn = x.numpy()
            return gather_rows(xn, counts, ccomm) if replicated else xn
        try:
            with torch.no_grad():
                x = _spsolve(dA, bt, backend=backend, factorization=fact)
        except FactorizationError as e:
            if not _is_singular(e):
                raise
            warnings.warn("Matrix is exactly singular", MatrixRankWarning, stacklevel=3)
            x = torch.full(bt.shape, float("nan"), dtype=tdt)
        xn = x.detach().cpu().numpy()
        return gather_rows(xn, counts, ccomm) if replicated else xn

    if not b_sparse:
        if b_vector:
            return np.asarray(solve_dense(b.reshape(-1)), dtype=dt)
        return np.asarray(solve_dense(b), dtype=dt)
    if b_vector:
        return np.asarray(solve_dense(b.toarray().reshape(-1)), dtype=dt)
    # sparse matrix b: column chunks, sparse result of A's format (as SciPy)
    bc = b.tocsc()
    parts = []
    for j in range(0, bc.shape[1], SPARSE_RHS_CHUNK):
        X = solve_dense(bc[:, j:j + SPARSE_RHS_CHUNK].toarray())
        parts.append(sp.csc_matrix(X))
    X = sp.hstack(parts, format="csc") if parts else sp.csc_matrix(b.shape, dtype=dt)
    X.eliminate_zeros()
    fmt = "csr" if (not rows_mode and sp.isspmatrix_csr(A)) else "csc"
    return X.asformat(fmt).astype(dt)
