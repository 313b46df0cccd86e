"""The multiplicity verification of :func:`slasolve.eigsh` (its Notes): deflated re-solves, or
Sylvester inertia counts where they apply."""
from __future__ import annotations

import torch

from .subspace import m_orthonormalize
from .torch_methods import start_vectors

__all__ = ["verify", "inertia_verified", "want_key", "VERIFY_NEV", "INERTIA_BAND"]

#: candidates asked from each deflated verification solve (at most k)
VERIFY_NEV = 2


def want_key(w, which, sigma):
    """Smaller key = more wanted."""
    if sigma is not None:
        return (w - sigma).abs()
    return {"SA": w, "LA": -w, "LM": -w.abs(), "SM": w.abs()}[which]


def verify(solver, w, V, k, which, sigma, tol, n, dM, rs, row_offset, row_ids):
    """Collective. Make ``(w, V)`` the ``k`` wanted eigenpairs counted with multiplicity.

    A single-vector method finds one copy of each repeated eigenvalue (its start
    vector has one component per eigenspace). Each round re-solves in the
    M-orthogonal complement of ``span(V)`` (``solver.solve(..., deflate=V)``) from a
    new start vector; every converged eigenvalue of the deflated problem more
    wanted than the current k-th (by more than ``delta``) was missed: merge, keep
    the ``k`` most wanted, repeat. A round that finds nothing better proves the set
    (the deflated problem's most wanted eigenvalue is the best one left out).

    Returns ``(w, V, rounds, w_next, error)``: ``w_next`` the most wanted eigenvalue
    left out (None when unknown), ``error`` a message when the verification could not
    be completed (None on success). All decisions use reduced data: identical on
    every rank.
    """
    max_rounds = k + 2
    eps = torch.finfo(w.dtype).eps
    for rnd in range(1, max_rounds + 1):
        MV = dM @ V if dM is not None else V
        n_rest = n - V.shape[1]
        nev = min(VERIFY_NEV, k)
        v0 = start_vectors(V.shape[0], 1, row_offset=row_offset, row_ids=row_ids, seed=1000 + rnd,
                           dtype=V.dtype, device=V.device)[:, 0]
        if n_rest <= max(2 * nev + 8, 16):
            wc, Vc = complement_rr(solver, V, MV, n_rest, row_offset, row_ids, rs, dM)
            nconv = wc.numel()
        else:
            wc, Vc, nconv, _its, _t = solver.solve(nev, v0, (V, MV))
            wc, Vc = wc.to(w.dtype), Vc.to(V.dtype)
        if nconv < 1 or wc.numel() < 1:
            return w, V, rnd, None, (
                f"the deflated verification solve (round {rnd}) did not converge, so the {k} eigenvalues "
                "cannot be confirmed to be the wanted ones counted with multiplicity; raise maxiter / ncv "
                "or loosen tol")
        wc, Vc = wc[:nconv], Vc[:, :nconv]
        key, keyc = want_key(w, which, sigma), want_key(wc, which, sigma)
        kth = float(key.max())
        scale = max(float(w.abs().max()), float(wc.abs().max()))
        delta = 10 * tol * (max(abs(kth), float(keyc.abs().min())) + (abs(sigma) if sigma is not None else 0)) \
            + 100 * eps * scale
        better = keyc < kth - delta
        best = int(torch.argmin(keyc))
        if not bool(better.any()):
            return w, V, rnd, float(wc[best]), None
        # the candidates are M-orthogonal to V up to the deflation accuracy
        cross = rs(Vc.mT @ MV).abs().max() if V.shape[1] else torch.zeros(())
        if not float(cross) < 1e-6:
            return w, V, rnd, None, (
                f"the deflated verification solve returned vectors not M-orthogonal to the found ones "
                f"(|V^T M v| = {float(cross):.2e}: this method seems to ignore the deflation space); cannot "
                "confirm the eigenvalue multiplicities. Use the default Krylov-Schur")
        pool_w = torch.cat([w, wc[better]])
        pool_V = torch.cat([V, Vc[:, better]], 1)
        order = torch.sort(want_key(pool_w, which, sigma), stable=True).indices[:k]
        w, V = pool_w[order], pool_V[:, order]
        V = m_orthonormalize(V, dM, rs)
    return w, V, max_rounds, None, (
        f"the multiplicity verification did not settle after {max_rounds} deflated solves")


