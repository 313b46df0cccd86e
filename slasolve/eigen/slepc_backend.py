"""SLEPc backend of :func:`slasolve.eigsh` (needs slepc4py).

Collective over the operators' communicator. The EPS is configured as a SLEPc
user would do it by hand and then handed to the options database, so that
``-eps_*`` / ``-st_*`` options (with the caller's ``options_prefix``) override
every default chosen here:

* problem type ``HEP`` (standard) or ``GHEP`` (``M`` given, SPD);
* ``EPSKRYLOVSCHUR``, ``nev = k``, ``ncv``/``mpd`` SLEPc's defaults unless given;
* ``tol`` / ``maxiter`` -> ``EPSSetTolerances`` (default ``maxiter``: ARPACK's ``10 n``
  restarts, ``default_max_restarts``), convergence test
  ``EPS_CONV_REL`` (SLEPc's default: error estimate relative to ``|lambda|``);
* ``which``: ``"LA"`` -> ``LARGEST_REAL``, ``"SA"`` -> ``SMALLEST_REAL``,
  ``"LM"`` -> ``LARGEST_MAGNITUDE``, ``"SM"`` -> ``SMALLEST_MAGNITUDE``;
* ``sigma``: spectral transformation ``STSINVERT`` with target ``sigma`` and
  ``TARGET_MAGNITUDE`` (eigenvalues nearest ``sigma``); the ST's KSP is
  ``preonly`` + ``LU`` with MUMPS when PETSc has it (``-st_pc_factor_mat_solver_type``
  and ``-st_ksp_type`` / ``-st_pc_type`` select an iterative inner solver); when
  ``eigsh`` will count eigenvalues by inertia (``SlepcSession.inertia``) and ``A``
  is an exactly symmetric AIJ matrix storing its diagonal, MUMPS' LDL^T
  (``Cholesky``, indefinite) of a private copy ``K = A - sigma I`` instead
  (``STSetPreconditionerMat``), whose analysis the inertia counts reuse;
* initial vector: the caller's (``v0``), which ``eigsh`` always passes, so the
  iteration does not depend on the number of ranks.

The Mats are the tensors' cached PETSc Mats (``dA.to_petsc()``), refilled in
place when only the values changed.
"""
from __future__ import annotations

import time

import torch
from mpi4py import MPI

from .._comm import allreduce_int
from ..petsc import PETSc, option_entries, temporary_options, vec_to_tensor
from ..symmetry import exactly_symmetric

try:
    from slepc4py import SLEPc
except ImportError as e:  # pragma: no cover
    raise ImportError("the 'slepc' backend of eigsh needs slepc4py (apt install python3-slepc4py)") from e

__all__ = ["SlepcSession", "configure_eps", "SLEPc"]

_WHICH = {
    "LA": SLEPc.EPS.Which.LARGEST_REAL,
    "SA": SLEPc.EPS.Which.SMALLEST_REAL,
    "LM": SLEPc.EPS.Which.LARGEST_MAGNITUDE,
    "SM": SLEPc.EPS.Which.SMALLEST_MAGNITUDE,
}


def _mats(dA, dM):
    """PETSc Mats of A and M. When both tensors share one layout (hence one cached
    Mat), M gets a private copy."""
    if dM is None:
        return dA.to_petsc(), None
    if dM._layout is dA._layout:
        Mm = dM.to_petsc().copy()
        return dA.to_petsc(), Mm
    return dA.to_petsc(), dM.to_petsc()


def default_max_restarts(n_global: int) -> int:
    """Local. ARPACK's (SciPy's) default ``maxiter``, ``10 n`` restarts, or at least SLEPc's own
    (``max(100, 2 n / ncv)``): a problem SciPy's ``eigsh`` solves with its defaults is not cut
    short."""
    return max(10 * int(n_global), 100)


def configure_eps(eps, *, k, which, sigma, tol, maxiter, ncv, generalized, st_solver=None, n_global=0,
                  factor="lu"):
    """Set the defaults described in the module docstring on ``eps`` (local); ``factor``
    the ST's direct factorisation with ``sigma`` (``"lu"`` or ``"cholesky"``)."""
    eps.setProblemType(SLEPc.EPS.ProblemType.GHEP if generalized else SLEPc.EPS.ProblemType.HEP)
    eps.setType(SLEPc.EPS.Type.KRYLOVSCHUR)
    eps.setDimensions(nev=k, ncv=ncv if ncv is not None else PETSc.DECIDE)
    eps.setTolerances(tol=tol, max_it=maxiter if maxiter is not None else default_max_restarts(n_global))
    eps.setConvergenceTest(SLEPc.EPS.Conv.REL)
    if sigma is not None:
        eps.setTarget(float(sigma))
        eps.setWhichEigenpairs(SLEPc.EPS.Which.TARGET_MAGNITUDE)
        st = eps.getST()
        st.setType(SLEPc.ST.Type.SINVERT)
        ksp = st.getKSP()
        ksp.setType(PETSc.KSP.Type.PREONLY)
        pc = ksp.getPC()
        pc.setType(factor)
        solver = st_solver
        if solver is None and PETSc.Sys.hasExternalPackage("mumps"):
            solver = "mumps"
        if solver is not None:
            pc.setFactorSolverType(solver)
    else:
        eps.setWhichEigenpairs(_WHICH[which])


