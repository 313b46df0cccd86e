"""SLEPc backend of :func:`slasolve.eigsh` (needs slepc4py).

Collective over the operators' communicator. The EPS is configured as a SLEPc
user would do it by hand and then handed to the options database, so that
``-eps_*`` / ``-st_*`` options (with the caller's ``options_prefix``) override
every default chosen here:

* problem type ``HEP`` (standard) or ``GHEP`` (``M`` given, SPD);
* ``EPSKRYLOVSCHUR``, ``nev = k``, ``ncv``/``mpd`` SLEPc's defaults unless given;
* ``tol`` / ``maxiter`` -> ``EPSSetTolerances``, convergence test
  ``EPS_CONV_REL`` (SLEPc's default: error estimate relative to ``|lambda|``);
* ``which``: ``"LA"`` -> ``LARGEST_REAL``, ``"SA"`` -> ``SMALLEST_REAL``,
  ``"LM"`` -> ``LARGEST_MAGNITUDE``, ``"SM"`` -> ``SMALLEST_MAGNITUDE``;
* ``sigma``: spectral transformation ``STSINVERT`` with target ``sigma`` and
  ``TARGET_MAGNITUDE`` (eigenvalues nearest ``sigma``); the ST's KSP is
  ``preonly`` + ``LU`` with MUMPS when PETSc has it (``-st_pc_factor_mat_solver_type``
  and ``-st_ksp_type`` / ``-st_pc_type`` select an iterative inner solver);
* initial vector: the caller's (``v0``), which ``eigsh`` always passes, so the
  iteration does not depend on the number of ranks.

The Mats are the tensors' cached PETSc Mats (``dA.to_petsc()``), refilled in
place when only the values changed.
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch

from ..petsc import PETSc, tensor_to_vec, vec_to_tensor

try:
    from slepc4py import SLEPc
except ImportError as e:  # pragma: no cover
    raise ImportError("the 'slepc' backend of eigsh needs slepc4py (apt install python3-slepc4py)") from e

__all__ = ["slepc_eigsh", "SLEPc"]

_WHICH = {
    "LA": SLEPc.EPS.Which.LARGEST_REAL,
    "SA": SLEPc.EPS.Which.SMALLEST_REAL,
    "LM": SLEPc.EPS.Which.LARGEST_MAGNITUDE,
    "SM": SLEPc.EPS.Which.SMALLEST_MAGNITUDE,
}


@contextlib.contextmanager
def _temporary_options(options: Optional[dict], prefix: Optional[str]):
    """Put ``options`` into the PETSc database for the duration of the block and
    restore the previous state afterwards (so one call's options do not leak
    into the next)."""
    if not options:
        yield
        return
    opts = PETSc.Options(prefix)
    saved = {}
    for k, v in options.items():
        key = k.lstrip("-")
        saved[key] = opts.getString(key) if opts.hasName(key) else None
        if v is None or v is True:
            opts[key] = ""
        elif v is False:
            opts[key] = "false"
        else:
            opts[key] = str(v)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                opts.delValue(key)
            else:
                opts[key] = old


def _mats(dA, dM):
    """PETSc Mats of A and M. When both tensors share one layout (hence one cached
    Mat), M gets a private copy."""
    if dM is None:
        return dA.to_petsc(), None
    if dM._layout is dA._layout:
        Mm = dM.to_petsc().copy()
        return dA.to_petsc(), Mm
    return dA.to_petsc(), dM.to_petsc()


def configure_eps(eps, *, k, which, sigma, tol, maxiter, ncv, generalized, st_solver=None):
    """Set the defaults described in the module docstring on ``eps`` (local)."""
    eps.setProblemType(SLEPc.EPS.ProblemType.GHEP if generalized else SLEPc.EPS.ProblemType.HEP)
    eps.setType(SLEPc.EPS.Type.KRYLOVSCHUR)
    eps.setDimensions(nev=k, ncv=ncv if ncv is not None else PETSc.DECIDE)
    eps.setTolerances(tol=tol, max_it=maxiter if maxiter is not None else PETSc.DECIDE)
    eps.setConvergenceTest(SLEPc.EPS.Conv.REL)
    if sigma is not None:
        eps.setTarget(float(sigma))
        eps.setWhichEigenpairs(SLEPc.EPS.Which.TARGET_MAGNITUDE)
        st = eps.getST()
        st.setType(SLEPc.ST.Type.SINVERT)
        ksp = st.getKSP()
        ksp.setType(PETSc.KSP.Type.PREONLY)
        pc = ksp.getPC()
        pc.setType(PETSc.PC.Type.LU)
        solver = st_solver
        if solver is None and PETSc.Sys.hasExternalPackage("mumps"):
            solver = "mumps"
        if solver is not None:
            pc.setFactorSolverType(solver)
    else:
        eps.setWhichEigenpairs(_WHICH[which])


def slepc_eigsh(dA, dM, k, *, which, sigma, v0, tol, maxiter, ncv=None, options_prefix=None,
                petsc_options=None, st_solver=None):
    """Collective. Run SLEPc on the row shards ``dA`` (and ``dM``).

    Returns ``(w, V, nconv, iterations, setup_time, solve_time, reason)`` where
    ``w`` / ``V`` hold the first ``min(nconv, k)`` wanted pairs in SLEPc's
    order (wanted first), ``V`` the owned rows (float64, CPU).
    """
    t0 = time.perf_counter()
    comm = dA.comm
    Am, Mm = _mats(dA, dM)
    eps = SLEPc.EPS().create(comm=comm)
    try:
        eps.setOperators(Am, Mm)
        configure_eps(eps, k=k, which=which, sigma=sigma, tol=tol, maxiter=maxiter, ncv=ncv,
                      generalized=dM is not None, st_solver=st_solver)
        x0 = v0.detach().to(device="cpu", dtype=torch.float64).contiguous().clone()
        vec0 = tensor_to_vec(x0, comm, global_size=dA.global_shape[0])
        eps.setInitialSpace([vec0])
        if options_prefix:
            eps.setOptionsPrefix(options_prefix)
        with _temporary_options(petsc_options, options_prefix):
            eps.setFromOptions()
        eps.setUp()
        t1 = time.perf_counter()
        eps.solve()
        t2 = time.perf_counter()
        nconv = eps.getConverged()
        its = eps.getIterationNumber()
        reason = int(eps.getConvergedReason())
        m = min(nconv, k)
        vr = Am.createVecs("right")
        ws, cols = [], []
        for i in range(m):
            lam = eps.getEigenpair(i, vr)
            ws.append(float(lam.real))
            cols.append(vec_to_tensor(vr, copy=True))
        vr.destroy()
        vec0.destroy()
    finally:
        eps.destroy()
        if Mm is not None and dM._layout is dA._layout:
            Mm.destroy()
    w = torch.tensor(ws, dtype=torch.float64)
    V = torch.stack(cols, 1) if cols else torch.zeros(dA.n_local, 0, dtype=torch.float64)
    return w, V, nconv, its, t1 - t0, t2 - t1, reason