#: Sylvester inertia counts are trusted for eigenvalues farther than this many ``eps ||A||`` from
#: the shift (the backward error of MUMPS' LDL^T with threshold pivoting, with room)
INERTIA_BAND = 1e4


def inertia_verified(dA, w, V, sigma, rs, rm, count=None) -> bool:
    """Collective. Prove, without another eigensolve, that the ``k`` orthonormal pairs
    ``(w, V)`` found nearest ``sigma`` of a standard problem are the ``k`` nearest eigenvalues
    counted with multiplicity (up to their residuals).

    With ``R = A V - V diag(w)`` there are ``k`` eigenvalues within ``||R||_F`` of the ``w``
    (Kahan). Sylvester's law of inertia: the LDL^T factorisation of ``A - tau I`` has as many
    negative pivots as ``A`` has eigenvalues below ``tau``. With ``rho = kth + 2 (||R||_F +
    band)`` (``kth`` the largest ``|w - sigma|``, ``band`` the rounding band of the counts)
    one factorisation at ``sigma + rho`` (a second at ``sigma - rho`` only when the first
    count exceeds ``k``) counts the eigenvalues in ``(sigma - rho, sigma + rho)``: a count of
    ``k`` means these are the ``k`` matched ones, so none nearer than the ``k``-th was
    missed. False (then :func:`verify` runs) when the count is larger (missed copies, or an
    eigenvalue within ``rho - kth`` of the ``k``-th) or when no LDL^T inertia can be had
    (MUMPS missing, ``A`` not exactly symmetric, a diagonal entry not stored, ``tau`` within
    rounding of an eigenvalue). ``count(tau)``: the inertia of ``A - tau I`` or None (default
    :func:`slasolve.direct.petsc_backend.shifted_inertia`). Decisions use reduced data only."""
    if count is None:
        from ..direct.petsc_backend import shifted_inertia

        def count(tau):
            return shifted_inertia(dA, tau)
    eps = torch.finfo(torch.float64).eps
    k = int(w.numel())
    w64, V64 = w.to(torch.float64), V.to(torch.float64)
    row_sums = dA.with_values(dA.values.abs()) @ V64.new_ones(V64.shape[0])
    local = row_sums.max() if row_sums.numel() else row_sums.new_zeros(())
    norm_a = float(rm(local.reshape(1))[0])   # ||A||_inf
    R = dA @ V64 - V64 * w64[None, :]
    err = float(torch.sqrt(rs((R ** 2).sum().reshape(1))[0]))
    kth = float((w64 - sigma).abs().max())
    band = INERTIA_BAND * eps * (norm_a + abs(sigma) + kth)
    rho = kth + 2 * (err + band)
    hi = count(sigma + rho)
    if hi is None or hi[1] > 0:
        return False
    if hi[0] <= k:
        return True
    lo = count(sigma - rho)
    return lo is not None and lo[1] == 0 and hi[0] - lo[0] <= k


def complement_rr(solver, V, MV, n_rest, row_offset, row_ids, rs, dM):
    """Collective. All eigenpairs of the (small, ``n_rest``-dimensional, invariant)
    M-orthogonal complement of ``span(V)``: Rayleigh-Ritz on a random block
    projected into it (no global arrays; for ``k`` close to ``n``)."""
    Z = start_vectors(V.shape[0], n_rest, row_offset=row_offset, row_ids=row_ids, seed=777,
                      dtype=V.dtype, device=V.device)
    for _ in range(2):
        Z = Z - V @ rs(MV.mT @ Z)
    Z = m_orthonormalize(Z, dM, rs)
    AZ = solver.dA @ Z
    H = rs(Z.mT @ AZ)
    theta, C = torch.linalg.eigh(0.5 * (H + H.mT))
    return theta, Z @ C
