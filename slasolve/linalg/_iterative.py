"""SciPy-signature ``cg``, ``bicgstab``, ``gmres``, ``minres`` (see :mod:`slasolve.linalg`)."""
from __future__ import annotations

import math
import warnings
from numbers import Real
from typing import Optional

import numpy as np
import torch
from mpi4py import MPI

from .._comm import allreduce_sum, check_collective, user_code
from ..dsparse import DSparseTensor
from ..krylov.torch_backend import torch_kernel
from ._system import System

__all__ = ["cg", "bicgstab", "gmres", "minres", "cgs", "tfqmr", "info_code", "BREAKDOWN"]

#: ``info`` for a breakdown (SciPy's ``<0``: illegal input or breakdown; -10 is the
#: code SciPy's reverse-communication kernels use for a breakdown)
BREAKDOWN = -10



def info_code(sinfo, maxiter: int) -> int:
    """Local. SciPy's ``info`` from a :class:`~slasolve.SolveInfo`: 0 converged,
    ``maxiter`` (SciPy's count) when the iteration limit was reached, else
    :data:`BREAKDOWN` (breakdown, indefinite matrix/preconditioner, NaN/Inf)."""
    if sinfo.converged:
        return 0
    if sinfo.reason == "DIVERGED_ITS":
        return int(maxiter)
    return BREAKDOWN


def _atol_warning(name: str) -> None:
    # SciPy 1.10's message and category, so code filtering it keeps working
    warnings.warn(f"scipy.sparse.linalg.{name} called without specifying `atol`. "
                  "The default value will be changed in a future release. "
                  "For compatibility, specify a value for `atol` explicitly, e.g., "
                  f"``{name}(..., atol=0)``, or to retain the old behavior "
                  f"``{name}(..., atol='legacy')``", category=DeprecationWarning, stacklevel=4)


def _tolerances(name, tol, rtol, atol, has_atol: bool):
    """Local. ``(relative, absolute or 'legacy', error)`` from SciPy 1.10's ``tol``/``atol``
    and SciPy >= 1.12's ``rtol`` (with ``rtol`` given, ``atol`` defaults to 0 as there)."""
    def bad_real(v, what):
        if not isinstance(v, Real) or isinstance(v, bool) or not float(v) >= 0:
            return ValueError(f"{name}: {what} must be a real number >= 0, got {v!r}")
        return None
    if rtol is not None:
        err = bad_real(rtol, "rtol")
        if err is None and float(tol) != 1e-5 and float(tol) != float(rtol):
            err = ValueError(f"{name}: give tol (SciPy <= 1.11) or rtol (SciPy >= 1.12), not both")
        rel = rtol
        if atol is None:
            atol = 0.0
    else:
        err = bad_real(tol, "tol")
        rel = tol
        if has_atol and atol is None:
            _atol_warning(name)
            atol = "legacy"
        elif not has_atol:
            atol = 0.0
    if err is None and atol != "legacy":
        err = bad_real(atol, "atol")
    if err is not None:
        return None, None, err
    return float(rel), (atol if atol == "legacy" else float(atol)), None


def _check_maxiter(name, maxiter):
    if maxiter is None:
        return None
    if not isinstance(maxiter, (int, np.integer)) or isinstance(maxiter, bool):
        return TypeError(f"{name}: maxiter must be an int or None, got {type(maxiter).__name__}")
    if maxiter < 0:
        return ValueError(f"{name}: maxiter must be >= 0, got {maxiter}")
    return None


def _norm(sys_, v: torch.Tensor) -> float:
    s = torch.dot(v, v).reshape(1).to(torch.float64)
    if sys_.comm.Get_size() > 1:
        s = allreduce_sum(sys_.comm, s)
    return math.sqrt(max(float(s[0]), 0.0))