def _ldlt_ready(dA, Am) -> bool:
    """Collective. Whether the shift-invert factor may be MUMPS' LDL^T of a copy of ``Am`` that
    inertia counts refactor in place: a scalar AIJ Mat, exactly symmetric (MUMPS reads one
    triangle), every main-diagonal entry stored (a shifted diagonal keeps the pattern)."""
    L = dA._layout
    ok = (not L.block and Am.getType() in ("seqaij", "mpiaij")
          and int(L._diagonal_entries()[0].numel()) == L.rend - L.rstart
          and PETSc.Sys.hasExternalPackage("mumps"))
    if not allreduce_int(dA.comm, int(ok), MPI.MIN):
        return False
    return exactly_symmetric(dA)


class SlepcSession:
    """Collective. One configured EPS for one ``eigsh`` call: the first solve and the
    deflated verification solves reuse it (same Mats, same ST -- hence the same
    shift-invert factorisation). Use as a context manager; ``close`` destroys every
    PETSc object it created.

    ``method``: what actually runs, from the EPS after ``setFromOptions``:
    ``eps.getType()``, plus ``"+" + st.getType()`` unless the ST is ``shift`` or
    ``precond`` (the preconditioned solvers' default) with a zero shift (e.g.
    ``"krylovschur+sinvert"``, ``"lobpcg"``).

    ``monitor``: optional ``monitor(iteration, nconv, error estimates of the nev wanted
    pairs)``, installed as an EPS monitor (``eigsh(progress=...)``).
    """

    def __init__(self, dA, dM, k, *, which, sigma, tol, maxiter, ncv=None, options_prefix=None,
                 petsc_options=None, st_solver=None, monitor=None, inertia=False):
        t0 = time.perf_counter()
        self.comm = dA.comm
        self.n_global = int(dA.global_shape[0]) * (dA.block_shape[0] if dA.block_shape else 1)  # scalar rows
        self.ncv = ncv
        self._shared_M = dM is not None and dM._layout is dA._layout
        self.Am, self.Mm = _mats(dA, dM)
        self.eps = SLEPc.EPS().create(comm=self.comm)
        self._vecs = []
        self.K = self._K_diag = None
        self.inertia_factor = False
        if monitor is not None:   # monitor(iteration, nconv, error estimates of the nev wanted pairs)
            self.eps.setMonitor(lambda eps, its, nconv, eig, err:
                                monitor(int(its), int(nconv), [float(e) for e in err[:eps.getDimensions()[0]]]))
        try:
            if inertia and sigma is not None and dM is None and st_solver in (None, "mumps") \
                    and _ldlt_ready(dA, self.Am):
                self.K = self.Am.duplicate(copy=True)
                if sigma != 0.0:
                    self.K.shift(-sigma)    # as SLEPc shifts its own copy: the same values
                self._K_diag = self.K.getDiagonal()
            self._configure(dM, k, which, sigma, tol, maxiter, ncv, options_prefix, petsc_options, st_solver)
        except BaseException:
            self.close()
            raise
        self.setup_time = time.perf_counter() - t0

    def _configure(self, dM, k, which, sigma, tol, maxiter, ncv, options_prefix, petsc_options, st_solver):
        eps = self.eps
        eps.setOperators(self.Am, self.Mm)
        configure_eps(eps, k=k, which=which, sigma=sigma, tol=tol, maxiter=maxiter, ncv=ncv,
                      generalized=dM is not None, st_solver=st_solver, n_global=self.n_global,
                      factor="cholesky" if self.K is not None else "lu")
        if self.K is not None:
            eps.getST().setPreconditionerMat(self.K)
        if options_prefix:
            eps.setOptionsPrefix(options_prefix)
        options = option_entries(petsc_options)
        icntl13 = "st_mat_mumps_icntl_13"
        if self.K is not None and self.comm.Get_size() > 1 and icntl13 not in options \
                and not PETSc.Options(options_prefix).hasName(icntl13):
            # MUMPS counts the inertia of its LDL^T on several ranks only without ScaLAPACK on the
            # root front (read by the analysis)
            options[icntl13] = "1"
        # the factorisation (in setUp) reads the -st_mat_mumps_* options
        with temporary_options(options, options_prefix):
            eps.setFromOptions()
            eps.setUp()     # configuration errors surface here (ValueError in eigsh), not in solve
        self.main_ncv = int(eps.getDimensions()[1])
        st = eps.getST()
        self.method = str(eps.getType())
        st_type = self.st_type = str(st.getType())
        if st_type not in ("shift", "precond") or st.getShift() != 0.0:
            self.method += "+" + st_type
        if self.K is not None:
            ksp = st.getKSP()
            pc = ksp.getPC()
            self.inertia_factor = (st_type == "sinvert" and ksp.getType() == "preonly"
                                   and pc.getType() == "cholesky" and pc.getFactorSolverType() == "mumps"
                                   and st.getShift() == sigma)

    def inertia(self, shift: float):
        """Collective. The inertia ``(negative, zero, positive)`` of ``A - shift I`` from a numeric
        LDL^T refactorisation of the shift-invert factor's copy ``K`` (MUMPS reuses its analysis:
        same pattern, shifted diagonal), or None when this EPS has no such factor or MUMPS fails.
        ``K`` gets its values back at once; PETSc refactors it numerically when the ST solves
        again (a deflated re-solve). The same answer on every rank."""
        if not self.inertia_factor:
            return None
        pc = self.eps.getST().getKSP().getPC()
        F = pc.getFactorMatrix()
        d = self._K_diag.duplicate()
        out = None
        old24 = int(F.getMumpsIcntl(24))
        try:
            self.Am.getDiagonal(d)
            d.shift(-shift)
            self.K.setDiagonal(d)
            F.setMumpsIcntl(24, 1)   # null pivots counted (INFOG(28)): PETSc's inertia needs it
            pc.setUp()
            if int(F.getMumpsInfog(1)) >= 0:
                out = tuple(int(v) for v in F.getInertia())
        except PETSc.Error:
            out = None
        finally:
            F.setMumpsIcntl(24, old24)
            self.K.setDiagonal(self._K_diag)
            d.destroy()
        code = -1 if out is None else out[0]
        if allreduce_int(self.comm, code, MPI.MIN) != allreduce_int(self.comm, code, MPI.MAX) or out is None:
            return None
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self):
        """Collective. Destroy the EPS and the Vecs/Mats created for this call."""
        for v in self._vecs:
            v.destroy()
        self._vecs = []
        if self.eps is not None:
            self.eps.destroy()
            self.eps = None
        if self.Mm is not None and self._shared_M:
            self.Mm.destroy()
        self.Mm = None
        for m in (self.K, self._K_diag):
            if m is not None:
                m.destroy()
        self.K = self._K_diag = None

    def _vec(self, x):
        # a Vec owning its memory: SLEPc keeps references to initial/deflation vectors
        v = self.Am.createVecs("right")
        v.getArray()[:] = x.detach().to(device="cpu", dtype=torch.float64).reshape(-1).numpy()
        self._vecs.append(v)
        return v

    def st_solve(self, R):
        """Collective. The columns of ``R`` through the spectral transformation's linear
        solver (``M^{-1}`` for a generalized problem with the shift ST, ``(A - sigma
        M)^{-1}`` with shift-invert); None when this EPS has no such solve (standard
        problem without shift-invert, or an ST set by the user's options)."""
        st = self.eps.getST()
        if self.st_type not in ("shift", "sinvert") or (self.Mm is None and self.st_type == "shift"):
            return None
        ksp = st.getKSP()
        x, y = self.Am.createVecs()
        try:
            cols = []
            for j in range(R.shape[1]):
                x.getArray()[:] = R[:, j].detach().to(device="cpu", dtype=torch.float64).numpy()
                ksp.solve(x, y)
                cols.append(vec_to_tensor(y, copy=True))
        finally:
            x.destroy()
            y.destroy()
        return torch.stack(cols, 1).to(dtype=R.dtype, device=R.device)

    def solve(self, nev, v0, deflate=None):
        """Collective. Solve for ``nev`` wanted pairs from start vector ``v0``; with
        ``deflate`` (a ``(n_local, d)`` block of M-orthonormal eigenvectors) SLEPc
        works in their (M-)orthogonal complement (``EPSSetDeflationSpace``).

        Returns ``(w, V, nconv, iterations, seconds)``: the first ``min(nconv, nev)``
        converged pairs, in SLEPc's order (most wanted first), ``V`` float64 CPU.
        """
        eps = self.eps
        t0 = time.perf_counter()
        if deflate is not None:
            # without a spectral transformation keep the first solve's basis size (a smaller
            # one converges slower on clustered spectra); with one, each basis vector costs a
            # solve and convergence takes a restart or two: SLEPc's size for nev
            ncv = self.main_ncv if self.st_type not in ("sinvert", "cayley") else PETSc.DECIDE
            eps.setDimensions(nev=nev, ncv=ncv, mpd=PETSc.DECIDE)
            eps.setDeflationSpace([self._vec(deflate[:, j]) for j in range(deflate.shape[1])])
        eps.setInitialSpace([self._vec(v0)])
        eps.solve()
        nconv = eps.getConverged()
        its = eps.getIterationNumber()
        m = min(nconv, nev)
        vr = self.Am.createVecs("right")
        ws, cols = [], []
        try:
            for i in range(m):
                lam = eps.getEigenpair(i, vr)
                ws.append(float(lam.real))
                cols.append(vec_to_tensor(vr, copy=True))
        finally:
            vr.destroy()
        for v in self._vecs:
            v.destroy()
        self._vecs = []
        w = torch.tensor(ws, dtype=torch.float64)
        n_local = self.Am.getLocalSize()[0]
        V = torch.stack(cols, 1) if cols else torch.zeros(n_local, 0, dtype=torch.float64)
        return w, V, int(nconv), int(its), time.perf_counter() - t0
