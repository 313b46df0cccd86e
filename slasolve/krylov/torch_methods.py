"""Native torch Krylov kernels: :func:`cg`, :func:`gmres`, :func:`minres`, :func:`bicgstab`,
:func:`cgs`, :func:`tfqmr`.

The kernels know nothing about matrices or MPI. They receive callables:

* ``matvec(x) -> A @ x`` and ``M(r) -> z`` (preconditioner apply; ``None`` is the
  identity), both mapping a tensor shaped like ``b`` to the same shape;
* ``reduce_sum(t) -> t`` summing a small 1-D tensor over all ranks (default:
  identity, i.e. one rank).

``b`` is a 1-D tensor holding the rank's owned rows, so the same code runs on
one rank or many, on any torch device and floating dtype (float32/float64).

**Collective.** When ``reduce_sum`` communicates, every rank must call the
kernel with the same arguments (and its own rows). All decisions (convergence,
breakdown, iteration count) are taken from *reduced* scalars, so every rank
takes the same decision at the same iteration. The kernels never raise on a
numerical failure: they return the iterate and a :class:`SolveInfo` whose
``reason`` says what happened, and the caller decides (the public API raises
:class:`ConvergenceError` on every rank unless asked not to).

**Convergence test** (SciPy's, and PETSc's ``KSPConvergedDefault`` with
``KSP_NORM_UNPRECONDITIONED``): stop as soon as the unpreconditioned residual
norm ``||b - A x||_2`` carried by the method's recurrence satisfies
``||r|| <= max(rtol * ||b||, atol)``. Reason ``CONVERGED_ATOL`` when
``atol > 0`` and ``||r|| <= atol``, else ``CONVERGED_RTOL``. ``b == 0`` returns
``x = 0`` at once (converged, 0 iterations, even if ``x0`` was given). The
initial guess is checked first (0 iterations when it already satisfies the
test). ``iterations`` counts Krylov iterations as PETSc does.

**maxiter** default: ``max(10 * n_global, 10_000)``, the larger of SciPy's ``10 n`` and
PETSc's default ``max_it``, so a solve either of them finishes with its defaults is not
cut short (:func:`default_maxiter`; GMRES through :func:`slasolve.solve` counts SciPy's
``10 n`` in restart cycles). Reaching it gives ``DIVERGED_ITS``.

**Failures reported** (``SolveInfo.reason``): ``DIVERGED_NANORINF`` (NaN/Inf in
a residual or inner product), ``DIVERGED_INDEFINITE_MAT`` (CG: ``p^T A p <= 0``),
``DIVERGED_INDEFINITE_PC`` (CG/MINRES: ``r^T M r < 0``), ``DIVERGED_BREAKDOWN``
(BiCGStab ``rho == 0``, ``r^T v == 0``, ``omega == 0``; GMRES singular
least-squares; ``r^T M r == 0`` with a nonzero residual), ``DIVERGED_ITS``.

**Communication per iteration** (reductions / host synchronisations):

* CG: 2 reductions (``p.Ap``; then ``[r.r, r.z]`` fused), 1 host sync. This is
  the classical Hestenes-Stiefel recurrence; the one-reduction
  Chronopoulos-Gear variant is *not* used because its recurrences lose
  accuracy on ill-conditioned problems and can stall before ``rtol``. (PETSc's
  CG with the unpreconditioned norm does 3: ``p.Ap``, ``||r||``, ``r.z``.) On
  the CPU (float32/float64) the scalars are host floats and the vector work is
  BLAS level 1 on NumPy views of preallocated tensors (see :func:`cg`): at
  small local sizes the per-iteration cost is per-call overhead, and a BLAS
  call through SciPy costs about half a torch operation
  (``bench/torch_overhead.py``).
* MINRES: 2 reductions (``v.Av``; then ``[r2.z2, r.r, r.u, u.u]`` fused), 1 host
  sync. The true-residual recurrence ``r_k = r_{k-1} - c_k A w_k`` is carried
  alongside the Paige-Saunders recurrence (no extra matvec) so the test is on
  the unpreconditioned norm even with a preconditioner; its norm is obtained
  from the fused inner products, with an exact extra reduction only when the
  expansion suffers cancellation (sudden convergence).
* GMRES: 2 reductions (classical Gram-Schmidt with one re-orthogonalisation,
  CGS2, the norm fused into the second), 1 host sync, plus one matvec and one
  reduction per restart cycle for the true residual. RIGHT preconditioning, so
  the Arnoldi estimate is the unpreconditioned residual; a cycle that the
  estimate declares converged is confirmed with the true residual (as SciPy
  does) and restarted otherwise. ``maxiter`` counts inner iterations (PETSc's
  convention; SciPy counts restart cycles).
* BiCGStab: 3 reductions (``rhat.v``; ``[s.s, t.s, t.t]``; ``[r.r, rhat.r]``),
  2 host syncs. Right preconditioning; the half-step residual ``s`` is tested
  too (counted as a full iteration, as SciPy and PETSc do).

``callback(iteration, residual_norm)`` is called on every rank after every
iteration ``k >= 1`` with the (reduced, hence identical) residual norm; for
GMRES this is the Arnoldi estimate. ``residual_history`` (when
``record_history=True``) holds the initial residual followed by the same
values.

The kernels run under ``torch.no_grad()``: gradients of a solve are obtained by
the adjoint method (``slasolve.autograd``), never by unrolling iterations.
Real dtypes only.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional

import numpy as np
import torch

from .info import SolveInfo

__all__ = ["cg", "gmres", "minres", "bicgstab", "cgs", "tfqmr", "default_maxiter"]

Tensor = torch.Tensor
#: PETSc's default ``max_it``: the smallest default iteration budget
MAXITER_FLOOR = 10_000


def default_maxiter(n_global: int, restart: int = 1) -> int:
    """Local. ``max(10 * n_global * restart, 10_000)``: SciPy's default (``10 n`` iterations;
    for GMRES ``10 n`` restart cycles of ``restart`` inner iterations) or PETSc's
    (``max_it`` 10000), whichever allows more."""
    return max(10 * int(n_global) * max(1, int(restart)), MAXITER_FLOOR)


def _identity(t: Tensor) -> Tensor:
    return t


def _fin(*vals: float) -> bool:
    return all(math.isfinite(v) for v in vals)


def _sqrt(v: float) -> float:
    """sqrt of a reduced squared norm; NaN stays NaN, rounding below 0 gives 0."""
    if v != v:
        return float("nan")
    return math.sqrt(v) if v > 0 else 0.0


class _Run:
    """Book-keeping shared by the kernels: tolerance, history, callback, info."""

    def __init__(self, method, b, x0, matvec, reduce_sum, rtol, atol, maxiter,
                 callback, record_history):
        self.t0 = time.perf_counter()
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"{method}: b must be a torch.Tensor, got {type(b).__name__}")
        if b.ndim != 1:
            raise ValueError(f"{method}: b must be 1-D (the rank's owned rows), got shape {tuple(b.shape)}")
        if not b.is_floating_point():
            raise TypeError(f"{method}: b must have a real floating dtype, got {b.dtype}")
        if not (rtol >= 0 and atol >= 0):
            raise ValueError(f"{method}: rtol and atol must be >= 0, got rtol={rtol}, atol={atol}")
        if maxiter is not None and int(maxiter) < 0:
            raise ValueError(f"{method}: maxiter must be >= 0, got {maxiter}")
        if x0 is not None:
            if not isinstance(x0, torch.Tensor):
                x0 = torch.as_tensor(x0)
            if tuple(x0.shape) != tuple(b.shape):
                raise ValueError(f"{method}: x0 has shape {tuple(x0.shape)}, expected {tuple(b.shape)}")
        self.method = method
        self.b = b
        self.rtol = float(rtol)
        self.atol = float(atol)
        self.maxiter_arg = maxiter
        self.callback = callback
        self.history = [] if record_history else None
        self.reduce = reduce_sum if reduce_sum is not None else _identity
        self.matvec = matvec
        if x0 is None:
            self.x = torch.zeros_like(b)
            self.r = b.clone()
        else:
            self.x = x0.detach().to(dtype=b.dtype, device=b.device).clone()
            self.r = b - matvec(self.x)
        self.tol = 0.0
        self.maxiter = 0
        self.rnorm = float("nan")

    def nloc(self) -> Tensor:
        return self.b.new_tensor([float(self.b.numel())])

    def start(self, bb: float, rr: float, n_global: float):
        """Process the setup reduction. Returns a finished SolveInfo or None."""
        bnorm = _sqrt(bb)
        self.bnorm = bnorm
        self.tol = max(self.rtol * bnorm, self.atol) if math.isfinite(bnorm) else 0.0
        self.maxiter = (default_maxiter(int(round(n_global))) if self.maxiter_arg is None
                        else int(self.maxiter_arg))
        if not _fin(bb):
            self.rnorm = float("nan")
            return self.finish("DIVERGED_NANORINF", 0)
        if bnorm == 0.0:
            self.x = torch.zeros_like(self.b)
            self.rnorm = 0.0
            if self.history is not None:
                self.history.append(0.0)
            return self.finish("CONVERGED_ATOL", 0)
        self.rnorm = _sqrt(rr)
        if self.history is not None:
            self.history.append(self.rnorm)
        if not _fin(rr):
            return self.finish("DIVERGED_NANORINF", 0)
        if self.rnorm <= self.tol:
            return self.finish(self.conv_reason(self.rnorm), 0)
        return None

    def conv_reason(self, rnorm: float) -> str:
        return "CONVERGED_ATOL" if (self.atol > 0 and rnorm <= self.atol) else "CONVERGED_RTOL"

    def step(self, k: int, rnorm: float):
        self.rnorm = rnorm
        if self.history is not None:
            self.history.append(rnorm)
        if self.callback is not None:
            self.callback(k, rnorm)

    def nan(self, k: int) -> SolveInfo:
        """A NaN or Inf at iteration ``k``: reported (history, callback), then DIVERGED_NANORINF."""
        self.step(k, float("nan"))
        return self.finish("DIVERGED_NANORINF", k)

    def finish(self, reason: str, its: int, rnorm: Optional[float] = None) -> SolveInfo:
        if rnorm is not None:
            self.rnorm = rnorm
        return SolveInfo(
            converged=reason.startswith("CONVERGED"), reason=reason, iterations=int(its),
            residual_norm=float(self.rnorm), residual_history=self.history,
            setup_time=0.0, solve_time=time.perf_counter() - self.t0,
            method=self.method, backend="torch", rtol=self.rtol, atol=self.atol)


def _dots(pairs) -> Tensor:
    return torch.stack([torch.dot(a, c) for a, c in pairs])


# --------------------------------------------------------------------------- CG
def _host_reducer(red):
    """``hsum(t, a) -> list``: sum a 1-D CPU tensor ``t`` (NumPy view ``a``) over the ranks.

    A ``reduce_sum`` with a ``host_inplace(ndarray)`` attribute (an in-place
    Allreduce, as the torch backend passes) sums ``a`` in place: no tensor is
    created per reduction. One rank (``reduce_sum`` None): just the values."""
    inplace = getattr(red, "host_inplace", None)
    if red is _identity:
        return lambda t, a: a.tolist()
    if inplace is not None:
        def hsum(t: Tensor, a) -> list:
            inplace(a)
            return a.tolist()
        return hsum
    return lambda t, a: red(t).tolist()


_SMALL_N = 1 << 15   # CG's p update: below, scal + axpy (call cost); above, one torch pass


def _blas1(b: Tensor):
    """``(dot, axpy, scal)`` of SciPy's BLAS for ``b``'s dtype on NumPy views of CPU
    tensors, or None (other dtypes and devices). At the local sizes where a CG
    iteration costs microseconds these calls cost about half the torch operations
    doing the same (per-call dispatch), and no more at 10^6 rows."""
    if b.device.type != "cpu" or b.dtype not in (torch.float32, torch.float64) or b.numel() > 2**31 - 1:
        return None
    try:
        from scipy.linalg import blas
    except ImportError:  # pragma: no cover - SciPy is a dependency
        return None
    if b.numel() == 0:   # BLAS wrappers refuse empty arrays: a rank owning no rows
        return (lambda u, v: 0.0), (lambda u, v, a=1.0: v), (lambda a, u: u)
    t = "d" if b.dtype == torch.float64 else "s"
    return getattr(blas, t + "dot"), getattr(blas, t + "axpy"), getattr(blas, t + "scal")


@torch.no_grad()
def cg(matvec: Callable[[Tensor], Tensor], b: Tensor, *, x0: Optional[Tensor] = None,
       rtol: float = 1e-5, atol: float = 0.0, maxiter: Optional[int] = None,
       M: Optional[Callable[[Tensor], Tensor]] = None,
       reduce_sum: Optional[Callable[[Tensor], Tensor]] = None,
       callback: Optional[Callable[[int, float], None]] = None,
       record_history: bool = False) -> tuple[Tensor, SolveInfo]:
    """Preconditioned conjugate gradients for SPD ``A`` (and SPD ``M``).

    Collective over the ranks ``reduce_sum`` spans. Classical (Hestenes-Stiefel)
    recurrence with 2 reductions and 1 host synchronisation per iteration.
    Returns ``(x, info)``; see the module docstring for the conventions.

    On the CPU (float32/float64) the scalars live on the host (a host
    "synchronisation" is free there) and the vector work is BLAS level 1 on
    NumPy views of preallocated tensors: per iteration the product, ``p.q``,
    two ``axpy``, the Jacobi product (a preconditioner with an ``inv_diag``
    attribute) into preallocated storage, ``r.r`` and ``r.z`` (one reduction),
    ``p = z + beta p`` (``scal`` + ``axpy`` below 32768 local rows, else one torch
    pass: at sizes where memory traffic dominates, one pass over ``p`` beats two). The product is ``apply()`` of an
    operator bound once to the storage of ``p`` and ``q = A p``
    (``matvec.bind(pe, q)`` with ``p = pe[:n]``, ``pe`` of ``n +
    matvec.ghost_slots`` entries: see ``torch_operator``), or ``matvec(p,
    out=q)`` when it takes ``out`` (a ``supports_out`` attribute). Elsewhere the step length stays on the device.
    """
    run = _Run("cg", b, x0, matvec, reduce_sum, rtol, atol, maxiter, callback, record_history)
    ops = _blas1(b)
    if ops is None:
        return _cg_device(run, M)
    x, info = _cg_host(run, M, ops)
    return (x.clone() if x._base is not None else x), info   # x is a row of the workspace


def _cg_host(run: "_Run", M, ops) -> tuple[Tensor, SolveInfo]:
    dot, axpy, scal = ops
    b, matvec = run.b, run.matvec
    n = b.numel()
    W = b.new_empty((2 if M is None else 3, n))   # rows x, r (, z)
    W[0].copy_(run.x)
    W[1].copy_(run.r)
    x, r = W[0], W[1]
    run.x = x
    xn, rn = x.numpy(), r.numpy()
    bn = b.contiguous().numpy()
    red = run.reduce
    one = red is _identity
    hsum = _host_reducer(red)
    v1, v2, v4 = b.new_empty(1), b.new_empty(2), b.new_empty(4)
    a1, a2, a4 = v1.numpy(), v2.numpy(), v4.numpy()
    dn = None
    if M is None:
        z, zn = r, rn
        a4[:3] = dot(bn, bn), dot(rn, rn), n
        bb, rr, ng = hsum(v4[:3], a4[:3])
        rz = rr
    else:
        z = W[2]
        zn = z.numpy()
        inv_diag = getattr(M, "inv_diag", None)
        if inv_diag is not None:
            dn = inv_diag(b.dtype, b.device).contiguous().numpy()
            np.multiply(rn, dn, out=zn)
        else:
            z.copy_(M(r))
        a4[:] = dot(bn, bn), dot(rn, rn), dot(rn, zn), n
        bb, rr, rz, ng = hsum(v4, a4)
    done = run.start(bb, rr, ng)
    if done is not None:
        return run.x, done
    if not _fin(rz):
        return x, run.finish("DIVERGED_NANORINF", 0)
    if rz < 0:
        return x, run.finish("DIVERGED_INDEFINITE_PC", 0)
    if rz == 0:
        return x, run.finish("DIVERGED_BREAKDOWN", 0)
    q = b.new_empty(n)
    bind = getattr(matvec, "bind", None)
    if bind is not None:      # p lives in the operator's extended vector [p | ghosts]
        pe = b.new_empty(n + int(matvec.ghost_slots))
        p = pe[:n]
        apply = bind(pe, q)
    else:
        p = b.new_empty(n)
        if getattr(matvec, "supports_out", False):
            def apply() -> None:
                matvec(p, out=q)
        else:
            def apply() -> None:
                q.copy_(matvec(p))
    p.copy_(z)
    pn, qn = p.numpy(), q.numpy()
    if n < _SMALL_N:      # per-call cost dominates: two BLAS calls beat one torch call
        def update_p(beta: float) -> None:   # p = z + beta p
            scal(beta, pn)
            axpy(zn, pn)
    else:                 # memory traffic dominates: one pass over p
        add = torch.add

        def update_p(beta: float) -> None:
            add(z, p, alpha=beta, out=p)
    tol, isfinite, mul, sqrt = run.tol, math.isfinite, np.multiply, math.sqrt
    quiet = run.history is None and run.callback is None
    for k in range(1, run.maxiter + 1):
        apply()                                # q = A p
        if one:
            pap = dot(pn, qn)
        else:
            a1[0] = dot(pn, qn)
            pap = hsum(v1, a1)[0]
        alpha = rz / pap if pap > 0 else 0.0   # 0 on failure (NaN too): x, r untouched
        axpy(pn, xn, a=alpha)                  # x += alpha p
        axpy(qn, rn, a=-alpha)                 # r -= alpha q
        if M is None:
            if one:
                rr = dot(rn, rn)
            else:
                a1[0] = dot(rn, rn)
                rr = hsum(v1, a1)[0]
            rz_new = rr
        else:
            if dn is not None:
                mul(rn, dn, out=zn)
            else:
                z.copy_(M(r))
            if one:
                rr, rz_new = dot(rn, rn), dot(rn, zn)
            else:
                a2[0], a2[1] = dot(rn, rn), dot(rn, zn)
                rr, rz_new = hsum(v2, a2)
        if not (isfinite(pap) and isfinite(rr) and isfinite(rz_new)):
            run.step(k, _sqrt(rr) if isfinite(rr) else float("nan"))
            return x, run.finish("DIVERGED_NANORINF", k)
        if pap <= 0:
            return x, run.finish("DIVERGED_INDEFINITE_MAT", k)
        rnorm = sqrt(rr)
        if quiet:
            run.rnorm = rnorm
        else:
            run.step(k, rnorm)
        if rnorm <= tol:
            return x, run.finish(run.conv_reason(rnorm), k)
        if rz_new < 0:
            return x, run.finish("DIVERGED_INDEFINITE_PC", k)
        if rz_new == 0:
            return x, run.finish("DIVERGED_BREAKDOWN", k)
        update_p(rz_new / rz)
        rz = rz_new
    return x, run.finish("DIVERGED_ITS", run.maxiter)


def _cg_device(run: "_Run", M) -> tuple[Tensor, SolveInfo]:
    """CG with the step lengths kept on the device (no host synchronisation for ``p^T A p``)."""
    b, matvec = run.b, run.matvec
    x, r, red = run.x, run.r, run.reduce
    z = r if M is None else M(r)
    if M is None:
        v = red(torch.cat([_dots([(b, b), (r, r)]), run.nloc()]))
        bb, rr, ng = v.tolist()
        rz_t, rz = v[1], rr
    else:
        v = red(torch.cat([_dots([(b, b), (r, r), (r, z)]), run.nloc()]))
        bb, rr, rz, ng = v.tolist()
        rz_t = v[2]
    done = run.start(bb, rr, ng)
    if done is not None:
        return run.x, done
    if not _fin(rz):
        return x, run.finish("DIVERGED_NANORINF", 0)
    if rz < 0:
        return x, run.finish("DIVERGED_INDEFINITE_PC", 0)
    if rz == 0:
        return x, run.finish("DIVERGED_BREAKDOWN", 0)
    p = z.clone()
    zero = b.new_zeros(())
    for k in range(1, run.maxiter + 1):
        q = matvec(p)
        pap_t = red(torch.dot(p, q).reshape(1))[0]
        alpha = torch.where(pap_t > 0, rz_t / pap_t, zero)  # 0 on failure: x, r untouched
        x.addcmul_(p, alpha)
        r.addcmul_(q, -alpha)
        if M is None:
            z = r
            v = red(torch.dot(r, r).reshape(1))
            pap, rr = torch.cat([pap_t.reshape(1), v]).tolist()
            rz_new_t, rz_new = v[0], rr
        else:
            z = M(r)
            v = red(_dots([(r, r), (r, z)]))
            pap, rr, rz_new = torch.cat([pap_t.reshape(1), v]).tolist()
            rz_new_t = v[1]
        if not _fin(pap, rr, rz_new):
            run.step(k, _sqrt(rr) if _fin(rr) else float("nan"))
            return x, run.finish("DIVERGED_NANORINF", k)
        if pap <= 0:
            return x, run.finish("DIVERGED_INDEFINITE_MAT", k)
        rnorm = _sqrt(rr)
        run.step(k, rnorm)
        if rnorm <= run.tol:
            return x, run.finish(run.conv_reason(rnorm), k)
        if rz_new < 0:
            return x, run.finish("DIVERGED_INDEFINITE_PC", k)
        if rz_new == 0:
            return x, run.finish("DIVERGED_BREAKDOWN", k)
        beta = rz_new_t / rz_t
        p.mul_(beta).add_(z)
        rz_t = rz_new_t
    return x, run.finish("DIVERGED_ITS", run.maxiter)


# ----------------------------------------------------------------------- MINRES
@torch.no_grad()
def minres(matvec: Callable[[Tensor], Tensor], b: Tensor, *, x0: Optional[Tensor] = None,
           rtol: float = 1e-5, atol: float = 0.0, maxiter: Optional[int] = None,
           M: Optional[Callable[[Tensor], Tensor]] = None,
           reduce_sum: Optional[Callable[[Tensor], Tensor]] = None,
           callback: Optional[Callable[[int, float], None]] = None,
           record_history: bool = False) -> tuple[Tensor, SolveInfo]:
    """MINRES (Paige-Saunders) for symmetric, possibly indefinite ``A``; ``M`` must be SPD.

    Collective over the ranks ``reduce_sum`` spans. 2 reductions and 1 host
    synchronisation per iteration; the convergence test is on the
    unpreconditioned residual (carried by its own recurrence, no extra matvec).
    Returns ``(x, info)``.
    """
    run = _Run("minres", b, x0, matvec, reduce_sum, rtol, atol, maxiter, callback, record_history)
    x, red = run.x, run.reduce
    rt = run.r                       # true-recurrence residual b - A x
    r1 = rt.clone()
    y = r1 if M is None else M(r1)
    v0 = red(torch.cat([_dots([(b, b), (rt, rt), (r1, y)]), run.nloc()]))
    bb, rr, betasq, ng = v0.tolist()
    done = run.start(bb, rr, ng)
    if done is not None:
        return run.x, done
    if not _fin(betasq):
        return x, run.finish("DIVERGED_NANORINF", 0)
    if betasq < 0:
        return x, run.finish("DIVERGED_INDEFINITE_PC", 0)
    if betasq == 0:
        return x, run.finish("DIVERGED_BREAKDOWN", 0)
    eps = float(torch.finfo(b.dtype).eps)
    beta1 = math.sqrt(betasq)
    oldb, beta, dbar, epsln, phibar, cs, sn = 0.0, beta1, 0.0, 0.0, beta1, -1.0, 0.0
    r2 = r1
    w1 = torch.zeros_like(b)   # w_{k-2}
    w2 = torch.zeros_like(b)   # w_{k-1}
    aw1 = torch.zeros_like(b)  # A w_{k-2}
    aw2 = torch.zeros_like(b)  # A w_{k-1}
    for k in range(1, run.maxiter + 1):
        vk = y / beta
        av = matvec(vk)
        yk = av - (beta / oldb) * r1 if k >= 2 else av
        alfa_t = red(torch.dot(vk, yk).reshape(1))
        yk = yk - (alfa_t / beta) * r2
        r1, r2 = r2, yk
        y = r2 if M is None else M(r2)
        oldeps = epsln
        delta_t = cs * dbar + sn * alfa_t          # 1-element tensor (device)
        u = av - oldeps * aw1 - delta_t * aw2        # gamma * A w_k
        uv = vk - oldeps * w1 - delta_t * w2         # gamma * w_k
        v2 = red(_dots([(r2, y), (rt, rt), (rt, u), (u, u)]))
        alfa, betasq, rtrt, rtu, uu = torch.cat([alfa_t, v2]).tolist()
        if not _fin(alfa, betasq, rtrt, rtu, uu):
            return x, run.nan(k)
        if betasq < 0:
            return x, run.finish("DIVERGED_INDEFINITE_PC", k, _sqrt(rtrt))
        oldb, beta = beta, math.sqrt(betasq)
        delta = cs * dbar + sn * alfa
        gbar = sn * dbar - cs * alfa
        epsln = sn * beta
        dbar = -cs * beta
        gamma = max(math.hypot(gbar, beta), eps)
        cs, sn = gbar / gamma, beta / gamma
        phi = cs * phibar
        phibar = sn * phibar
        c = phi / gamma
        x.add_(uv, alpha=c)
        rt.add_(u, alpha=-c)
        rr_new = rtrt - 2.0 * c * rtu + c * c * uu
        if rr_new <= 1e3 * eps * rtrt:   # cancellation: measure it exactly
            rr_new = red(torch.dot(rt, rt).reshape(1)).tolist()[0]
        rnorm = _sqrt(rr_new)
        run.step(k, rnorm)
        if not _fin(rnorm):
            return x, run.finish("DIVERGED_NANORINF", k)
        if rnorm <= run.tol:
            return x, run.finish(run.conv_reason(rnorm), k)
        if beta == 0.0:
            return x, run.finish("DIVERGED_BREAKDOWN", k)
        w1, w2 = w2, uv.div_(gamma)
        aw1, aw2 = aw2, u.div_(gamma)
    return x, run.finish("DIVERGED_ITS", run.maxiter)


# -------------------------------------------------------------------- BiCGStab
@torch.no_grad()
def bicgstab(matvec: Callable[[Tensor], Tensor], b: Tensor, *, x0: Optional[Tensor] = None,
             rtol: float = 1e-5, atol: float = 0.0, maxiter: Optional[int] = None,
             M: Optional[Callable[[Tensor], Tensor]] = None,
             reduce_sum: Optional[Callable[[Tensor], Tensor]] = None,
             callback: Optional[Callable[[int, float], None]] = None,
             record_history: bool = False) -> tuple[Tensor, SolveInfo]:
    """BiCGStab (van der Vorst) with RIGHT preconditioning, for general ``A``.

    Collective over the ranks ``reduce_sum`` spans. 3 reductions and 2 host
    synchronisations per iteration (each sync is also a convergence test: the
    half-step residual ``s`` and the full residual ``r``). Returns ``(x, info)``.
    """
    run = _Run("bicgstab", b, x0, matvec, reduce_sum, rtol, atol, maxiter, callback, record_history)
    x, r, red = run.x, run.r, run.reduce
    v0 = red(torch.cat([_dots([(b, b), (r, r)]), run.nloc()]))
    bb, rr, ng = v0.tolist()
    done = run.start(bb, rr, ng)
    if done is not None:
        return run.x, done
    rhat = r.clone()
    rho_t, rho = v0[1], rr           # rhat . r0 = ||r0||^2
    rho_old, alpha, omega = 1.0, 1.0, 1.0
    p = torch.zeros_like(b)
    v = torch.zeros_like(b)
    for k in range(1, run.maxiter + 1):
        beta = (rho / rho_old) * (alpha / omega)
        p.sub_(v, alpha=omega).mul_(beta).add_(r)
        phat = p if M is None else M(p)
        v = matvec(phat)
        rv_t = red(torch.dot(rhat, v).reshape(1))
        alpha_t = rho_t / rv_t
        s = r - alpha_t * v
        shat = s if M is None else M(s)
        t = matvec(shat)
        w = red(_dots([(s, s), (t, s), (t, t)]))
        rv, ss, ts, tt = torch.cat([rv_t, w]).tolist()
        if rv == 0.0:                 # alpha undefined (s, t are garbage): x untouched
            return x, run.finish("DIVERGED_BREAKDOWN", k)
        if not _fin(rv, ss, ts, tt):
            return x, run.nan(k)
        alpha = rho / rv
        snorm = _sqrt(ss)
        if snorm <= run.tol:
            x.add_(phat, alpha=alpha)
            run.step(k, snorm)
            return x, run.finish(run.conv_reason(snorm), k)
        if tt == 0.0:
            x.add_(phat, alpha=alpha)
            run.step(k, snorm)
            return x, run.finish("DIVERGED_BREAKDOWN", k)
        omega = ts / tt
        x.add_(phat, alpha=alpha).add_(shat, alpha=omega)
        r = s.sub_(t, alpha=omega)
        w = red(_dots([(r, r), (rhat, r)]))
        rr, rho_new = w.tolist()
        if not _fin(rr, rho_new):
            return x, run.nan(k)
        rnorm = _sqrt(rr)
        run.step(k, rnorm)
        if rnorm <= run.tol:
            return x, run.finish(run.conv_reason(rnorm), k)
        if omega == 0.0 or rho_new == 0.0:
            return x, run.finish("DIVERGED_BREAKDOWN", k)
        rho_old, rho, rho_t = rho, rho_new, w[1]
    return x, run.finish("DIVERGED_ITS", run.maxiter)


# -------------------------------------------------------------------------- CGS
@torch.no_grad()
def cgs(matvec: Callable[[Tensor], Tensor], b: Tensor, *, x0: Optional[Tensor] = None,
        rtol: float = 1e-5, atol: float = 0.0, maxiter: Optional[int] = None,
        M: Optional[Callable[[Tensor], Tensor]] = None,
        reduce_sum: Optional[Callable[[Tensor], Tensor]] = None,
        callback: Optional[Callable[[int, float], None]] = None,
        record_history: bool = False) -> tuple[Tensor, SolveInfo]:
    """Conjugate gradients squared (Sonneveld) with RIGHT preconditioning, for general ``A``.

    Collective over the ranks ``reduce_sum`` spans. Two products with ``A`` and two
    preconditioner applications, 2 reductions (``rhat.v``; ``[r.r, rhat.r]``) and 2 host
    synchronisations per iteration; the residual recurrence is the unpreconditioned
    residual. Breakdown (``rhat.r == 0`` or ``rhat.v == 0`` with a nonzero residual):
    ``DIVERGED_BREAKDOWN``. Returns ``(x, info)``.
    """
    run = _Run("cgs", b, x0, matvec, reduce_sum, rtol, atol, maxiter, callback, record_history)
    x, r, red = run.x, run.r, run.reduce
    v0 = red(torch.cat([_dots([(b, b), (r, r)]), run.nloc()]))
    bb, rr, ng = v0.tolist()
    done = run.start(bb, rr, ng)
    if done is not None:
        return run.x, done
    rhat = r.clone()
    rho = rr                          # rhat . r0 = ||r0||^2
    u = r.clone()
    p = r.clone()
    q = torch.zeros_like(b)
    for k in range(1, run.maxiter + 1):
        phat = p if M is None else M(p)
        v = matvec(phat)
        sigma = float(red(torch.dot(rhat, v).reshape(1))[0])
        if not _fin(sigma):
            return x, run.nan(k)
        if sigma == 0.0:
            return x, run.finish("DIVERGED_BREAKDOWN", k)
        alpha = rho / sigma
        q = u - alpha * v
        uq = u + q
        uhat = uq if M is None else M(uq)
        x.add_(uhat, alpha=alpha)
        r.sub_(matvec(uhat), alpha=alpha)
        rr, rho_new = red(_dots([(r, r), (rhat, r)])).tolist()
        if not _fin(rr, rho_new):
            return x, run.nan(k)
        rnorm = _sqrt(rr)
        run.step(k, rnorm)
        if rnorm <= run.tol:
            return x, run.finish(run.conv_reason(rnorm), k)
        if rho_new == 0.0:
            return x, run.finish("DIVERGED_BREAKDOWN", k)
        beta = rho_new / rho
        rho = rho_new
        u = r + beta * q
        p = u + beta * (q + beta * p)
    return x, run.finish("DIVERGED_ITS", run.maxiter)


# ------------------------------------------------------------------------ TFQMR
@torch.no_grad()
def tfqmr(matvec: Callable[[Tensor], Tensor], b: Tensor, *, x0: Optional[Tensor] = None,
          rtol: float = 1e-5, atol: float = 0.0, maxiter: Optional[int] = None,
          M: Optional[Callable[[Tensor], Tensor]] = None,
          reduce_sum: Optional[Callable[[Tensor], Tensor]] = None,
          callback: Optional[Callable[[int, float], None]] = None,
          record_history: bool = False, relative_to_initial: bool = False) -> tuple[Tensor, SolveInfo]:
    """Transpose-free QMR (Freund; Saad's Algorithm 7.8) with RIGHT preconditioning.

    Collective over the ranks ``reduce_sum`` spans. ``iterations`` counts half-steps
    (one product with ``A`` and one preconditioner application each, SciPy's count).
    The recurrence carries the bound ``tau sqrt(m + 1) >= ||b - A x||`` (reported to
    ``callback``); when it passes the test, the true residual is computed (one more
    product and reduction) and decides, so "converged" always means the true residual
    passed; when it does not pass, the recurrences restart from it. Breakdown (``rhat.v == 0`` or ``rho == 0``): ``DIVERGED_BREAKDOWN``.
    ``relative_to_initial``: ``rtol`` relative to ``min(||b - A x0||, ||b||)`` (SciPy's
    ``tfqmr`` uses ``||b - A x0||``) instead of ``||b||``. Returns ``(x, info)``.
    """
    run = _Run("tfqmr", b, x0, matvec, reduce_sum, rtol, atol, maxiter, callback, record_history)
    x, r, red = run.x, run.r, run.reduce
    v0 = red(torch.cat([_dots([(b, b), (r, r)]), run.nloc()]))
    bb, rr, ng = v0.tolist()
    if relative_to_initial and rr == 0.0:       # x0 solves it (start() would return zeros)
        run.start(1.0, 0.0, ng)
        return x, run.finish(run.conv_reason(0.0), 0, 0.0)
    # SciPy's tfqmr measures tol against ||b - A x0||; against the smaller of it and ||b|| here, so
    # info == 0 also means SciPy's usual ||b - A x|| <= tol ||b|| (its own tests check that)
    done = run.start(min(rr, bb) if relative_to_initial else bb, rr, ng)
    if done is not None:
        return run.x, done

    def fresh(res: Tensor, res_sq: float):
        """The recurrences started from the residual ``res`` (at the start, and when the
        bound passed but the true residual did not: the recurrence has drifted from it)."""
        uhat = res if M is None else M(res)
        Au = matvec(uhat)                   # (A M) u_m
        return dict(rhat=res.clone(), w=res.clone(), u=res.clone(), uhat=uhat, Au=Au, v=Au.clone(),
                    dhat=torch.zeros_like(b), tau=_sqrt(res_sq), theta=0.0, eta=0.0, rho=res_sq)

    st = fresh(r, rr)
    alpha, m = 0.0, 0                       # m: the half-step since the last (re)start
    u_next = None
    for k in range(1, run.maxiter + 1):
        even = m % 2 == 0
        w, Au, v, rhat = st["w"], st["Au"], st["v"], st["rhat"]
        if even:
            sigma = float(red(torch.dot(rhat, v).reshape(1))[0])
            if not _fin(sigma):
                return x, run.nan(k)
            if sigma == 0.0:
                return x, run.finish("DIVERGED_BREAKDOWN", k)
            alpha = st["rho"] / sigma
            u_next = st["u"] - alpha * v    # u_{m+1}
        w.sub_(Au, alpha=alpha)
        st["dhat"].mul_(st["theta"] ** 2 * st["eta"] / alpha).add_(st["uhat"])
        if even:
            ww = float(red(torch.dot(w, w).reshape(1))[0])
        else:
            ww, rho_new = red(_dots([(w, w), (rhat, w)])).tolist()
        if not _fin(ww):
            return x, run.nan(k)
        theta = _sqrt(ww) / st["tau"]
        c = 1.0 / math.sqrt(1.0 + theta * theta)
        st.update(theta=theta, tau=st["tau"] * theta * c, eta=c * c * alpha)
        x.add_(st["dhat"], alpha=st["eta"])
        bound = st["tau"] * math.sqrt(m + 2)
        run.step(k, bound)
        m += 1
        if bound <= run.tol:
            res = b - matvec(x)
            res_sq = float(red(torch.dot(res, res).reshape(1))[0])
            rnorm = _sqrt(res_sq)
            if rnorm <= run.tol:
                return x, run.finish(run.conv_reason(rnorm), k, rnorm)
            if not _fin(res_sq):
                return x, run.finish("DIVERGED_NANORINF", k)
            st, m = fresh(res, res_sq), 0
            continue
        if even:
            u = u_next
            uhat = u if M is None else M(u)
            st.update(u=u, uhat=uhat, Au=matvec(uhat))      # (A M) u_{m+1}
        else:
            if not _fin(rho_new):
                return x, run.finish("DIVERGED_NANORINF", k)
            if rho_new == 0.0:
                return x, run.finish("DIVERGED_BREAKDOWN", k)
            beta = rho_new / st["rho"]
            u = w + beta * st["u"]          # u_{m+1} (m odd)
            uhat = u if M is None else M(u)
            Au_new = matvec(uhat)
            st.update(rho=rho_new, u=u, uhat=uhat, Au=Au_new, v=Au_new + beta * (Au + beta * v))
    return x, run.finish("DIVERGED_ITS", run.maxiter)


# ------------------------------------------------------------------------ GMRES
@torch.no_grad()
def gmres(matvec: Callable[[Tensor], Tensor], b: Tensor, *, x0: Optional[Tensor] = None,
          rtol: float = 1e-5, atol: float = 0.0, maxiter: Optional[int] = None,
          M: Optional[Callable[[Tensor], Tensor]] = None,
          reduce_sum: Optional[Callable[[Tensor], Tensor]] = None,
          callback: Optional[Callable[[int, float], None]] = None,
          record_history: bool = False, restart: int = 30) -> tuple[Tensor, SolveInfo]:
    """Restarted GMRES(``restart``) with RIGHT preconditioning, for general ``A``.

    Collective over the ranks ``reduce_sum`` spans. CGS2 Arnoldi: 2 reductions
    and 1 host synchronisation per iteration, plus a true-residual matvec and
    reduction per restart cycle (not counted as an iteration). ``maxiter``
    counts inner iterations. ``M`` must be a fixed linear operator (the
    correction is ``M (V y)``, not flexible GMRES). Returns ``(x, info)``.
    """
    restart = int(restart)
    if restart < 1:
        raise ValueError(f"gmres: restart must be >= 1, got {restart}")
    run = _Run("gmres", b, x0, matvec, reduce_sum, rtol, atol, maxiter, callback, record_history)
    x, r, red = run.x, run.r, run.reduce
    v0 = red(torch.cat([_dots([(b, b), (r, r)]), run.nloc()]))
    bb, rr, ng = v0.tolist()
    done = run.start(bb, rr, ng)
    if done is not None:
        return run.x, done
    m = max(1, min(restart, int(round(ng)), run.maxiter))
    V = b.new_empty((m + 1, b.numel()))
    H = np.zeros((m + 1, m))
    cs = np.zeros(m)
    sn = np.zeros(m)
    g = np.zeros(m + 1)
    beta = run.rnorm
    its = 0
    while True:
        V[0] = r / beta
        g[:] = 0.0
        g[0] = beta
        H[:] = 0.0
        ncols = 0
        failure = None
        for j in range(m):
            if its >= run.maxiter:
                break
            zj = V[j] if M is None else M(V[j])
            w = matvec(zj)
            its += 1
            Vj = V[: j + 1]
            h1 = red(Vj @ w)
            w = w - h1 @ Vj
            h2n = red(torch.cat([Vj @ w, torch.dot(w, w).reshape(1)]))
            h2 = h2n[: j + 1]
            w = w - h2 @ Vj
            hcol = torch.cat([h1 + h2, h2n[j + 1:], (h2 * h2).sum().reshape(1)]).tolist()
            hvec = np.asarray(hcol[: j + 1], dtype=np.float64)
            hnsq = hcol[j + 1] - hcol[j + 2]
            if not (np.all(np.isfinite(hvec)) and _fin(hnsq)):
                run.step(its, float("nan"))
                failure = "DIVERGED_NANORINF"
                break
            hnorm = math.sqrt(max(hnsq, 0.0))
            # apply previous rotations, then make the new one
            for i in range(j):
                t0 = cs[i] * hvec[i] + sn[i] * hvec[i + 1]
                hvec[i + 1] = -sn[i] * hvec[i] + cs[i] * hvec[i + 1]
                hvec[i] = t0
            denom = math.hypot(hvec[j], hnorm)
            if denom == 0.0:           # A M v_j in span(V_j) with a zero pivot: singular
                run.step(its, abs(g[j]))
                failure = "DIVERGED_BREAKDOWN"
                break
            cs[j], sn[j] = hvec[j] / denom, hnorm / denom
            hvec[j] = denom
            H[: j + 1, j] = hvec
            g[j + 1] = -sn[j] * g[j]
            g[j] = cs[j] * g[j]
            ncols = j + 1
            est = abs(g[j + 1])
            run.step(its, est)
            if est <= run.tol or hnorm == 0.0:
                break
            V[j + 1] = w / hnorm
        if ncols > 0:
            R = H[:ncols, :ncols]
            y = np.zeros(ncols)
            for i in range(ncols - 1, -1, -1):      # back substitution (small)
                y[i] = (g[i] - R[i, i + 1:ncols] @ y[i + 1:]) / R[i, i]
            upd = torch.as_tensor(y, dtype=b.dtype, device=b.device) @ V[:ncols]
            x.add_(upd if M is None else M(upd))
        r = b - matvec(x)
        rnorm = _sqrt(red(torch.dot(r, r).reshape(1)).tolist()[0])
        run.rnorm = rnorm
        if failure == "DIVERGED_NANORINF" or not _fin(rnorm):
            return x, run.finish("DIVERGED_NANORINF", its, rnorm)
        if rnorm <= run.tol:
            return x, run.finish(run.conv_reason(rnorm), its, rnorm)
        if failure is not None:
            return x, run.finish(failure, its, rnorm)
        if its >= run.maxiter:
            return x, run.finish("DIVERGED_ITS", its, rnorm)
        beta = rnorm