def _delegate(method, sys_, b, x0, atol_eff, maxiter_inner, restart, res_cb, backend):
    """Collective. ``slasolve.solve`` on the matrix (PETSc KSP or the torch backend)."""
    from ..krylov.solve import solve
    M = sys_.M
    kw = dict(rtol=0.0, atol=atol_eff, maxiter=maxiter_inner, x0=x0, M=M, return_info=True,
              raise_on_fail=False, backend=backend)
    if method == "gmres":
        kw["restart"] = restart
    if res_cb is not None:
        kw["callback"] = lambda it, rnorm: res_cb(rnorm)
    with torch.no_grad():
        x, sinfo = solve(sys_.dA, b, method, **kw)
    return x.detach(), sinfo


def _kernel(method, sys_, b, x0, atol_eff, maxiter_inner, restart, res_cb, x_cb, x_cb_cycles,
            rtol_initial=None):
    """Collective. The native torch kernel (matrix-free operators, callbacks on iterates).
    ``rtol_initial``: a tolerance relative to ``||b - A x0||`` besides ``atol_eff`` (tfqmr).

    The kernels update their iterate in place and take their first product on it
    (``r0 = b - A x0``), so passing ``x0`` and recording the first argument of the
    product gives the live iterate for ``callback(xk)`` without another product."""
    state = {"x": None}
    need_x = x_cb is not None

    def mv(v):
        if need_x and state["x"] is None:
            state["x"] = v
        elif x_cb_cycles and v is state["x"]:  # GMRES: true residual at the end of a cycle
            x_cb(sys_.output(v))
        return sys_.op(v)

    if need_x and method == "cg":
        return _cg_iterates(sys_, b, x0, atol_eff, maxiter_inner, x_cb)
    if need_x and x0 is None:
        x0 = torch.zeros_like(b)
    kcb = None
    if res_cb is not None:
        kcb = lambda it, rnorm: res_cb(rnorm)  # noqa: E731
    elif need_x and not x_cb_cycles:
        kcb = lambda it, rnorm: x_cb(sys_.output(state["x"]))  # noqa: E731
    kw = dict(x0=x0, rtol=0.0, atol=atol_eff, maxiter=maxiter_inner, M=sys_.M,
              reduce_sum=sys_.reduce_sum(), callback=kcb)
    if rtol_initial is not None:
        kw.update(rtol=rtol_initial, relative_to_initial=True)
    if method == "gmres":
        kw["restart"] = restart
    x, sinfo = torch_kernel(method)(mv, b, **kw)
    if x_cb_cycles:  # SciPy: once per restart cycle, and once more at the exit
        x_cb(sys_.output(x))
    return x, sinfo


