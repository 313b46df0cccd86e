"""Property-based differential tests of ``slasolve.eigsh`` against LAPACK (docs/testing.md).

Hypothesis draws small symmetric matrices (random SPD, indefinite, block, square/cube
grid Laplacians and "repeated" matrices whose every eigenvalue has multiplicity 2 or 3,
matrices with well-separated spectra), ``k``, ``which``, an optional shift ``sigma``
placed between two distinct eigenvalues, and an optional SPD mass matrix ``M``; the
reference is ``scipy.linalg.eigh`` on the dense matrices (every eigenvalue, WITH
multiplicity). Rank 0 drives hypothesis (``slasolve.testing.collective_property``).

Property: ``w`` is a valid answer (the ``k`` best eigenvalues for ``which``/``sigma``,
each copy of a repeated eigenvalue counted), the pairs have small residuals and are
``M``-orthonormal, simple eigenvectors match LAPACK's, and the result equals a one-rank
``eigsh`` on ``MPI.COMM_SELF`` (eigenvalues always, eigenvectors where simple).
"""
import numpy as np
import pytest
import scipy.linalg
from hypothesis import strategies as st
from mpi4py import MPI

import slasolve
from slasolve import DSparseTensor
from slasolve.testing import (case_matrix, collective_property, distribute_or_none, eig_selection_error,
                              mass_like_matrix, on_root)

pytestmark = [pytest.mark.mpi, pytest.mark.property]

BACKENDS = ("slepc", "torch")
KINDS = ("spd", "grid2d", "grid3d", "repeated", "separated", "symindef", "block2", "block3")
PARTITIONS = ("contiguous", "metis", "rcb", "hilbert", "random")
TOL = 1e-10


@st.composite
def eig_cases(draw, which):
    shift = which == "sigma"
    return {
        "kind": draw(st.sampled_from(KINDS)), "n": draw(st.integers(8, 48)),
        "seed": draw(st.integers(0, 2 ** 16)), "partition": draw(st.sampled_from(PARTITIONS)),
        "k": draw(st.integers(1, 6)), "which": "LM" if shift else which,
        # sigma between the j-th and (j+1)-th distinct eigenvalues, j = frac * (count - 1)
        # (j = -1: below the spectrum), never halfway (a tie has two right answers)
        "sigma_at": (draw(st.sampled_from([-1.0, 0.0, 0.3, 0.5, 0.99])), draw(st.sampled_from([0.3, 0.6])))
        if shift else None,
        "generalized": draw(st.booleans()),
    }


def _distinct(evals, scale):
    keep = np.concatenate([[True], np.diff(evals) > 1e-8 * scale])
    return evals[keep]


def _sigma(ex, evals, scale):
    if ex["sigma_at"] is None:
        return None
    frac, t = ex["sigma_at"]
    u = _distinct(evals, scale)
    if frac < 0:
        return float(u[0] - t * (u[1] - u[0]))
    j = min(int(frac * (u.size - 1)), u.size - 2)
    return float(u[j] + t * (u[j + 1] - u[j]))


def _expected(evals, k, which, sigma):
    key = {"LA": -evals, "SA": evals, "LM": -np.abs(evals), "SM": np.abs(evals)}[which] \
        if sigma is None else np.abs(evals - sigma)
    return np.sort(evals[np.argsort(key, kind="stable")[:k]])


def _like(M, dA, comm):
    """``M`` distributed with ``dA``'s row ownership (same partition)."""
    part = dA.spec.partition
    return DSparseTensor.from_global(M, comm, partition="contiguous" if part is None else part)


def _simple(evals, w, scale):
    """Columns whose eigenvalue is simple (relative gap > 1e-4) in the full spectrum."""
    return [j for j, v in enumerate(w) if np.sum(np.abs(evals - v) < 1e-4 * scale) == 1]


