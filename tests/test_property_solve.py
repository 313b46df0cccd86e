"""Property-based differential tests of ``slasolve.solve`` against SciPy (docs/testing.md).

Hypothesis draws small matrices from named families (``slasolve.testing.case_matrix``),
partitions, methods, preconditioners, tolerances, right-hand sides and initial guesses;
rank 0 drives hypothesis and every rank runs the same example
(``slasolve.testing.collective_property``). The references are SciPy's ``spsolve``,
dense SVD for the condition number and a one-rank solve on ``MPI.COMM_SELF``.

Properties (each states the correct behaviour, none is weakened to pass):
* well-posed systems converge, meet SciPy's criterion ``||b - A x|| <= max(rtol ||b||, atol)``
  on the true residual, lie within the forward-error bound of ``spsolve``'s answer, agree
  with the one-rank solve, and leave ``b`` and ``x0`` untouched;
* singular systems raise ``ConvergenceError`` (or return ``converged=False`` with
  ``raise_on_fail=False``), never "converged" with a residual that misses the criterion;
* complex input is solved correctly or refused with TypeError/ValueError, never truncated.
"""
import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch
from hypothesis import strategies as st
from mpi4py import MPI

import slasolve
from slasolve import ConvergenceError, DSparseTensor
from slasolve.testing import (case_matrix, collective_property, distribute, distribute_or_none, on_root,
                              residual_bound_ok)

pytestmark = [pytest.mark.mpi, pytest.mark.property]

BACKENDS = ("petsc", "torch")
PARTITIONS = ("contiguous", "metis", "rcb", "hilbert", "random")
SPD_KINDS = ("spd", "grid2d", "grid3d", "block2", "block3", "elastic2", "diagrows", "repeated")
NONSYM_KINDS = ("nonsym", "block2ns")
INDEF_KINDS = ("symindef",)
SINGULAR_KINDS = ("laplacian", "emptyrows", "emptyrows_ns")
#: (kind, method) pairs where breaking down is legitimate: raising is then the right answer
MAY_FAIL = {("symindef", "bicgstab")}


def _methods(kind):
    if kind in SPD_KINDS:
        return ("cg", "minres", "gmres", "bicgstab")
    if kind in INDEF_KINDS:
        return ("minres", "gmres", "bicgstab")
    return ("gmres", "bicgstab")


def _pcs(backend, kind, method):
    if kind in INDEF_KINDS and method == "minres":
        return ("none",)  # MINRES needs an SPD preconditioner
    pcs = ("none", "jacobi", "ilu")
    return pcs + ("gamg",) if backend == "petsc" and kind in SPD_KINDS else pcs


METHODS = ("cg", "minres", "gmres", "bicgstab")


@st.composite
def solve_cases(draw, backend, method):
    kind = draw(st.sampled_from([k for k in SPD_KINDS + NONSYM_KINDS + INDEF_KINDS if method in _methods(k)]))
    return {
        "kind": kind, "n": draw(st.integers(8, 60)), "seed": draw(st.integers(0, 2 ** 16)),
        "partition": draw(st.sampled_from(PARTITIONS)), "method": method,
        "pc": draw(st.sampled_from(_pcs(backend, kind, method))),
        "rtol": draw(st.sampled_from([1e-10, 1e-8, 1e-6, 1e-12, 1e-3, 0.5, 1.0, 2.0])),
        "atol": draw(st.sampled_from([0.0, 1e-12, 1e-6])),
        "rhs": draw(st.sampled_from(["random", "ones", "zero"])),
        "x0": draw(st.sampled_from(["none", "random", "zero"])),
    }


# ----------------------------------------------------------------------------- helpers
def _vector(kind, n, seed):
    rng = np.random.default_rng(seed)
    if kind == "none":
        return None
    if kind == "zero":
        return np.zeros(n)
    if kind == "ones":
        return np.ones(n)
    return rng.standard_normal(n)


def _distribute(A, comm, ex, coords):
    """The distributed matrix, or None when the partitioner leaves a rank without rows
    (a clear ValueError raised on every rank: a limitation, not a wrong answer)."""
    return distribute_or_none(A, comm, ex["partition"], coords, ex["seed"])


def _same_outcome_everywhere(comm, outcome):
    """Every rank must end a collective call the same way (the same exception type, or none)."""
    outcomes = comm.allgather(outcome)
    assert len(set(outcomes)) == 1, f"ranks ended the call differently: {outcomes}"