def _cg_iterates(sys_, b, x0, atol_eff, maxiter, x_cb):
    """Collective. Preconditioned CG (Hestenes-Stiefel, the kernels' recurrence) that hands
    each iterate to ``callback(xk)``: slasolve's CG kernel keeps its iterate in a private
    workspace, so the SciPy-style iterate callback runs this loop instead. Same test
    (``||r|| <= atol_eff``), same failure reasons as the kernel."""
    from ..krylov.info import SolveInfo
    red = sys_.reduce_sum() or (lambda t: t)
    x = torch.zeros_like(b) if x0 is None else x0.clone()
    r = b - sys_.op(x) if x0 is not None else b.clone()
    z = r if sys_.M is None else sys_.M(r)
    bb, rr, rz = red(torch.stack([torch.dot(b, b), torch.dot(r, r), torch.dot(r, z)]).to(torch.float64)).tolist()

    def done(reason, its, rn):
        return x, SolveInfo(converged=reason.startswith("CONVERGED"), reason=reason, iterations=its,
                            residual_norm=rn, method="cg", backend="torch")
    if bb == 0.0:
        return torch.zeros_like(b), SolveInfo(converged=True, reason="CONVERGED_ATOL", iterations=0,
                                              residual_norm=0.0, method="cg", backend="torch")
    if math.sqrt(max(rr, 0.0)) <= atol_eff:
        return done("CONVERGED_RTOL", 0, math.sqrt(max(rr, 0.0)))
    if not (rz > 0):
        return done("DIVERGED_INDEFINITE_PC" if rz < 0 else "DIVERGED_BREAKDOWN", 0, math.sqrt(max(rr, 0.0)))
    p = z.clone()
    for k in range(1, maxiter + 1):
        q = sys_.op(p)
        pap = float(red(torch.dot(p, q).reshape(1).to(torch.float64))[0])
        if not (pap > 0) or not math.isfinite(pap):
            return done("DIVERGED_INDEFINITE_MAT" if math.isfinite(pap) else "DIVERGED_NANORINF", k,
                        math.sqrt(max(rr, 0.0)))
        alpha = rz / pap
        x.add_(p, alpha=alpha)
        r.add_(q, alpha=-alpha)
        z = r if sys_.M is None else sys_.M(r)
        rr, rz_new = red(torch.stack([torch.dot(r, r), torch.dot(r, z)]).to(torch.float64)).tolist()
        x_cb(sys_.output(x))
        rn = math.sqrt(max(rr, 0.0))
        if not math.isfinite(rn):
            return done("DIVERGED_NANORINF", k, rn)
        if rn <= atol_eff:
            return done("CONVERGED_RTOL", k, rn)
        if not (rz_new > 0):
            return done("DIVERGED_INDEFINITE_PC" if rz_new < 0 else "DIVERGED_BREAKDOWN", k, rn)
        p.mul_(rz_new / rz).add_(z)
        rz = rz_new
    return done("DIVERGED_ITS", maxiter, math.sqrt(max(rr, 0.0)))


