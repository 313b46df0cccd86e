"""Subspace numerics of :func:`slasolve.eigsh`: M-orthonormalisation, explicit residuals and
the Rayleigh-Ritz refinement. Collective (every function reduces over the ranks with ``rs``)."""
from __future__ import annotations

import torch

__all__ = ["m_orthonormalize", "residuals", "refine", "orthonormal", "REFINE_ROUNDS"]


def m_orthonormalize(V, dM, rs):
    """Loewdin: V (V^T M V)^{-1/2}; ValueError (every rank) when the Gram matrix is
    not positive definite (M indefinite)."""
    if V.shape[1] == 0:
        return V
    MV = dM @ V if dM is not None else V
    G = rs(V.mT @ MV)
    G = 0.5 * (G + G.mT)
    lam, U = torch.linalg.eigh(G)
    if not bool(lam.min() > 1e3 * torch.finfo(V.dtype).eps * lam.max().abs()):
        raise ValueError("M: is not positive definite (the eigenvectors' M-Gram matrix has eigenvalues "
                         f"{lam.tolist()})")
    return V @ (U * torch.rsqrt(lam)[None, :] @ U.mT)


def residuals(dA, dM, w, V, tol, rs):
    if V.shape[1] == 0:
        return w.new_zeros(0)
    AV = dA @ V
    BV = dM @ V if dM is not None else V
    R = AV - BV * w[None, :]
    s = rs(torch.stack([(R * R).sum(0), (BV * BV).sum(0)]))
    eps = torch.finfo(V.dtype).eps
    floor = max(100 * eps * float(w.abs().max()) / tol, torch.finfo(V.dtype).tiny)
    return torch.sqrt(s[0]) / (torch.clamp(w.abs(), min=floor) * torch.sqrt(torch.clamp(s[1], min=1e-300)))


#: most refinement rounds after the solve (each: 2k products with A and M, k solves)
REFINE_ROUNDS = 3


def refine(dA, dM, w, V, tol, rs, direction):
    """Collective. Make the true residuals meet ``tol`` when the solver's own test did not.

    SLEPc tests convergence on its estimate for the transformed operator
    (``B^{-1} A``, ``(A - sigma B)^{-1} B``); for a generalized problem with an
    ill-conditioned ``M`` the eigenpairs it returns can have true relative residuals
    ``||A v - w M v|| / (|w| ||M v||)`` orders of magnitude above ``tol`` (1.7e-9 for
    ``tol=1e-12`` at cond(M) = 600, the smallest eigenvalues of SciPy's ARPACK test).
    Each round is a Rayleigh-Ritz step on ``span[V, direction(R)]``, ``R = A V - M V W``,
    where ``direction`` applies the solver's own inverse (``M^{-1}``, or ``(A - sigma
    M)^{-1}`` for shift-invert): one step of preconditioned inverse iteration, which
    removes the error components the residual shows. Rounds stop once every residual
    meets ``tol`` or a round fails to halve the largest one; a round that does not
    improve every pair is discarded. Decisions use reduced data: the same on every rank.
    Returns ``(w, V, rounds kept)``.
    """
    res = residuals(dA, dM, w, V, tol, rs)
    rounds = 0
    for _ in range(REFINE_ROUNDS):
        worst = float(res.max())
        if not worst > tol:
            break
        MV = dM @ V if dM is not None else V
        R = dA @ V - MV * w[None, :]
        Q = orthonormal(V, rs)
        Z = direction(R).to(V.dtype)
        for _ in range(2):            # the corrections are tiny next to V: project, then scale
            Z = Z - Q @ rs(Q.mT @ Z)
        Q = torch.cat([Q, orthonormal(Z, rs)], 1)
        H = rs(Q.mT @ (dA @ Q))
        B = rs(Q.mT @ (dM @ Q)) if dM is not None else torch.eye(Q.shape[1], dtype=Q.dtype)
        try:
            L = torch.linalg.cholesky(0.5 * (B + B.mT))
        except RuntimeError:          # M not positive definite on the span: keep the solver's pairs
            break
        Li = torch.linalg.solve_triangular(L, torch.eye(L.shape[0], dtype=L.dtype), upper=False)
        theta, Y = torch.linalg.eigh(Li @ (0.5 * (H + H.mT)) @ Li.mT)
        Y = Li.mT @ Y                 # Y^T B Y = I: the new V is M-orthonormal
        free = list(range(theta.numel()))
        pick = []
        for wi in w.tolist():         # the Ritz value nearest each current one
            j = min(free, key=lambda t: abs(float(theta[t]) - wi))
            free.remove(j)
            pick.append(j)
        w2, V2 = theta[pick], Q @ Y[:, pick]
        V2 = V2 * torch.where(rs((V2 * MV).sum(0)) < 0, -1.0, 1.0)[None, :]
        res2 = residuals(dA, dM, w2, V2, tol, rs)
        if not bool((res2 <= res).all()):
            break
        w, V, res = w2, V2, res2
        rounds += 1
        if not float(res.max()) < 0.5 * worst:
            break
    return w, V, rounds


def orthonormal(X, rs):
    """Collective. An orthonormal basis of the columns of ``X`` (each scaled to unit
    norm first; directions below 1e-10 of the largest are dropped)."""
    nrm = torch.sqrt(rs((X * X).sum(0)))
    X = X[:, nrm > 0] / nrm[nrm > 0][None, :]
    G = rs(X.mT @ X)
    lam, U = torch.linalg.eigh(0.5 * (G + G.mT))
    keep = lam > 1e-10 * lam.max()
    return X @ (U[:, keep] * torch.rsqrt(lam[keep])[None, :])
