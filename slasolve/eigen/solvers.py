"""The eigensolver backends behind :func:`slasolve.eigsh`: one solver object per call
(``solve(nev, v0, deflate)``), reused by the verification rounds."""
from __future__ import annotations

import time

import torch

from .._comm import check_collective
from ..dsparse import DSparseTensor
from .info import EigenConvergenceError
from .torch_methods import lanczos, lobpcg, start_vectors
from .verify import want_key

try:
    from . import slepc_backend
except ImportError:  # pragma: no cover
    slepc_backend = None

__all__ = ["SlepcSolver", "TorchSolver"]


def _abs_diag_pc(d):
    d = d.reshape(-1).abs()
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.ones_like(d))

    def apply(r):
        return r * (inv if r.dim() == 1 else inv[:, None])
    return apply


def _build_pc(dK, pc, comm):
    """Local preconditioner on the diagonal block of dK; collective error check."""
    from ..krylov import torch_pc
    err = None
    T = None
    try:
        if pc is None or pc == "none":
            T = None
        elif callable(pc):
            T = torch_pc.from_callable(pc)
        elif pc == "jacobi":
            T = _abs_diag_pc(dK.diagonal())
        elif pc in ("icc", "ilu", "bjacobi"):
            D = dK.diag
            T = torch_pc.block_jacobi_ilu(D.indptr, D.indices, D.values.detach(), D.M,
                                          kind="ic0" if pc == "icc" else "ilu0")
        else:
            raise ValueError(f"pc: expected 'jacobi', 'none', 'icc', 'ilu' or a callable, got {pc!r}")
    except (ValueError, TypeError) as e:
        err = e
    check_collective(comm, err)
    return T


def _mass_solver(dM, tol, rs):
    """x -> M^{-1} x by Jacobi-preconditioned CG (M SPD, well conditioned)."""
    from ..krylov.torch_methods import cg
    jac = _abs_diag_pc(dM.diagonal())
    rtol = min(1e-3 * tol, 1e-12)

    def solve(X):
        cols = []
        for j in range(X.shape[1]):
            y, inf = cg(lambda z: dM @ z, X[:, j].contiguous(), rtol=rtol, M=jac, reduce_sum=rs)
            if not inf.converged:
                raise ValueError(f"M: CG on the mass matrix failed ({inf.reason}); M must be SPD")
            cols.append(y)
        return torch.stack(cols, 1)
    return solve


def _shifted(dA, dM, sigma):
    """Collective. The row shard ``A - sigma M`` (pattern union)."""
    if dA.block_shape:
        raise ValueError("sigma: shift-invert in the torch backend needs a scalar (non-block) matrix")
    LA = dA.local
    rows = [LA.row_indices(), ]
    cols = [LA.indices]
    vals = [LA.values]
    if dM is not None:
        LM = dM.local
        rows.append(LM.row_indices())
        cols.append(LM.indices)
        vals.append(-sigma * LM.values)
    else:
        r0 = dA.row_range[0]
        i = torch.arange(dA.n_local, dtype=torch.int64)
        rows.append(i)
        cols.append(i + r0)
        vals.append(torch.full((dA.n_local,), -sigma, dtype=dA.dtype))
    r = torch.cat(rows)
    order = torch.argsort(r, stable=True)
    r, c, v = r[order], torch.cat(cols)[order], torch.cat(vals)[order]
    indptr = torch.zeros(dA.n_local + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.bincount(r, minlength=dA.n_local), 0)
    return DSparseTensor.from_local_rows(indptr, c, v, dA.global_shape, dA.comm, n_local_cols=dA.n_local)