def _krylov(method, A, b, x0, tol, maxiter, M, callback, *, rtol, atol, has_atol, comm, local,
            backend, restart=None, callback_type=None, shift=0.0, check=False, show=False,
            relative_to_r0=False):
    name = method
    rel, abs_, err = _tolerances(name, tol, rtol, atol, has_atol)
    err = err or _check_maxiter(name, maxiter)
    if err is None and backend not in (None, "petsc", "torch"):
        err = ValueError(f"{name}: backend must be None, 'petsc' or 'torch', got {backend!r}")
    if err is None and callback is not None and not callable(callback):
        err = TypeError(f"{name}: callback must be callable or None")
    if err is None and restart is not None and (not isinstance(restart, (int, np.integer)) or restart < 1):
        err = ValueError(f"{name}: restart must be a positive int, got {restart!r}")
    sys_ = System(name, A, b, x0, M, comm=comm, local=local, shift=shift)
    err = err or sys_.error
    ccomm = getattr(sys_, "comm", None)
    if ccomm is None:
        ccomm = A.comm if isinstance(A, DSparseTensor) else (comm if isinstance(comm, MPI.Comm) else MPI.COMM_SELF)
    agree = dict(sys_.settings, method=method, tol=repr(rel), atol=repr(abs_), maxiter=maxiter,
                 restart=restart, callback=callback is not None, callback_type=callback_type,
                 backend=backend, shift=float(shift) if isinstance(shift, Real) else repr(shift),
                 check=bool(check))
    check_collective(ccomm, err, agree=agree)
    err = None
    try:
        sys_.build()
    except (TypeError, ValueError) as e:
        err = e
    check_collective(ccomm, err)
    callback = user_code(ccomm, callback, "callback")   # a raise on one rank ends the solve everywhere

    b_t = sys_.local_rows(sys_.b_np)
    if isinstance(sys_.x0_np, str):  # 'Mb'
        x0_t = b_t.clone() if sys_.M is None else sys_.M(b_t.clone())
    elif sys_.x0_np is not None:
        x0_t = sys_.local_rows(sys_.x0_np)
    else:
        x0_t = None
    n = sys_.n
    if check:
        _check_symmetric(sys_)

    bnorm = _norm(sys_, b_t)
    if abs_ == "legacy":
        # SciPy 1.10's 'legacy' atol: exit at once when ||b - A x0|| <= tol (an absolute
        # test on the initial residual), else the tolerance is tol*||b|| (tol if b = 0)
        # (tested here only without x0: with x0 that costs a product SciPy's counts do not
        # allow; the solver then starts from x0 and stops at tol*||b||)
        if x0_t is None and bnorm <= rel:
            return sys_.output(torch.zeros_like(b_t)), 0
        atol_eff = rel if bnorm == 0 else rel * bnorm
    elif relative_to_r0 and x0_t is not None and (sys_.dA is None or callback is not None):
        atol_eff = None   # the kernel measures tol against ||b - A x0|| (no extra product)
    elif relative_to_r0 and x0_t is not None:   # SciPy's tfqmr: tol relative to ||b - A x0|| (see tfqmr)
        atol_eff = max(abs_, rel * min(bnorm, _norm(sys_, b_t - sys_.op(x0_t))))
    else:
        atol_eff = max(abs_, rel * bnorm)
    if method == "gmres":
        restart = 20 if restart is None else int(restart)
        restart = max(1, min(restart, n))
    if maxiter is None:
        maxiter = (5 if method == "minres" else 10) * n
        if method == "tfqmr":
            maxiter = min(10000, maxiter)     # SciPy's tfqmr default
    legacy_cb = method == "gmres" and callback is not None and callback_type == "legacy"
    if method == "gmres" and not legacy_cb:
        maxiter_inner = int(maxiter) * restart     # SciPy counts restart cycles
    else:
        maxiter_inner = int(maxiter)
    relative = None
    if atol_eff is None:
        relative, atol_eff = rel, abs_
    if not math.isfinite(atol_eff) or (relative is not None and not math.isfinite(relative)):
        return sys_.output(torch.zeros_like(b_t) if x0_t is None else x0_t), 0

    res_cb = x_cb = None
    x_cb_cycles = False
    if callback is not None:
        if method == "gmres" and callback_type in ("pr_norm", "legacy"):
            res_cb = (lambda r: callback(float(r / bnorm))) if bnorm > 0 else (lambda r: None)
        else:
            x_cb = callback
            x_cb_cycles = method == "gmres"
    if sys_.dA is not None and x_cb is None:
        x, sinfo = _delegate(method, sys_, b_t, x0_t, atol_eff, maxiter_inner, restart, res_cb, backend)
        if sinfo.backend != "torch" and (sinfo.converged or info_code(sinfo, maxiter) == BREAKDOWN):
            # SciPy's contract is info == 0 iff ||b - A x|| <= max(tol ||b||, atol). PETSc may
            # accept a residual at its rounding floor just above that, and its breakdown
            # iterate is not the least-squares one SciPy's tests expect: the native kernel
            # continues from PETSc's x (floor) or restarts from x0 (breakdown)
            ok = sinfo.converged and _norm(sys_, b_t - sys_.op(x)) <= atol_eff
            if not ok:
                start = x if sinfo.converged else x0_t
                x, sinfo = _kernel(method, sys_, b_t, start, atol_eff, maxiter_inner, restart, res_cb,
                                   None, False)
    else:
        x, sinfo = _kernel(method, sys_, b_t, x0_t, atol_eff, maxiter_inner, restart, res_cb, x_cb,
                           x_cb_cycles, relative)
    info = info_code(sinfo, maxiter)
    if show and ccomm.Get_rank() == 0:
        print(f"{name}: {sinfo.summary()}", flush=True)
    return sys_.output(x), info