def _solve(dA, b, ex, backend, x0, **kw):
    return slasolve.solve(dA, b, ex["method"], backend=backend, pc=ex["pc"], rtol=ex["rtol"],
                          atol=ex["atol"], x0=x0, return_info=True, **kw)


# ---------------------------------------------------------------------------- properties
def _check_well_posed(comm, backend, ex):
    A, coords, _ = case_matrix(ex["kind"], ex["n"], ex["seed"])
    dA = _distribute(A, comm, ex, coords)
    if dA is None:
        return
    n = A.shape[0]
    bg = _vector(ex["rhs"], n, ex["seed"] + 1)
    x0g = _vector(ex["x0"], n, ex["seed"] + 2)
    b = dA.scatter(torch.from_numpy(bg), root=None)
    x0 = None if x0g is None else dA.scatter(torch.from_numpy(x0g), root=None)
    b_copy, x0_copy = b.clone(), None if x0 is None else x0.clone()
    x, info = _solve(dA, b, ex, backend, x0, raise_on_fail=False)
    xg = dA.gather(x, root=None).numpy()
    assert torch.equal(b, b_copy), "solve modified b"
    assert x0 is None or torch.equal(x0, x0_copy), "solve modified x0"
    if (ex["kind"], ex["method"]) not in MAY_FAIL:
        assert info.converged, f"well-conditioned system did not converge: {info.summary()}"
    if not info.converged:
        return
    ok, r, bound = residual_bound_ok(A, bg, xg, ex["rtol"], ex["atol"])
    assert ok, (f"converged ({info.summary()}) but the true residual {r:.3e} exceeds "
                f"max(rtol ||b||, atol) = {bound:.3e}")
    smin = np.linalg.svd(A.toarray(), compute_uv=False)[-1]
    xref = spla.spsolve(sp.csc_matrix(A), bg)
    fbound = 1.01 * bound / smin + 1e-12 * np.linalg.norm(xref)
    ferr = float(np.linalg.norm(xg - xref))
    assert ferr <= fbound, f"forward error {ferr:.3e} > bound {fbound:.3e} ({info.summary()})"
    # the same solve on one rank (on rank 0, broadcast)
    def one_rank():
        d1 = DSparseTensor.from_global(A, MPI.COMM_SELF)
        return _solve(d1, torch.from_numpy(bg), ex, backend, None if x0g is None else torch.from_numpy(x0g),
                      raise_on_fail=False)

    x1, info1 = on_root(comm, one_rank)   # one copy, not one per rank competing for the cores
    assert info1.converged, f"one-rank solve did not converge: {info1.summary()}"
    d = float(np.linalg.norm(x1.numpy() - xg))
    assert d <= 2 * fbound, f"|x(P ranks) - x(1 rank)| = {d:.3e} > {2 * fbound:.3e}"


def _known_solve_cases(method):
    """Always run: rtol >= 1, b = 0 with a nonzero x0, a block matrix with a random partition."""
    base = {"kind": "grid2d", "n": 16, "seed": 0, "partition": "contiguous", "method": method, "pc": "none",
            "rtol": 1e-8, "atol": 0.0, "rhs": "random", "x0": "none"}
    return [dict(base, rtol=1.5), dict(base, rhs="zero", x0="random"),
            dict(base, kind="block2", partition="random", pc="jacobi", x0="random")]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_solve_matches_spsolve(comm, backend, method):
    collective_property(comm, solve_cases(backend, method), lambda ex: _check_well_posed(comm, backend, ex),
                        name=f"solve_matches_spsolve-{backend}-{method}", examples=8, full_examples=300,
                        explicit=_known_solve_cases(method))


@st.composite
def singular_cases(draw, backend):
    kind = draw(st.sampled_from(SINGULAR_KINDS))
    pcs = ("none", "jacobi", "ilu") + (("gamg",) if backend == "petsc" else ())
    return {
        "kind": kind, "n": draw(st.integers(8, 40)), "seed": draw(st.integers(0, 2 ** 16)),
        "partition": draw(st.sampled_from(PARTITIONS)),
        "method": draw(st.sampled_from(("cg", "minres", "gmres", "bicgstab"))),
        "pc": draw(st.sampled_from(pcs)), "rtol": draw(st.sampled_from([1e-10, 1e-8, 1e-6])),
        "atol": 0.0, "raise_on_fail": draw(st.booleans()),
        "rhs": draw(st.sampled_from(["random", "consistent"])),
    }


