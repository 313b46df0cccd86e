"""SciPy-signature ``eigsh`` on :func:`slasolve.eigsh` (SLEPc or the native kernels)."""
from __future__ import annotations

import warnings
from typing import Optional

import numpy as np
import scipy.sparse as sp
import torch
from mpi4py import MPI
from scipy.linalg import eigh
from scipy.sparse.linalg import LinearOperator
from scipy.sparse.linalg._eigen.arpack.arpack import ArpackNoConvergence

from .._comm import check_collective
from ..dsparse import DSparseTensor
from ._system import digest, gather_rows, row_block, split_rows

__all__ = ["eigsh", "ArpackNoConvergence"]

_WHICH = ("LM", "SM", "LA", "SA", "BE")
#: slasolve's relative residual tolerance for SciPy's ``tol=0`` ("machine precision"), per
#: backend: tighter values make the native shift-invert's inner MINRES unattainable
TOL_ZERO = {"slepc": 1e-12, "torch": 1e-10}


def _complex(what, dt) -> TypeError:
    return TypeError(f"eigsh: complex (Hermitian) {what} (dtype {dt}) is not supported: slasolve's "
                     "eigensolvers are real symmetric")


def _dtype_of(X):
    if isinstance(X, DSparseTensor):
        return np.dtype("float32" if X.dtype == torch.float32 else
                        "complex128" if X.dtype.is_complex else "float64")
    return np.dtype(getattr(X, "dtype", None) or np.float64)


def _rayleigh_ritz(S, SM, w, V):
    """Local (every rank holds S, SM, V in full here). One Rayleigh-Ritz step on
    span[V, A V - M V diag(w)]: the Ritz pairs nearest ``w`` replace ``(w, V)``.
    SLEPc's generalized solves stop at residuals ~1e-11 where ARPACK reaches ~1e-14;
    this step recovers ARPACK's accuracy for 2k products with A and M."""
    from scipy.linalg import orth
    MV = V if SM is None else SM @ V
    R = S @ V - MV * w
    Q = orth(np.hstack([V, R]))
    Ap = Q.T @ (S @ Q)
    Bp = Q.T @ (Q if SM is None else SM @ Q)
    Ap, Bp = (Ap + Ap.T) / 2, (Bp + Bp.T) / 2
    try:
        theta, Y = eigh(Ap, Bp)
    except np.linalg.LinAlgError:
        return w, V
    pick, free = [], list(range(len(theta)))
    for wi in w:
        j = min(free, key=lambda t: abs(theta[t] - wi))
        free.remove(j)
        pick.append(j)
    w2, V2 = theta[pick], Q @ Y[:, pick]
    V2 = V2 * np.where(np.sum(V2 * V, axis=0) < 0, -1.0, 1.0)  # keep slasolve's sign convention
    r_old = np.linalg.norm(R, axis=0)
    r_new = np.linalg.norm(S @ V2 - (V2 if SM is None else SM @ V2) * w2, axis=0)
    if not np.all(r_new <= r_old * 1.0000001 + 1e-300) or np.any(np.abs(w2 - w) > 1e-6 * (1 + np.abs(w))):
        return w, V   # the step did not improve every pair: keep the solver's
    return w2, V2


