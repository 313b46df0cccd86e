"""Native torch kernels for symmetric eigenproblems: block LOBPCG and
thick-restart Lanczos.  Operator-agnostic and distribution-agnostic.

Collective semantics
--------------------
Every function here is *collective over whatever ``reduce_sum`` /
``reduce_max`` reduce over*: all ranks call it with the same arguments except
the local data, in the same order.  With the default (identity) reductions the
kernels are purely local, serial solvers.

Data layout
-----------
A distributed vector block is a plain tensor ``(n_local, m)`` holding this
rank's owned rows; no rank ever holds an ``N x m`` array.  The kernels never
look at rows of other ranks: they only

* apply the operators: ``A(X)``, ``B(X)``, ``T(R)``, ``B_solve(Y)`` map an
  ``(n_local, m)`` block to an ``(n_local, m)`` block (collective if the
  operator is, e.g. a halo-exchanging matvec);
* form global inner products as ``reduce_sum(X.mT @ Y)``: ``reduce_sum(t)``
  returns the elementwise sum of the small tensor ``t`` (any shape; floating
  point of the working dtype, or ``int64``) over all ranks (an
  ``MPI.Allreduce(SUM)``); default: identity;
* for the sign convention, ``reduce_max(t)``: elementwise maximum over ranks
  of a small ``(k,)`` tensor of the working dtype or of ``int64``; default:
  identity.

All small dense work (Gram matrices, Rayleigh--Ritz ``torch.linalg.eigh``) is
done on reduced, hence identical, data, so every rank takes the same decisions
(convergence, dropped directions, restarts) without extra communication.  The
small dense problems run on the device/dtype of the input block.

Global row numbering (``row_offset`` / ``row_ids``)
---------------------------------------------------
The sign convention and the deterministic start vectors need the *global*
index of each local row: ``row_offset`` (int, the global index of this rank's
first row, for contiguous row ownership as ``DSparseTensor.row_range[0]``) or
``row_ids`` (an ``int64`` tensor ``(n_local,)`` of global indices, which takes
precedence; pass the user-numbering ids when a partitioner renumbered the rows
and results must not depend on the rank count).

Sign convention
---------------
Every returned eigenvector is scaled by +-1 so that its *first dominant entry*
is positive: among the entries whose magnitude is within a relative
``tie_rtol`` of the column's max-abs value (default ``eps**(1/3)`` of the
dtype: 6e-6 for float64, 5e-3 for float32), the one with the smallest global
index.  The tolerance makes the choice stable when two entries tie in exact
arithmetic (symmetric modes) but differ by rounding, which differs with the
number of ranks.  Cost: two ``reduce_max`` of ``(k,)`` tensors (see
``fix_signs``).

Residual / convergence criterion (both methods)
-----------------------------------------------
For a Ritz pair ``(w, v)``::

    res = ||A v - w B v||_2 / (max(|w|, floor) * ||B v||_2),
    floor = 100 * eps * anorm / tol,

where ``anorm`` is the largest ``|Ritz value|`` seen so far (an estimate of
``||B^{-1} A||``).  ``res`` is invariant under scaling of ``A``, ``B`` and
``v``; a pair is converged when ``res <= tol``, i.e. when
``||r|| <= max(tol |w|, 100 eps anorm) ||B v||`` -- relative to the
eigenvalue, but never demanding a residual below rounding level (zero
eigenvalues).  Reported ``EigenInfo.residual_norms`` always come from operators
applied explicitly to the returned vectors.

Non-convergence is not raised here: ``info.converged < info.k`` and the caller
raises :class:`~slasolve.eigen.info.EigenConvergenceError` on every rank.
Invalid problems (``k >= n_global``, bad block sizes, rank-deficient starting
blocks) raise ``ValueError`` on every rank (decided from reduced data);
non-finite operator output raises ``FloatingPointError`` on every rank.
"""
from __future__ import annotations

import math
import time

import torch

from .info import EigenInfo

__all__ = ["lobpcg", "lanczos", "fix_signs", "start_vectors"]

_AMP_MAX = 1e2     # recompute tracked A*V / B*V once cancellation exceeds 2 digits
_INT64_MIN = torch.iinfo(torch.int64).min