def _check_singular(comm, backend, ex):
    A, coords, _ = case_matrix(ex["kind"], ex["n"], ex["seed"])
    dA = _distribute(A, comm, ex, coords)
    if dA is None:
        return
    n = A.shape[0]
    bg = _vector("random", n, ex["seed"] + 1)
    if ex["rhs"] == "consistent":
        bg = A @ bg
    b = dA.scatter(torch.from_numpy(bg), root=None)
    rof = ex["raise_on_fail"]
    outcome, info, x = None, None, None
    try:
        x, info = _solve(dA, b, ex, backend, None, raise_on_fail=rof, maxiter=10 * n)
    except ConvergenceError:
        outcome = "ConvergenceError"
    except ValueError as e:
        # refusing a matrix with empty rows (no diagonal entry) up front is a fine answer
        outcome = "ValueError" if ex["kind"] != "laplacian" else repr(e)
    _same_outcome_everywhere(comm, outcome)
    if outcome == "ConvergenceError":
        assert rof, "ConvergenceError raised although raise_on_fail=False"
        return
    if outcome is not None:
        assert outcome == "ValueError", f"unexpected error {outcome}"
        return
    xg = dA.gather(x, root=None).numpy()
    if not info.converged:
        assert not rof, f"returned converged=False although raise_on_fail=True: {info.summary()}"
        return
    ok, r, bound = residual_bound_ok(A, bg, xg, ex["rtol"], ex["atol"])
    assert ok, (f"singular system reported converged ({info.summary()}) but ||b - A x|| = {r:.3e} > "
                f"{bound:.3e}: a wrong answer marked converged")


@pytest.mark.parametrize("backend", BACKENDS)
def test_singular_systems_never_converge_wrongly(comm, backend):
    collective_property(comm, singular_cases(backend), lambda ex: _check_singular(comm, backend, ex),
                        name=f"singular-{backend}", examples=15, full_examples=300,
                        explicit=[{"kind": "laplacian", "n": 10, "seed": 0, "partition": "contiguous",
                                   "method": "cg", "pc": "none", "rtol": 1e-8, "atol": 0.0,
                                   "raise_on_fail": False, "rhs": "random"}])


@st.composite
def complex_cases(draw):
    return {"n": draw(st.integers(8, 30)), "seed": draw(st.integers(0, 2 ** 16)),
            "complex": draw(st.sampled_from(["A", "b", "both"])),
            "method": draw(st.sampled_from(("gmres", "bicgstab", "cg"))),
            "partition": draw(st.sampled_from(("contiguous", "random")))}


def _check_complex(comm, backend, ex):
    rng = np.random.default_rng(ex["seed"])
    A, coords, _ = case_matrix("spd" if ex["method"] == "cg" else "nonsym", ex["n"], ex["seed"])
    if ex["complex"] in ("A", "both"):
        A = (A + 0.3j * sp.csr_matrix((rng.uniform(-1, 1, A.nnz), A.indices, A.indptr), A.shape)).tocsr()
        if ex["method"] == "cg":  # keep it Hermitian positive definite
            A = (0.5 * (A + A.conj().T)).tocsr()
    n = A.shape[0]
    bg = rng.standard_normal(n) + (1j * rng.standard_normal(n) if ex["complex"] in ("b", "both") else 0)
    outcome, x, dA = None, None, None
    try:
        dA = distribute(A, comm, ex["partition"], coords, ex["seed"])
        b = dA.scatter(torch.from_numpy(np.asarray(bg)), root=None)
        x = slasolve.solve(dA, b, ex["method"], backend=backend, rtol=1e-10)
    except (TypeError, ValueError) as e:
        outcome = type(e).__name__
    _same_outcome_everywhere(comm, outcome)
    if outcome is not None:
        return  # refused on every rank: fine
    xg = dA.gather(x, root=None).numpy()
    assert np.iscomplexobj(xg), f"complex input ({ex['complex']}) gave a real solution {x.dtype}: imaginary part dropped"
    ok, r, bound = residual_bound_ok(A, bg, xg, 1e-10, 0.0)
    assert ok, f"complex solve: ||b - A x|| = {r:.3e} > {bound:.3e}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_complex_input_solved_or_refused(comm, backend):
    collective_property(comm, complex_cases(), lambda ex: _check_complex(comm, backend, ex),
                        name=f"complex-{backend}", examples=6, full_examples=60,
                        explicit=[{"n": 10, "seed": 0, "complex": c, "method": "gmres", "partition": "contiguous"}
                                  for c in ("both", "b")])