class SlepcSolver:
    """Collective. ``solve(nev, v0, deflate)`` on one configured EPS (SlepcSession);
    PETSc errors become ValueError (bad options, indefinite M) / RuntimeError, on
    every rank."""

    def __init__(self, dA, dM, k, which, sigma, tol, maxiter, ncv, options_prefix, petsc_options,
                 st_solver, progress=None, inertia=False):
        self.dA, self.dM = dA, dM
        err = None
        self.session = None
        try:
            self.session = slepc_backend.SlepcSession(
                dA, dM, k, which=which, sigma=sigma, tol=tol, maxiter=maxiter, ncv=ncv,
                options_prefix=options_prefix, petsc_options=petsc_options, st_solver=st_solver,
                monitor=progress, inertia=inertia)
        except slepc_backend.PETSc.Error as e:
            msg = f"SLEPc rejected the configuration ({e})"
            if petsc_options or options_prefix:
                msg = f"petsc_options / options_prefix {options_prefix!r}: " + msg
            if dM is not None:
                msg += " (for a generalized problem this may also mean M is not positive definite)"
            err = ValueError(msg)
        check_collective(dA.comm, err)
        self.method = self.session.method
        self.setup_time = self.session.setup_time
        # dense EPS types compute the whole spectrum (with multiplicity) and ignore a
        # deflation space: nothing to verify
        self.block_safe = self.dense = self.method.split("+")[0] in ("lapack", "scalapack", "elpa",
                                                                      "elemental")

    def solve(self, nev, v0, deflate):
        err = out = None
        try:
            if deflate is not None:
                deflate = deflate[0].to(torch.float64)
            out = self.session.solve(nev, v0, deflate)
        except slepc_backend.PETSc.Error as e:
            msg = f"SLEPc ({self.method}) failed: {e}"
            if deflate is not None:
                msg += " (in the deflated multiplicity verification; this EPS type may not support a " \
                       "deflation space -- use the default Krylov-Schur)"
                err = RuntimeError(msg)
            elif self.dM is not None:
                err = ValueError(msg + " (for a generalized problem this usually means M is not positive "
                                 "definite)")
            else:
                err = RuntimeError(msg)
        check_collective(self.dA.comm, err)
        return out

    def shifted_inertia(self, shift):
        """Collective. The inertia of ``A - shift I`` (:func:`verify.inertia_verified`): a numeric
        refactorisation of the shift-invert LDL^T where the session has one, else a MUMPS LDL^T
        of its own; None when neither can be had."""
        out = self.session.inertia(shift)
        if out is None:
            from ..direct.petsc_backend import shifted_inertia
            out = shifted_inertia(self.dA, shift)
        return out

    def residual_direction(self, R):
        """Collective. The refinement direction for residuals ``R`` (:func:`refine`):
        the spectral transformation's own solve (``M^{-1} R``, ``(A - sigma M)^{-1} R``)
        where the EPS has one, else ``R``."""
        err = out = None
        try:
            out = self.session.st_solve(R)
        except slepc_backend.PETSc.Error as e:
            err = RuntimeError(f"SLEPc ({self.method}): the refinement solve failed: {e}")
        check_collective(self.dA.comm, err)
        return R if out is None else out

    def close(self):
        if self.session is not None:
            self.session.close()
            self.session = None