def _identity(t):
    return t


class _Counted:
    """``A`` checked to keep the shape of its argument, counting the columns it is applied to."""

    def __init__(self, A):
        self.A, self.count = A, 0

    def __call__(self, X):
        self.count += X.shape[1]
        Y = self.A(X)
        if Y.shape != X.shape:
            raise ValueError(f"A: returned shape {tuple(Y.shape)} for input {tuple(X.shape)}")
        return Y


def _eps(dtype) -> float:
    return torch.finfo(dtype).eps


def _global_ids(n_local, device, row_offset=0, row_ids=None):
    if row_ids is not None:
        ids = torch.as_tensor(row_ids, dtype=torch.int64, device=device).reshape(-1)
        if ids.numel() != n_local:
            raise ValueError(
                f"row_ids: expected {n_local} global ids (one per local row), got {ids.numel()}")
        return ids
    return torch.arange(n_local, dtype=torch.int64, device=device) + int(row_offset)


def _check_block(name, X):
    if not isinstance(X, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(X).__name__}")
    if X.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"{name}: real floating dtype required, got {X.dtype}")
    if X.dim() == 1:
        X = X[:, None]
    if X.dim() != 2:
        raise ValueError(f"{name}: expected shape (n_local,) or (n_local, m), got {tuple(X.shape)}")
    return X


def _n_global(n_local, device, rs):
    return int(rs(torch.tensor(n_local, dtype=torch.int64, device=device)).item())


# --------------------------------------------------------------------------- #
# deterministic start vectors and sign convention
# --------------------------------------------------------------------------- #
def start_vectors(n_local, m=1, *, row_offset=0, row_ids=None, seed=0,
                  dtype=torch.float64, device=None):
    """Pseudo-random block ``(n_local, m)`` with entries in ``[-0.5, 0.5)``.

    Local (no communication).  Entry ``(i, j)`` depends only on the global row
    index of row ``i`` (``row_offset`` / ``row_ids``), on ``j`` and on ``seed``
    (an exact 32-bit integer hash, no floating point involved), so the global block is identical for every rank
    count and partition.
    """
    gid = _global_ids(n_local, device, row_offset, row_ids)
    col = torch.arange(m, dtype=torch.int64, device=device)
    kc = _hash32((col + 0x9E3779B9 * ((int(seed) % _M32) + 1)) & _M32)
    h = _hash32((gid[:, None] & _M32) ^ kc[None, :])
    h = _hash32(h ^ ((gid[:, None] >> 32) & _M32))
    h = _hash32((h + kc[None, :]) & _M32)
    return (h.to(torch.float64) / 4294967296.0 - 0.5).to(dtype)


_M32 = 0xFFFFFFFF