def _check_symmetric(sys_) -> None:
    """Collective. SciPy's ``minres(check=True)``: ``ValueError`` for a nonsymmetric
    ``A`` or ``M`` (``|y^T A x - x^T A y|`` against ``eps^(1/3)`` relative, as SciPy)."""
    g = torch.Generator().manual_seed(1234 + sys_.r0)
    x = torch.rand(sys_.r1 - sys_.r0, generator=g, dtype=sys_.dtype)
    y = torch.rand(sys_.r1 - sys_.r0, generator=g, dtype=sys_.dtype)
    eps = float(torch.finfo(sys_.dtype).eps) ** (1.0 / 3.0)
    for what, F in (("matrix", sys_.op), ("preconditioner", sys_.M)):
        if F is None:
            continue
        Fx, Fy = F(x), F(y)
        v = torch.stack([torch.dot(y, Fx), torch.dot(x, Fy), torch.dot(Fx, Fx), torch.dot(y, y)]).to(torch.float64)
        if sys_.comm.Get_size() > 1:
            v = allreduce_sum(sys_.comm, v)
        s, t, z, yy = v.tolist()
        if abs(s - t) > eps * (abs(s) + abs(t) + 1e-300) and abs(s - t) > eps * math.sqrt(z * yy):
            raise ValueError(f"minres: non-symmetric {what} (check=True)")


def cg(A, b, x0=None, tol=1e-05, maxiter=None, M=None, callback=None, atol=None, *,
       rtol: Optional[float] = None, comm: Optional[MPI.Comm] = None, local: bool = False,
       backend: Optional[str] = None):
    """Collective. :func:`scipy.sparse.linalg.cg`: conjugate gradients, ``(x, info)``.

    SciPy 1.10's signature and meaning (see :mod:`slasolve.linalg` for ``rtol``,
    ``comm``, ``local``, ``backend`` and the differences).
    """
    return _krylov("cg", A, b, x0, tol, maxiter, M, callback, rtol=rtol, atol=atol, has_atol=True,
                   comm=comm, local=local, backend=backend)


def bicgstab(A, b, x0=None, tol=1e-05, maxiter=None, M=None, callback=None, atol=None, *,
             rtol: Optional[float] = None, comm: Optional[MPI.Comm] = None, local: bool = False,
             backend: Optional[str] = None):
    """Collective. :func:`scipy.sparse.linalg.bicgstab`: BiCGStab, ``(x, info)``.

    SciPy 1.10's signature and meaning (see :mod:`slasolve.linalg`).
    """
    return _krylov("bicgstab", A, b, x0, tol, maxiter, M, callback, rtol=rtol, atol=atol, has_atol=True,
                   comm=comm, local=local, backend=backend)


def cgs(A, b, x0=None, tol=1e-05, maxiter=None, M=None, callback=None, atol=None, *,
        rtol: Optional[float] = None, comm: Optional[MPI.Comm] = None, local: bool = False,
        backend: Optional[str] = None):
    """Collective. :func:`scipy.sparse.linalg.cgs`: conjugate gradients squared, ``(x, info)``.

    SciPy 1.10's signature and meaning (see :mod:`slasolve.linalg`). Right
    preconditioning: the tested residual is unpreconditioned.
    """
    return _krylov("cgs", A, b, x0, tol, maxiter, M, callback, rtol=rtol, atol=atol, has_atol=True,
                   comm=comm, local=local, backend=backend)


def tfqmr(A, b, x0=None, tol=1e-05, maxiter=None, M=None, callback=None, atol=None, show=False, *,
          rtol: Optional[float] = None, comm: Optional[MPI.Comm] = None, local: bool = False,
          backend: Optional[str] = None):
    """Collective. :func:`scipy.sparse.linalg.tfqmr`: transpose-free QMR, ``(x, info)``.

    SciPy 1.10's signature and meaning: the test is ``||b - A x|| <= max(atol,
    tol ||b - A x0||)`` (relative to the initial residual, ``atol`` default 0; slasolve
    takes the smaller of ``||b - A x0||`` and ``||b||``, so a converged answer also meets
    ``tol ||b||``),
    ``maxiter`` (default ``min(10000, 10 n)``) counts half-steps, ``show`` prints a
    summary. SciPy stops when TFQMR's residual bound passes; slasolve then checks the
    true residual and continues if it does not (see :mod:`slasolve.linalg`).
    """
    return _krylov("tfqmr", A, b, x0, tol, maxiter, M, callback, rtol=rtol,
                   atol=0.0 if atol is None else atol, has_atol=True,
                   comm=comm, local=local, backend=backend, show=show, relative_to_r0=True)