class TorchSolver:
    """Collective. The native kernels behind ``solve(nev, v0, deflate)`` (the
    operators, preconditioners and shift-invert solver are built once)."""

    def __init__(self, dA, dM, k, which, sigma, tol, maxiter, method, ncv, pc, rs, rm, row_offset, row_ids,
                 progress=None):
        t0 = time.perf_counter()
        self.dA, self.dM = dA, dM
        self.Kinv = None
        self.progress = progress
        self.tol, self.ncv, self.k = tol, ncv, k
        self.rs = rs
        self.n_global = int(dA.global_shape[0]) * (dA.block_shape[0] if dA.block_shape else 1)  # scalar rows
        self.kw = dict(reduce_sum=rs, reduce_max=rm, row_offset=row_offset, row_ids=row_ids)
        self.row_offset, self.row_ids = row_offset, row_ids
        comm = dA.comm
        self.Bop = (lambda X: dM @ X) if dM is not None else None
        if sigma is None and which == "SM":
            sigma = 0.0
        self.sigma, self.which = sigma, which
        err = None
        if sigma is None:
            if method is None:
                method = "lobpcg" if which == "SA" else "lanczos"
            if method == "lobpcg" and which not in ("SA", "LA"):
                err = ValueError("method: 'lobpcg' computes 'LA' or 'SA' eigenvalues, not which='LM'")
        else:
            if method == "lobpcg":
                err = ValueError("method: shift-invert (sigma, or which='SM' in the torch backend) runs "
                                 "Lanczos; method='lobpcg' is not available there")
            method = "lanczos"
        check_collective(comm, err)
        self.kind = method
        self.method = method + ("+sinvert" if sigma is not None else "")
        # native LOBPCG iterates a block of m >= k vectors (solve()): it cannot lose copies
        self.block_safe = method == "lobpcg"
        self.dense = False
        self.maxiter = maxiter if maxiter is not None else (5000 if method == "lobpcg" else 1000)
        if sigma is None:
            self.T = _build_pc(dA, pc, comm) if (method == "lobpcg" and which == "SA") else None
            self.Bs = _mass_solver(dM, tol, rs) if (dM is not None and method == "lanczos") else None
            self.OP = lambda X: dA @ X
        else:
            self.OP, self.Bs = self._shift_invert(dA, dM, sigma, pc, comm, tol, rs)
        self.setup_time = time.perf_counter() - t0

    def _shift_invert(self, dA, dM, sigma, pc, comm, tol, rs):
        # Lanczos on (A - sigma M)^{-1} M in the M-inner product; the inner solves go
        # through slasolve.solve (native MINRES: A - sigma M is indefinite)
        from ..krylov import solve as _solve
        dK = _shifted(dA, dM, sigma)
        T = _build_pc(dK, pc, comm)
        inner_rtol = min(1e-2 * tol, 1e-10)
        n_global = self.n_global

        def Kinv(X):
            with torch.no_grad():
                Y, inf = _solve(dK, X.contiguous(), "minres", backend="torch", M=T, rtol=inner_rtol,
                                maxiter=max(20 * n_global, 1000), raise_on_fail=False, return_info=True)
            if not inf.converged:
                raise EigenConvergenceError(
                    f"eigsh (torch, shift-invert): the inner MINRES solve with A - sigma M failed "
                    f"({inf.reason} after {inf.iterations} iterations); is sigma={sigma} an eigenvalue?")
            return Y

        self.Kinv = Kinv
        if dM is None:
            return Kinv, None
        Bop = self.Bop
        return (lambda X: Bop(Kinv(Bop(X)))), _mass_solver(dM, tol, rs)

    def solve(self, nev, v0, deflate):
        t1 = time.perf_counter()
        dA = self.dA
        n_local = dA.n_local
        defl = None if deflate is None else (deflate[0], deflate[1])
        nd = 0 if defl is None else defl[0].shape[1]
        if self.sigma is None and self.kind == "lobpcg":
            m = min(max(2 * nev, nev + 4), self.n_global - nd)
            X0 = start_vectors(n_local, m, row_offset=self.row_offset, row_ids=self.row_ids,
                               seed=1 + (0 if deflate is None else 17 * nd), dtype=dA.dtype, device=dA.device)
            X0[:, 0] = v0
            w, V, inf = lobpcg(self.OP, X0, B=self.Bop, T=self.T, k=nev, largest=(self.which == "LA"),
                               tol=self.tol, maxiter=self.maxiter, deflate=defl, callback=self.progress,
                               **self.kw)
        elif self.sigma is None:
            # the verification keeps the first solve's basis size: a smaller one converges
            # much slower on clustered extreme eigenvalues
            ncv = self.ncv if self.ncv is not None else max(2 * self.k + 1, 20)
            ncv = min(self.n_global - nd, max(ncv, 2 * nev + 1))
            w, V, inf = lanczos(self.OP, v0, nev, which=self.which, B=self.Bop, B_solve=self.Bs,
                                tol=self.tol, maxiter=self.maxiter, ncv=ncv, deflate=defl,
                                callback=self.progress, **self.kw)
        else:
            # shift-invert: every basis vector costs an inner solve and convergence takes a
            # restart or two, so the verification uses a small basis
            ncv = self.ncv if deflate is None else None
            if ncv is None:
                ncv = min(self.n_global - nd, max(2 * nev + 1, 20 if deflate is None else 12))
            theta, V, inf = lanczos(self.OP, v0, nev, which="LM", B=self.Bop, B_solve=self.Bs,
                                    tol=self.tol, maxiter=self.maxiter, ncv=ncv, deflate=defl,
                                    callback=self.progress, **self.kw)
            w = self.sigma + 1.0 / theta
        if deflate is not None:
            # candidates for the verification: the converged prefix in wanted order (a
            # converged pair behind an unconverged more wanted one proves nothing)
            ok = torch.tensor([r <= self.tol for r in inf.residual_norms], dtype=torch.bool)
            order = torch.argsort(want_key(w, self.which, self.sigma), stable=True)
            okw = ok[order]
            nconv = int(okw.numel() if bool(okw.all()) else int(torch.nonzero(~okw)[0]))
            order = order[:nconv]
            return w[order], V[:, order], nconv, inf.iterations, time.perf_counter() - t1
        return w, V, inf.converged, inf.iterations, time.perf_counter() - t1

    def residual_direction(self, R):
        """Collective. The refinement direction for residuals ``R`` (:func:`refine`):
        ``(A - sigma M)^{-1} R`` with shift-invert, ``M^{-1} R`` for a generalized
        problem, else ``R``."""
        if self.Kinv is not None:
            return self.Kinv(R)
        if self.dM is not None:
            if self.Bs is None:
                self.Bs = _mass_solver(self.dM, self.tol, self.rs)
            return self.Bs(R)
        return R

    def close(self):
        pass