def _hash32(x):
    """Integer hash of int64 tensors holding values in [0, 2^32) (exact: every
    product stays below 2^59, so no overflow on any device)."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def fix_signs(V, *, reduce_max=None, row_offset=0, row_ids=None, tie_rtol=None):
    """Return ``V`` with each column multiplied by +-1 so that its first
    dominant entry is positive (see the module docstring).

    Collective over ``reduce_max`` (two reductions of ``(k,)`` tensors).
    The dominant entry is the smallest global index ``g`` with
    ``|v_g| >= (1 - tie_rtol) * max_i |v_i|``; the global argmin and the sign
    travel in one ``int64`` key ``-2 g + [v_g >= 0]`` maximised over ranks.
    """
    reduce_max = reduce_max or _identity
    V = _check_block("V", V)
    n_local, k = V.shape
    if k == 0:
        return V
    if tie_rtol is None:
        tie_rtol = _eps(V.dtype) ** (1.0 / 3.0)
    absV = V.abs()
    if n_local > 0:
        loc = absV.amax(dim=0)
    else:
        loc = torch.zeros(k, dtype=V.dtype, device=V.device)
    gmax = reduce_max(loc)
    thr = gmax * (1.0 - tie_rtol)
    gid = _global_ids(n_local, V.device, row_offset, row_ids)
    key = -2 * gid[:, None] + (V >= 0).to(torch.int64)
    key = torch.where(absV >= thr[None, :], key, torch.full_like(key, _INT64_MIN))
    if n_local > 0:
        lkey = key.amax(dim=0)
    else:
        lkey = torch.full((k,), _INT64_MIN, dtype=torch.int64, device=V.device)
    gkey = reduce_max(lkey)
    positive = torch.remainder(gkey, 2) == 1
    s = torch.where(positive, 1.0, -1.0).to(V.dtype)
    return V * s[None, :]


# --------------------------------------------------------------------------- #
# B-orthonormalisation with dependency dropping (shared by both kernels)
# --------------------------------------------------------------------------- #
def _sym(M):
    return 0.5 * (M + M.mT)


def _check_finite(M, what):
    if not bool(torch.isfinite(M).all()):
        raise FloatingPointError(
            f"non-finite values in {what} (operator output or starting block contains NaN/Inf)")


def _borth(V, AV, BV, Q, rs, Aop, Bop, eps):
    """B-orthonormalise the columns of ``V`` against the B-orthonormal block
    ``Q = (QV, QA, QB)`` (or None) and among themselves; near-dependent
    columns are dropped.

    ``AV``: tracked ``A V`` (updated by the same linear combinations) or None
    (not tracked: the caller applies A afterwards).  ``BV``: tracked ``B V`` or
    None (then computed).  ``Bop`` is None for B = I.  Per column the growth of
    the rounding error of the tracked products (cancellation) is estimated; a
    column whose estimate exceeds ``_AMP_MAX`` gets A/B re-applied explicitly.

    Two sweeps of (classical projection against Q, SVQB) -- "twice is enough".
    SVQB (Stathopoulos & Wu 2002): G = V^T B V, D = diag(G)^-1/2,
    D G D = U L U^T, V <- V D U L^-1/2, dropping eigenvalues L < tau * max(L).
    """
    has_B = Bop is not None
    tau = 1e3 * eps
    if BV is None:
        BV = Bop(V) if has_B else V
    c = V.shape[1]
    amp = torch.ones(c, dtype=V.dtype, device=V.device)

    def refresh(mask):
        nonlocal AV, BV
        if not bool(mask.any()):
            return False
        idx = torch.nonzero(mask).flatten()
        did = False
        if has_B:
            BV = BV.clone()
            BV[:, idx] = Bop(V[:, idx])
            did = True
        if AV is not None:
            AV = AV.clone()
            AV[:, idx] = Aop(V[:, idx])
        amp[idx] = 1.0
        return did

    for _sweep in range(2):
        if V.shape[1] == 0:
            break
        n2 = None
        if Q is not None and Q[0].shape[1] > 0:
            QV, QA, QB = Q
            small = rs(torch.cat([QB.mT @ V, (V * BV).sum(0, keepdim=True)], 0))
            _check_finite(small, "the orthogonalisation")
            C, n2 = small[:-1], small[-1]
            V = V - QV @ C
            BV = BV - QB @ C if has_B else V
            if AV is not None:
                AV = AV - QA @ C
        G = _sym(rs(V.mT @ BV))
        _check_finite(G, "the Gram matrix")
        d = torch.diagonal(G).clone()
        if n2 is not None:
            rel = torch.sqrt(torch.clamp(d, min=0.0) / torch.clamp(n2, min=torch.finfo(V.dtype).tiny))
            keep = rel > tau
            amp = amp / torch.clamp(rel, min=tau)
        else:
            dmax = float(d.max()) if d.numel() else 0.0
            keep = d > (tau * tau) * dmax
        keep = keep & (d > 0)
        if not bool(keep.all()):
            idx = torch.nonzero(keep).flatten()
            V, BV = V[:, idx], (BV[:, idx] if has_B else None)
            if not has_B:
                BV = V
            if AV is not None:
                AV = AV[:, idx]
            G, d, amp = G[idx][:, idx], d[idx], amp[idx]
        if V.shape[1] == 0:
            break
        if refresh(amp > _AMP_MAX):
            G = _sym(rs(V.mT @ BV))
            _check_finite(G, "the Gram matrix")
            d = torch.diagonal(G).clone()
        # SVQB
        dinv = torch.rsqrt(d)
        lam, U = torch.linalg.eigh(dinv[:, None] * G * dinv[None, :])
        keepl = lam > tau * lam[-1]
        U, lam = U[:, keepl], lam[keepl]
        Cs = dinv[:, None] * U * torch.rsqrt(lam)[None, :]
        amp = (Cs.abs() * (torch.sqrt(d) * amp)[:, None]).sum(0)
        V = V @ Cs
        BV = BV @ Cs if has_B else V
        if AV is not None:
            AV = AV @ Cs
        refresh(amp > _AMP_MAX)
    return V, AV, BV


def _whitened_eigh(H, G, eps):
    """Solve the small pencil (H, G), G SPD up to rounding: returns ascending
    theta and coefficients C with C^T G C = I, C^T H C = diag(theta).
    G is whitened by its eigendecomposition (directions with eigenvalues
    below 1e3*eps*max are dropped), robust where Cholesky would fail."""
    lam, U = torch.linalg.eigh(G)
    keep = lam > 1e3 * eps * lam[-1]
    Wm = U[:, keep] * torch.rsqrt(lam[keep])[None, :]
    theta, Z = torch.linalg.eigh(_sym(Wm.mT @ H @ Wm))
    return theta, Wm @ Z


# --------------------------------------------------------------------------- #
# LOBPCG
# --------------------------------------------------------------------------- #
def lobpcg(A, X0, *, B=None, T=None, k=None, largest=False, tol=1e-8, maxiter=500,
           reduce_sum=None, reduce_max=None, row_offset=0, row_ids=None, deflate=None, callback=None):
    """Block LOBPCG (Knyazev 2001) for ``A v = w B v``, A symmetric, B SPD.

    Collective over ``reduce_sum`` / ``reduce_max`` (see module docstring).

    Parameters
    ----------
    A, B, T:
        Callables ``(n_local, m) -> (n_local, m)``: the operator, the mass
        operator (None = identity) and the preconditioner (None = identity;
        should approximate ``A^{-1}`` -- or ``(A - sigma B)^{-1}``-like SPD --
        for the smallest end).
    X0:
        Starting block ``(n_local, m)``; the block size ``m >= k`` (extra
        columns are guard vectors, which speed up convergence). Must have
        full rank (``ValueError`` otherwise). :func:`start_vectors` gives a
        rank-count independent one.
    k:
        Number of wanted pairs (default ``m``); ``k < n_global`` required.
    largest:
        Wanted end of the spectrum.
    tol, maxiter:
        Relative residual tolerance (module docstring) and maximum number of
        iterations.
    deflate:
        Optional ``(Y, BY)``: a B-orthonormal block ``(n_local, d)`` of known
        eigenvectors and ``B Y``. The iteration runs in the B-orthogonal
        complement of ``span(Y)`` (every search block is projected), so it
        returns the wanted end of the remaining spectrum.
    callback:
        Optional ``callback(iteration, n_converged, residuals)``, called on every
        rank at each iteration with the number of the ``k`` wanted pairs that pass
        ``tol`` and their relative residuals (a list, identical on every rank).

    Returns
    -------
    w: ``(k,)`` ascending eigenvalues; V: ``(n_local, k)`` B-orthonormal
    eigenvectors (sign convention applied); info: :class:`EigenInfo`.

    Notes
    -----
    Basis ``S = [X, W, P]`` with soft locking (Hetmaniuk & Lehoucq 2006): the
    residuals ``W = T(R)`` and the conjugate directions ``P`` are kept only for
    non-converged columns; ``W`` and ``P`` are explicitly B-orthonormalised
    against ``X`` (and ``P`` against ``W``) with two sweeps of projection +
    SVQB, dropping near-dependent directions. ``A W`` is always applied
    explicitly; ``A P``, ``B P`` and ``A X``, ``B X`` are tracked through the
    (well-conditioned) linear combinations and re-applied when cancellation is
    detected. Rayleigh--Ritz on the pencil ``(S^T A S, S^T B S)`` (one
    reduction, small ``eigh``). Convergence of all ``k`` wanted pairs is
    confirmed with freshly applied ``A X``, ``B X`` before returning.
    """
    t0 = time.perf_counter()
    rs = reduce_sum or _identity
    with torch.no_grad():
        X0 = _check_block("X0", X0)
        n_local, m = X0.shape
        dev, dt = X0.device, X0.dtype
        eps = _eps(dt)
        k = m if k is None else int(k)
        if not (1 <= k <= m):
            raise ValueError(f"k: need 1 <= k <= X0.shape[1] = {m}, got {k}")
        if not (tol > 0):
            raise ValueError(f"tol: must be positive, got {tol}")
        n_global = _n_global(n_local, dev, rs)
        if k >= n_global:
            raise ValueError(f"k: need k < n_global = {n_global} (use a dense solver), got k={k}")
        nd = 0 if deflate is None else int(deflate[0].shape[1])
        if m > n_global - nd:
            raise ValueError(f"X0: block size {m} exceeds the problem size {n_global}"
                             + (f" minus the {nd} deflated vectors" if nd else ""))
        has_B = B is not None
        Aop = _Counted(A)

        Bop = B if has_B else None
        floor_fac = 100.0 * eps / tol
        anorm = [0.0]

        def rr(SV, SA, SB):
            G2 = rs(torch.stack([SV.mT @ SA, SV.mT @ SB]))
            _check_finite(G2, "the Rayleigh-Ritz matrices")
            theta, C = _whitened_eigh(_sym(G2[0]), _sym(G2[1]), eps)
            anorm[0] = max(anorm[0], float(theta.abs().max()))
            if largest:
                theta, C = theta.flip(0), C.flip(1)   # wanted first
            return theta[:m], C[:, :m]

        def residuals(X, AX, BX, theta):
            R = AX - BX * theta[None, :]
            s = rs(torch.stack([(R * R).sum(0), (BX * BX).sum(0)]))
            _check_finite(s, "the residual norms")
            rn, bn = torch.sqrt(s[0]), torch.sqrt(torch.clamp(s[1], min=torch.finfo(dt).tiny))
            scale = torch.clamp(theta.abs(), min=floor_fac * anorm[0])
            res = rn / (torch.clamp(scale, min=torch.finfo(dt).tiny) * bn)
            return R, res

        def fresh_rr(X):
            AX = Aop(X)
            BX = Bop(X) if has_B else X
            theta, C = rr(X, AX, BX)
            X, AX = X @ C, AX @ C
            BX = BX @ C if has_B else X
            return X, AX, BX, theta

        Yq = None
        if nd:
            Y, BY = deflate
            Yq = (Y, Aop(Y), BY if has_B else Y)

        def with_y(Q):
            if Yq is None:
                return Q
            return tuple(torch.cat([a, b], 1) for a, b in zip(Yq, Q))

        X, _, _ = _borth(X0, None, None, Yq, rs, Aop, Bop, eps)
        if X.shape[1] < m:
            raise ValueError("X0: starting block is (numerically) rank deficient")
        X, AX, BX, theta = fresh_rr(X)
        P = None
        fresh = True
        it = 0
        t1 = time.perf_counter()
        while True:
            R, res = residuals(X, AX, BX, theta)
            conv = (res <= tol)
            if callback is not None:
                callback(it, int(conv[:k].sum()), res[:k].tolist())
            if bool(conv[:k].all()):
                if fresh:
                    break
                X, AX, BX, theta = fresh_rr(X)
                fresh = True
                continue
            if it >= maxiter:
                break
            it += 1
            active = torch.nonzero(~conv).flatten()
            Ra = R[:, active]
            W = T(Ra) if T is not None else Ra
            if W.shape != Ra.shape:
                raise ValueError(f"T: returned shape {tuple(W.shape)} for input {tuple(Ra.shape)}")
            W, _, BW = _borth(W, None, None, with_y((X, AX, BX)), rs, Aop, Bop, eps)
            AW = Aop(W) if W.shape[1] else W
            blocks = [(X, AX, BX)]
            if W.shape[1]:
                blocks.append((W, AW, BW))
            if P is not None:
                Pv, Pa, Pb = (t[:, active] for t in P)
                Q = tuple(torch.cat([b[i] for b in blocks], 1) for i in range(3))
                Pv, Pa, Pb = _borth(Pv, Pa, Pb, with_y(Q), rs, Aop, Bop, eps)
                if Pv.shape[1]:
                    blocks.append((Pv, Pa, Pb))
            if len(blocks) == 1:   # nothing new to search: stagnation
                break
            SV, SA, SB = (torch.cat([b[i] for b in blocks], 1) for i in range(3))
            theta, C = rr(SV, SA, SB)
            X, AX = SV @ C, SA @ C
            BX = SB @ C if has_B else X
            # conjugate directions: the W/P part of the new Ritz vectors
            Cp = C[m:]
            Pv, Pa = SV[:, m:] @ Cp, SA[:, m:] @ Cp
            P = (Pv, Pa, SB[:, m:] @ Cp if has_B else Pv)
            fresh = False
        if not fresh:
            X, AX, BX, theta = fresh_rr(X)
            R, res = residuals(X, AX, BX, theta)
        w, V, res = theta[:k], X[:, :k], res[:k]
        if largest:
            w, V, res = w.flip(0), V.flip(1), res.flip(0)
        V = fix_signs(V, reduce_max=reduce_max, row_offset=row_offset, row_ids=row_ids)
        t2 = time.perf_counter()
        res_l = [float(r) for r in res]
        info = EigenInfo(converged=sum(r <= tol for r in res_l), k=k, iterations=it,
                         residual_norms=res_l, method="lobpcg", backend="torch",
                         setup_time=t1 - t0, solve_time=t2 - t1, matvecs=Aop.count)
        return w, V, info


# --------------------------------------------------------------------------- #
# thick-restart Lanczos
# --------------------------------------------------------------------------- #
def lanczos(A, v0, k, *, which="LA", B=None, B_solve=None, tol=1e-10, maxiter=1000, ncv=None,
            reduce_sum=None, reduce_max=None, row_offset=0, row_ids=None, deflate=None, callback=None):
    """Thick-restart Lanczos (Wu & Simon 2000) for extreme eigenvalues of a
    symmetric problem.

    Collective over ``reduce_sum`` / ``reduce_max`` (see module docstring).

    Supported problems
    ------------------
    * standard ``A v = w v`` (``B = B_solve = None``);
    * generalized ``A v = w B v`` with B SPD: pass both ``B`` (applies B) and
      ``B_solve`` (applies ``B^{-1}``, exactly or to well below ``tol``).
      Lanczos then runs on ``B^{-1} A`` in the B-inner product (which makes
      it self-adjoint); each step costs one A, one B_solve and one B.
    * shift-invert / interior eigenvalues: pass ``A = x -> (A - sigma B)^{-1} B x``
      style operators yourself; the eigenvalues returned are those of the
      operator given.

    Parameters
    ----------
    v0: starting vector ``(n_local,)`` or ``(n_local, 1)``, nonzero.
    k: number of wanted pairs, ``k < n_global``.
    which: ``"LA"`` (largest algebraic), ``"SA"`` (smallest algebraic) or
        ``"LM"`` (largest magnitude).
    tol: relative residual tolerance (module docstring).
    maxiter: maximum number of restarts.
    ncv: basis size (default ``min(n_global, max(2k + 1, 20))``); the
        distributed basis is ``(n_local, ncv + 1)``. At each restart the
        ``k + (ncv - k) // 2`` wanted Ritz vectors are kept.
    deflate: optional ``(Y, BY)``, a B-orthonormal block of known eigenvectors
        (of the operator given) and ``B Y``: every basis vector is
        B-orthogonalised against ``Y`` too (in the same reductions), so the
        iteration sees only the remaining spectrum.
    callback: optional ``callback(restarts, n_converged, estimates)``, called on
        every rank after each basis fill with the restart count and the relative
        Ritz estimates of the ``k`` wanted pairs (a list; identical on every rank).

    Returns ``w`` ``(k,)`` ascending, ``V`` ``(n_local, k)`` (B-)orthonormal with
    the sign convention, and :class:`EigenInfo` (``iterations`` = restarts).

    Full reorthogonalisation (two classical Gram--Schmidt sweeps against the
    whole stored basis, one reduction each) keeps the basis orthonormal; the
    projected matrix is filled from the computed coefficients, so after a
    restart it is the arrowhead matrix of Wu & Simon. An invariant subspace
    (breakdown) is continued with a deterministic pseudo-random vector.
    Convergence is first judged by the Ritz estimates ``|beta_m s_mj|`` and
    then confirmed with explicitly applied operators on the Ritz vectors.

    Like every single-vector Krylov method (ARPACK, SLEPc's Krylov-Schur) it
    finds one copy of an eigenvalue of exact multiplicity > 1 (the start vector
    has one component per eigenspace); :func:`slasolve.eigsh` recovers the
    other copies by deflated restarts (``deflate``) with new start vectors.
    """
    t0 = time.perf_counter()
    rs = reduce_sum or _identity
    with torch.no_grad():
        v0 = _check_block("v0", v0)
        n_local, c0 = v0.shape
        if c0 != 1:
            raise ValueError(f"v0: expected one starting vector, got shape {tuple(v0.shape)}")
        dev, dt = v0.device, v0.dtype
        eps = _eps(dt)
        if which not in ("LA", "SA", "LM"):
            raise ValueError(f"which: expected 'LA', 'SA' or 'LM', got {which!r}")
        if (B is None) != (B_solve is None):
            raise ValueError("B, B_solve: a generalized problem needs both B and B_solve")
        if not (tol > 0):
            raise ValueError(f"tol: must be positive, got {tol}")
        k = int(k)
        n_global = _n_global(n_local, dev, rs)
        if not (1 <= k < n_global):
            raise ValueError(f"k: need 1 <= k < n_global = {n_global}, got {k}")
        if ncv is None:
            ncv = min(n_global, max(2 * k + 1, 20))
        nd = 0 if deflate is None else int(deflate[0].shape[1])
        ncv = min(int(ncv), n_global - nd) if nd else int(ncv)
        if not (k < ncv <= n_global - nd):
            raise ValueError(f"ncv: need k < ncv <= n_global = {n_global}"
                             + (f" minus {nd} deflated vectors" if nd else "") + f", got {ncv}")
        nkeep = min(ncv - 1, k + (ncv - k) // 2)
        has_B = B is not None
        Aop = _Counted(A)

        def OP(x):
            y = Aop(x)
            return B_solve(y) if has_B else y

        def Bap(x):
            return B(x) if has_B else x

        def order_wanted(theta):
            if which == "LA":
                return torch.argsort(theta, descending=True)
            if which == "SA":
                return torch.argsort(theta)
            return torch.argsort(theta.abs(), descending=True)

        V = torch.zeros(n_local, ncv + 1, dtype=dt, device=dev)
        BV = torch.zeros_like(V) if has_B else V
        Tm = torch.zeros(ncv, ncv, dtype=dt, device=dev)
        if nd:
            Yd, BYd = deflate[0], (deflate[1] if has_B else deflate[0])
            for _ in range(2):
                v0 = v0 - Yd @ rs(BYd.mT @ v0)
        else:
            Yd = BYd = V[:, :0]

        bv = Bap(v0)
        nrm2 = float(rs((v0 * bv).sum()))
        if not math.isfinite(nrm2):
            raise FloatingPointError("non-finite values in v0 or B(v0)")
        if nrm2 <= 0:
            raise ValueError("v0: starting vector is zero (or B is not positive definite)")
        nrm = math.sqrt(nrm2)
        V[:, :1] = v0 / nrm
        if has_B:
            BV[:, :1] = bv / nrm

        def new_direction(j, seed):
            """Deterministic vector B-orthonormal to V[:, :j+1] (after breakdown)."""
            r = start_vectors(n_local, 1, row_offset=row_offset, row_ids=row_ids,
                              seed=7919 + seed, dtype=dt, device=dev)
            for _ in range(2):
                c = rs(torch.cat([BV[:, :j + 1], BYd], 1).mT @ r)
                r = r - V[:, :j + 1] @ c[:j + 1] - Yd @ c[j + 1:]
            br = Bap(r)
            rn = float(rs((r * br).sum()))
            if not rn > 0:
                return torch.zeros_like(r), torch.zeros_like(r)
            rn = math.sqrt(rn)
            return r / rn, br / rn

        floor_fac = 100.0 * eps / tol
        anorm = 0.0
        j0 = 0
        restarts = 0
        nbreak = 0
        beta = 0.0
        t1 = time.perf_counter()
        while True:
            for j in range(j0, ncv):
                w = OP(V[:, j:j + 1])
                Vj, BVj = V[:, :j + 1], BV[:, :j + 1]
                Qb = torch.cat([BVj, BYd], 1) if nd else BVj
                hh = rs(Qb.mT @ w)
                _check_finite(hh, "the Lanczos coefficients")
                h = hh[:j + 1]
                w = w - Vj @ h
                if nd:
                    w = w - Yd @ hh[j + 1:]
                hh2 = rs(Qb.mT @ w)
                w = w - Vj @ hh2[:j + 1]
                if nd:
                    w = w - Yd @ hh2[j + 1:]
                h = (h + hh2[:j + 1])[:, 0]
                Tm[:j + 1, j] = h
                Tm[j, :j + 1] = h
                bw = Bap(w)
                b2 = float(rs((w * bw).sum()))
                if not math.isfinite(b2):
                    raise FloatingPointError("non-finite values in the Lanczos recurrence")
                beta = math.sqrt(max(b2, 0.0))
                hn = float(torch.linalg.vector_norm(h))
                if beta <= 1e2 * eps * max(hn, beta, anorm):
                    # invariant subspace: continue with a fresh direction, coupling 0
                    nbreak += 1
                    beta = 0.0
                    w, bw = new_direction(j, nbreak)
                else:
                    w, bw = w / beta, bw / beta
                V[:, j + 1:j + 2] = w
                if has_B:
                    BV[:, j + 1:j + 2] = bw
            theta, S = torch.linalg.eigh(Tm)
            anorm = max(anorm, float(theta.abs().max()))
            order = order_wanted(theta)
            est = (beta * S[-1, :]).abs()
            scale = torch.clamp(theta.abs(), min=max(floor_fac * anorm, torch.finfo(dt).tiny))
            relest = est / scale
            sel = order[:k]
            if callback is not None:
                callback(restarts, int((relest[sel] <= tol).sum()), relest[sel].tolist())
            done = bool((relest[sel] <= tol).all())
            if done or restarts >= maxiter:
                Y = V[:, :ncv] @ S[:, sel]
                AY = Aop(Y)
                BY = Bap(Y) if has_B else Y
                th = theta[sel]
                R = AY - BY * th[None, :]
                s = rs(torch.stack([(R * R).sum(0), (BY * BY).sum(0)]))
                _check_finite(s, "the residual norms")
                res = torch.sqrt(s[0]) / (
                    torch.clamp(th.abs(), min=max(floor_fac * anorm, torch.finfo(dt).tiny))
                    * torch.sqrt(torch.clamp(s[1], min=torch.finfo(dt).tiny)))
                if bool((res <= tol).all()) or restarts >= maxiter:
                    break
            # thick restart: keep the nkeep wanted Ritz vectors + the residual direction
            restarts += 1
            keep = order[:nkeep]
            Sk = S[:, keep]
            newV = V[:, :ncv] @ Sk
            V[:, :nkeep] = newV
            if has_B:
                BV[:, :nkeep] = BV[:, :ncv] @ Sk
            V[:, nkeep] = V[:, ncv]
            if has_B:
                BV[:, nkeep] = BV[:, ncv]
            Tm.zero_()
            Tm[:nkeep, :nkeep] = torch.diag(theta[keep])
            j0 = nkeep
        perm = torch.argsort(th)
        w_out, V_out, res = th[perm], Y[:, perm], res[perm]
        V_out = fix_signs(V_out, reduce_max=reduce_max, row_offset=row_offset, row_ids=row_ids)
        t2 = time.perf_counter()
        res_l = [float(r) for r in res]
        info = EigenInfo(converged=sum(r <= tol for r in res_l), k=k, iterations=restarts,
                         residual_norms=res_l, method="lanczos", backend="torch",
                         setup_time=t1 - t0, solve_time=t2 - t1, matvecs=Aop.count)
        return w_out, V_out, info
