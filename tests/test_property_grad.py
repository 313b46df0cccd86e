"""Property-based ``torch.autograd.gradcheck`` (float64) through ``solve`` and ``eigsh``
on random small problems, partitions and rank counts, both backends (docs/testing.md).

Distributed functions are wrapped as ``global input (same on all ranks) -> local_slice
-> op -> replicate -> global output`` (``slasolve.testing``), so every rank perturbs the
same entries and sees the same Jacobian entries: gradcheck's verdict is identical on
every rank. Eigenvalue gradients are checked where they exist: simple eigenvalues
(``separated`` matrices), with the matrix parametrised symmetrically.
"""
import numpy as np
import pytest
import torch
from hypothesis import strategies as st

import slasolve
from slasolve.testing import (case_matrix, collective_property, distribute_or_none, local_slice,
                              mass_like_matrix, replicate)

pytestmark = [pytest.mark.mpi, pytest.mark.property]

PARTITIONS = ("contiguous", "metis", "random")
SOLVE_CASES = {"cg": ("spd", "block2"), "minres": ("spd", "symindef"),
               "gmres": ("nonsym", "block2ns", "spd"), "bicgstab": ("nonsym", "spd")}


def _offsets(comm, n):
    return np.concatenate([[0], np.cumsum(comm.allgather(int(n)))]).astype(int)


@st.composite
def solve_grad_cases(draw, backend):
    method = draw(st.sampled_from(sorted(SOLVE_CASES)))
    kind = draw(st.sampled_from(SOLVE_CASES[method]))
    pcs = ("none", "jacobi", "ilu")
    if method == "minres":  # MINRES needs an SPD preconditioner
        pcs = ("none", "jacobi") if kind == "spd" else ("none",)
    return {"method": method, "kind": kind,
            "n": draw(st.integers(8, 12)), "seed": draw(st.integers(0, 2 ** 16)),
            "partition": draw(st.sampled_from(PARTITIONS)), "pc": draw(st.sampled_from(pcs))}


def _check_solve_grad(comm, backend, ex):
    A, coords, _ = case_matrix(ex["kind"], ex["n"], ex["seed"])
    dA = distribute_or_none(A, comm, ex["partition"], coords, ex["seed"])
    if dA is None:
        return
    vshape = tuple(dA.values.shape)
    voff = _offsets(comm, dA.values.numel())
    roff = _offsets(comm, dA.n_local)
    r = comm.Get_rank()
    vg = torch.cat(comm.allgather(dA.values.detach().reshape(-1))).requires_grad_()
    bg = torch.from_numpy(np.random.default_rng(ex["seed"]).standard_normal(A.shape[0])).requires_grad_()

    def f(v, b):
        vl = local_slice(v, voff[r], voff[r + 1], comm).reshape(vshape)
        bl = local_slice(b, roff[r], roff[r + 1], comm)
        x = slasolve.solve(dA.with_values(vl), bl, ex["method"], backend=backend, pc=ex["pc"],
                           rtol=1e-13, atol=1e-300)
        return replicate(x, comm)

    assert torch.autograd.gradcheck(f, (vg, bg), atol=1e-6, rtol=1e-5, fast_mode=True)


@pytest.mark.parametrize("backend", ("petsc", "torch"))
def test_solve_gradcheck(comm, backend):
    collective_property(comm, solve_grad_cases(backend), lambda ex: _check_solve_grad(comm, backend, ex),
                        name=f"solve_gradcheck-{backend}", examples=6, full_examples=100)


@st.composite
def eig_grad_cases(draw):
    return {"n": draw(st.integers(8, 24)), "seed": draw(st.integers(0, 2 ** 16)),
            "k": draw(st.integers(1, 3)), "which": draw(st.sampled_from(("LA", "SA", "LM", "SM"))),
            "partition": draw(st.sampled_from(PARTITIONS)), "generalized": draw(st.booleans())}


def _transpose_perm(comm, dA):
    """Position of entry (j, i) for each entry (i, j) of the concatenated local values."""
    rows = dA.local.row_indices().numpy() + dA.row_range[0]
    cols = dA.local.indices.numpy()
    R = np.concatenate(comm.allgather(rows))
    C = np.concatenate(comm.allgather(cols))
    n = int(dA.global_shape[1])
    key = R.astype(np.int64) * n + C
    order = np.argsort(key)
    pos = np.searchsorted(key[order], C.astype(np.int64) * n + R)
    return torch.from_numpy(order[pos])


def _check_eig_grad(comm, backend, ex):
    A, coords, _ = case_matrix("separated", ex["n"], ex["seed"])
    dA = distribute_or_none(A, comm, ex["partition"], coords, ex["seed"])
    if dA is None:
        return
    dM = None
    if ex["generalized"]:
        part = dA.spec.partition
        dM = slasolve.DSparseTensor.from_global(mass_like_matrix(A, ex["seed"]), comm,
                                               partition="contiguous" if part is None else part)
    r = comm.Get_rank()
    voff = _offsets(comm, dA.values.numel())
    tperm = _transpose_perm(comm, dA)
    vg = torch.cat(comm.allgather(dA.values.detach())).requires_grad_()

    def f(v):
        vs = 0.5 * (v + v[tperm])  # symmetric parametrisation: every perturbation keeps A symmetric
        vl = local_slice(vs, voff[r], voff[r + 1], comm)
        w, _ = slasolve.eigsh(dA.with_values(vl), ex["k"], M=dM, which=ex["which"], tol=1e-13,
                              backend=backend)
        return w

    assert torch.autograd.gradcheck(f, (vg,), atol=1e-5, rtol=1e-4, fast_mode=True)


@pytest.mark.parametrize("backend", ("slepc", "torch"))
def test_eigsh_eigenvalue_gradcheck(comm, backend):
    collective_property(comm, eig_grad_cases(), lambda ex: _check_eig_grad(comm, backend, ex),
                        name=f"eigsh_gradcheck-{backend}", examples=5, full_examples=100)