def eigsh(A, k=6, M=None, sigma=None, which='LM', v0=None, ncv=None, maxiter=None, tol=0,
          return_eigenvectors=True, Minv=None, OPinv=None, mode='normal', *,
          comm: Optional[MPI.Comm] = None, backend: Optional[str] = None):
    """Collective. :func:`scipy.sparse.linalg.eigsh`: ``k`` eigenpairs of the real symmetric
    ``A x = w x`` or ``A x = w M x`` (``M`` SPD), on :func:`slasolve.eigsh`.

    SciPy 1.10's signature and return types: ``w`` (and ``v``, ``(N, k)``) as NumPy arrays
    of ``A``'s precision; ``which`` in ``LM, SM, LA, SA, BE`` (BE: ``k // 2`` from the low
    end and ``k - k // 2`` from the high end, as SciPy); ``sigma`` shift-invert with
    ``mode='normal'`` and ``which='LM'`` (the eigenvalues nearest ``sigma``); ``k >= N``
    falls back to :func:`scipy.linalg.eigh` for dense ``A`` with SciPy's RuntimeWarning
    and TypeErrors. ``tol=0`` (ARPACK's machine precision) means slasolve's relative residual
    tolerance :data:`TOL_ZERO` (1e-12 SLEPc, 1e-10 native), followed by one Rayleigh-Ritz
    step. Non-convergence raises SciPy's ``ArpackNoConvergence`` (partial results attached).
    Eigenvalues come back ascending (with ``return_eigenvectors=False`` in SciPy's
    documented orders). Not supported (ValueError/TypeError naming it):
    complex/Hermitian input, ``mode='buckling'``/``'cayley'``, ``Minv``, ``OPinv``,
    ``sigma`` with ``which != 'LM'``, a ``LinearOperator`` ``A`` or ``M`` (matrix-free
    eigsh). ``comm`` / a DSparseTensor ``A`` as in :mod:`slasolve.linalg`.
    """
    from ..eigen.eigsh import default_backend as _default_backend, eigsh as _eigsh
    rows_mode = isinstance(A, DSparseTensor)
    ccomm = A.comm if rows_mode else (comm if isinstance(comm, MPI.Comm) else MPI.COMM_SELF)
    replicated = not rows_mode and ccomm.Get_size() > 1
    err, dense_fallback, settings = None, False, {}
    try:
        if comm is not None and not isinstance(comm, MPI.Comm):
            raise TypeError(f"eigsh: comm must be an mpi4py communicator or None, got {type(comm).__name__}")
        a_dt = _dtype_of(A)
        if a_dt.kind == "c":
            raise _complex("A", a_dt)
        if M is not None and _dtype_of(M).kind == "c":
            raise _complex("M", _dtype_of(M))
        if which not in _WHICH:
            raise ValueError(f"which must be one of {' '.join(_WHICH)}")
        shape = tuple(A.global_shape[:2]) if rows_mode else tuple(A.shape)
        if len(shape) != 2 or shape[0] != shape[1]:
            raise ValueError(f"expected square matrix (shape={shape})")
        n = shape[0]
        if M is not None:
            mshape = tuple(M.global_shape[:2]) if isinstance(M, DSparseTensor) else tuple(M.shape)
            if mshape != shape:
                raise ValueError(f"wrong M dimensions {mshape}, should be {shape}")
        if not isinstance(k, (int, np.integer)) or k <= 0:
            raise ValueError("k must be greater than 0.")
        if k >= n and not rows_mode:
            warnings.warn("k >= N for N * N square matrix. Attempting to use scipy.linalg.eigh instead.",
                          RuntimeWarning, stacklevel=2)
            if sp.issparse(A):
                raise TypeError("Cannot use scipy.linalg.eigh for sparse A with k >= N. "
                                "Use scipy.linalg.eigh(A.toarray()) or reduce k.")
            if isinstance(A, LinearOperator):
                raise TypeError("Cannot use scipy.linalg.eigh for LinearOperator A with k >= N.")
            if isinstance(M, LinearOperator):
                raise TypeError("Cannot use scipy.linalg.eigh for LinearOperator M with k >= N.")
            dense_fallback = True
        else:
            if mode != "normal":
                raise ValueError(f"eigsh: mode={mode!r} is not supported by slasolve.linalg (shift-invert "
                                 "mode='normal' only)")
            if Minv is not None or OPinv is not None:
                raise ValueError("eigsh: Minv / OPinv are not supported by slasolve.linalg (slasolve "
                                 "factorises A - sigma M itself)")
            if sigma is not None and which != "LM":
                raise ValueError(f"eigsh: sigma with which={which!r} is not supported by slasolve.linalg "
                                 "(with sigma only which='LM': the eigenvalues nearest sigma)")
            for what, X in (("A", A), ("M", M)):
                if X is not None and not (rows_mode or sp.issparse(X) or isinstance(X, np.ndarray)):
                    raise TypeError(f"eigsh: {what} must be a sparse or dense matrix (a matrix-free "
                                    f"LinearOperator {what} is not supported by slasolve.linalg), "
                                    f"got {type(X).__name__}")
                if rows_mode and X is not None and not isinstance(X, DSparseTensor):
                    raise TypeError(f"eigsh: with a DSparseTensor A, {what} must be a DSparseTensor")
            if v0 is not None:
                v0 = np.asarray(v0)
                if v0.dtype.kind == "c":
                    raise _complex("v0", v0.dtype)
                nv = A.n_local if rows_mode else n
                if v0.shape != (nv,):
                    raise ValueError(f"eigsh: v0 must have shape ({nv},), got {v0.shape}")
        settings = {"k": int(k) if isinstance(k, (int, np.integer)) else repr(k), "which": which,
                    "sigma": sigma, "ncv": ncv, "maxiter": maxiter, "tol": float(tol), "mode": mode,
                    "M given": M is not None, "v0 given": v0 is not None, "backend": backend,
                    "return_eigenvectors": bool(return_eigenvectors)}
        if replicated and not dense_fallback:
            for what, X in (("A", A), ("M", M)):
                if X is not None:
                    c = sp.csr_matrix(X)
                    settings[f"{what} digest"] = digest(c.indptr, c.indices, c.data)
            settings["v0 digest"] = digest(v0)
    except (TypeError, ValueError) as e:
        err = e
    check_collective(ccomm, err, agree=settings)
    if dense_fallback:
        return eigh(A, b=M, eigvals_only=not return_eigenvectors)

    # computed in float64 (as the PETSc/SLEPc backends do anyway), returned in A's precision
    out_dt = np.dtype("float32") if a_dt == np.float32 else np.dtype("float64")
    dt = np.dtype("float64") if not rows_mode else out_dt
    counts = None
    if rows_mode:
        dA, dM = A, M
        v0_t = None if v0 is None else torch.as_tensor(np.array(v0, dtype=dt))
    else:
        S = sp.csr_matrix(A, dtype=dt)
        SM = None if M is None else sp.csr_matrix(M, dtype=dt)
        if replicated:
            r0, r1, counts = split_rows(n, ccomm)
            dA = row_block(S, r0, r1, ccomm)
            dM = None if SM is None else row_block(SM, r0, r1, ccomm)
        else:
            r0, r1 = 0, n
            dA, dM = S, SM
        v0_t = None if v0 is None else torch.as_tensor(np.array(v0[r0:r1], dtype=dt))
    V_rows = (A.n_local if rows_mode else n)
    kw = dict(M=dM, sigma=None if sigma is None else float(sigma), v0=v0_t,
              tol=float(tol) if tol and tol > 0 else TOL_ZERO[backend or _default_backend()],
              maxiter=maxiter, ncv=ncv, backend=backend,
              return_info=True, raise_on_fail=False)

    def run(kk, wh):
        from ..eigen.info import EigenConvergenceError
        try:
            with torch.no_grad():
                w, V, info = _eigsh(dA, kk, which=wh, **kw)
        except EigenConvergenceError as e:  # raised on every rank: SciPy's exception type
            raise ArpackNoConvergence(f"ARPACK error -1: No convergence ({e})", np.zeros(0, out_dt),
                                      np.zeros((V_rows, 0), out_dt)) from e
        return w.detach().cpu().numpy(), V.detach().cpu().numpy(), info

    if which == "BE":
        lo, hi = k // 2, k - k // 2
        parts = [run(hi, "LA")] + ([run(lo, "SA")] if lo > 0 else [])
        w = np.concatenate([p[0] for p in parts])
        V = np.concatenate([p[1] for p in parts], axis=1)
        nconv = sum(min(int(p[2].converged), len(p[0])) for p in parts)
        ok = all(int(p[2].converged) >= len(p[0]) and p[2].verified is not False for p in parts)
    else:
        w, V, info = run(int(k), which)
        nconv = min(int(info.converged), len(w))
        ok = nconv >= k and info.verified is not False
    if replicated:
        V = gather_rows(V, counts, ccomm)
    order = np.argsort(w, kind="stable")
    w, V = w[order], V[:, order]
    if not rows_mode and ok and len(w):
        w, V = _rayleigh_ritz(S, SM, w, V)
    w, V = w.astype(out_dt), V.astype(out_dt)
    if not ok:
        raise ArpackNoConvergence(f"ARPACK error -1: No convergence ({nconv}/{k} eigenpairs converged; "
                                  "slasolve.eigsh)", w[:nconv] if len(w) > nconv else w,
                                  V[:, :nconv] if len(w) > nconv else V)
    if return_eigenvectors:
        return w, V
    if which in ("LM", "SA"):
        return w[np.argsort(np.abs(w), kind="stable")]
    if which == "SM":
        return w[np.argsort(-np.abs(w), kind="stable")]
    return w