def gmres(A, b, x0=None, tol=1e-05, restart=None, maxiter=None, M=None, callback=None, restrt=None,
          atol=None, callback_type=None, *, rtol: Optional[float] = None, comm: Optional[MPI.Comm] = None,
          local: bool = False, backend: Optional[str] = None):
    """Collective. :func:`scipy.sparse.linalg.gmres`: restarted GMRES, ``(x, info)``.

    SciPy 1.10's signature and meaning: ``restart`` (default 20), ``maxiter`` counts
    restart cycles (inner iterations with ``callback_type='legacy'``), ``callback``
    receives the iterate at the end of each cycle (``'x'``) or the residual norm
    relative to ``||b||`` after each inner iteration (``'pr_norm'``, ``'legacy'``, the
    default with a DeprecationWarning as SciPy 1.10). The deprecated ``restrt`` is
    accepted as there. Right preconditioning: the reported residual is unpreconditioned
    (SciPy's left-preconditioned GMRES reports ``||M r||``). See :mod:`slasolve.linalg`.
    """
    if restrt is not None:
        if restart is not None:
            raise ValueError("Cannot specify both restart and restrt keywords. Preferably use 'restart' only.")
        warnings.warn("'gmres' keyword argument 'restrt' is deprecated infavour of 'restart' and will be "
                      "removed in SciPy 1.12.0.", DeprecationWarning, stacklevel=2)
        restart = restrt
    if callback is not None and callback_type is None:
        warnings.warn("scipy.sparse.linalg.gmres called without specifying `callback_type`. "
                      "The default value will be changed in a future release. "
                      "For compatibility, specify a value for `callback_type` explicitly, e.g., "
                      "``{name}(..., callback_type='pr_norm')``, or to retain the old behavior "
                      "``{name}(..., callback_type='legacy')``", category=DeprecationWarning, stacklevel=2)
    if callback_type is None:
        callback_type = "legacy"
    if callback_type not in ("x", "pr_norm", "legacy"):
        raise ValueError(f"Unknown callback_type: {callback_type!r}")
    return _krylov("gmres", A, b, x0, tol, maxiter, M, callback, rtol=rtol, atol=atol, has_atol=True,
                   comm=comm, local=local, backend=backend, restart=restart, callback_type=callback_type)


def minres(A, b, x0=None, shift=0.0, tol=1e-05, maxiter=None, M=None, callback=None, show=False,
           check=False, *, rtol: Optional[float] = None, comm: Optional[MPI.Comm] = None,
           local: bool = False, backend: Optional[str] = None):
    """Collective. :func:`scipy.sparse.linalg.minres`: MINRES for symmetric ``A - shift I``.

    SciPy 1.10's signature (no ``atol``; default ``maxiter`` ``5 n``). The stopping
    test is ``||b - (A - shift I) x|| <= tol ||b||`` (SciPy's MINRES stops on its own
    estimates relative to ``||A|| ||x|| + ||b||``, a weaker test). ``check=True``
    raises ``ValueError`` for a nonsymmetric ``A`` or ``M``; ``show=True`` prints a
    one-line summary on rank 0. See :mod:`slasolve.linalg`.
    """
    if not isinstance(shift, Real) or isinstance(shift, bool):
        raise TypeError(f"minres: shift must be a real number, got {type(shift).__name__}")
    return _krylov("minres", A, b, x0, tol, maxiter, M, callback, rtol=rtol, atol=None, has_atol=False,
                   comm=comm, local=local, backend=backend, shift=shift, check=check, show=show)