def _check_eigsh(comm, backend, ex):
    A, coords, bs = case_matrix(ex["kind"], ex["n"], ex["seed"])
    M = mass_like_matrix(A, ex["seed"]) if ex["generalized"] else None
    N = A.shape[0]
    Ad, Md = A.toarray(), None if M is None else M.toarray()
    evals, evecs = scipy.linalg.eigh(Ad, Md)
    scale = float(np.abs(evals).max())
    sigma = _sigma(ex, evals, scale)
    k = min(ex["k"], N - 1)
    dA = distribute_or_none(A, comm, ex["partition"], coords, ex["seed"])
    if dA is None:
        return  # the partitioner left a rank without rows (raised on every rank)
    dM = None if M is None else _like(M, dA, comm)
    kw = dict(M=dM, which=ex["which"], sigma=sigma, tol=TOL, backend=backend, return_info=True)
    if backend == "torch" and (sigma is not None or ex["which"] == "SM") and bs > 1:
        # documented refusal: torch shift-invert (also "SM" = shift-invert at 0) needs a scalar matrix
        with pytest.raises(ValueError, match="sigma"):
            slasolve.eigsh(dA, k, **kw)
        return
    w, V, info = slasolve.eigsh(dA, k, **kw)
    w = w.numpy()
    err = eig_selection_error(w, evals, k, ex["which"], sigma)
    assert err <= 1e-6 * scale, (
        f"eigenvalues {np.round(w, 8).tolist()} are not the k={k} "
        f"{'nearest sigma=%g' % sigma if sigma is not None else ex['which']}: LAPACK (with multiplicity) "
        f"gives {np.round(_expected(evals, k, ex['which'], sigma), 8).tolist()}; error {err:.2e}")
    Vg = dA.gather(V, root=None).numpy()
    MV = Vg if M is None else M @ Vg
    R = A @ Vg - MV * w[None, :]
    res = np.linalg.norm(R, axis=0) / (scale * np.linalg.norm(MV, axis=0))
    assert res.max() <= 1e-6, f"residuals {res.tolist()}"
    gram = Vg.T @ MV
    assert np.abs(gram - np.eye(k)).max() <= 1e-8, f"V^T M V - I: {np.abs(gram - np.eye(k)).max():.2e}"
    simple = _simple(evals, w, scale)
    for j in simple:
        ref = evecs[:, int(np.argmin(np.abs(evals - w[j])))]
        c = abs(float(ref @ MV[:, j]))
        assert abs(c - 1) <= 1e-6, f"eigenvector {j} (w={w[j]:.6g}): |<v, M v_lapack>| = {c:.10f}"
    # the same call on one rank (on rank 0, broadcast)
    def one_rank():
        d1 = DSparseTensor.from_global(A, MPI.COMM_SELF)
        kw1 = dict(kw, M=None if M is None else DSparseTensor.from_global(M, MPI.COMM_SELF))
        w1, V1, _ = slasolve.eigsh(d1, k, **kw1)
        return w1, V1

    w1, V1 = on_root(comm, one_rank)   # one copy, not one per rank competing for the cores
    assert np.abs(w1.numpy() - w).max() <= 2e-6 * scale, f"w(P ranks) {w.tolist()} != w(1 rank) {w1.tolist()}"
    d = [float(np.abs(V1.numpy()[:, j] - Vg[:, j]).max()) for j in simple]
    assert all(x <= 1e-5 for x in d), f"simple eigenvectors differ from the one-rank ones (signs?): {d}"


def _known_eig_cases(which):
    """Always run: repeated eigenvalues (square grid: multiplicity 2; "repeated": every
    eigenvalue doubled, generalized), a small block matrix (k close to n)."""
    base = {"kind": "grid2d", "n": 36, "seed": 0, "partition": "contiguous", "k": 4,
            "which": "LM" if which == "sigma" else which,
            "sigma_at": (0.3, 0.3) if which == "sigma" else None, "generalized": False}
    return [base, dict(base, kind="repeated", n=24, k=6, partition="metis", generalized=True),
            dict(base, kind="block2", n=8, k=4)]


@pytest.mark.parametrize("which", ["LA", "SA", "LM", "SM", "sigma"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_eigsh_matches_lapack(comm, backend, which):
    collective_property(comm, eig_cases(which), lambda ex: _check_eigsh(comm, backend, ex),
                        name=f"eigsh-{backend}-{which}", examples=6 if backend == "slepc" else 3,
                        full_examples=200,
                        explicit=_known_eig_cases(which)[:2] if backend == "slepc" else
                        _known_eig_cases(which)[::2])
