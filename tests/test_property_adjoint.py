"""Adjoint properties under the operations users get wrong (issue 18), on random small
problems, partitions and rank counts, both backends (docs/testing.md):

* a value change between forward and backward (in place, through an optimiser step, or
  on one rank only) raises RuntimeError on every rank; a change that builds new tensors
  (``with_values``) does not, and the gradient is the forward's;
* CG/MINRES on a slightly nonsymmetric matrix (a few entries perturbed by 0.1-1%, as
  one-sided Dirichlet elimination makes) return ``A^{-T} w`` for ``d(w.x)/db``, as SciPy's
  LU of ``A^T`` gives.
"""
import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as ssl
import torch
from hypothesis import strategies as st

import slasolve
from slasolve.testing import case_matrix, collective_property, distribute_or_none

pytestmark = [pytest.mark.mpi, pytest.mark.property]

PARTITIONS = ("contiguous", "metis", "random")


@st.composite
def cases(draw):
    return {"kind": draw(st.sampled_from(("spd", "grid2d"))), "n": draw(st.integers(8, 30)),
            "seed": draw(st.integers(0, 2 ** 16)), "partition": draw(st.sampled_from(PARTITIONS)),
            "backend": draw(st.sampled_from(("petsc", "torch"))),
            "method": draw(st.sampled_from(("cg", "minres", "gmres"))),
            "defect": draw(st.sampled_from((0.0, 1e-3, 1e-2))),
            "mutation": draw(st.sampled_from(("none", "inplace", "optim", "one_rank", "with_values")))}


def _perturbed(A, defect, seed):
    """``A`` with a few off-diagonal entries scaled by ``1 + defect`` on one side only."""
    A = sp.csr_matrix(A, dtype=np.float64).tolil()
    if defect:
        rng = np.random.default_rng(seed)
        C = sp.triu(A.tocsr(), 1).tocoo()
        pick = rng.choice(C.nnz, size=min(3, C.nnz), replace=False)
        for i, j in zip(C.row[pick], C.col[pick]):
            A[i, j] = A[i, j] * (1 + defect)
    return A.tocsr()


def _check(comm, ex):
    A0, coords, _ = case_matrix(ex["kind"], ex["n"], ex["seed"])
    A = _perturbed(A0, ex["defect"], ex["seed"])
    dA = distribute_or_none(A, comm, ex["partition"], coords, ex["seed"])
    if dA is None:
        return
    values = dA.values.detach().clone().requires_grad_(True)
    dA = dA.with_values(values)
    rng = np.random.default_rng(ex["seed"] + 1)
    bg, wg = rng.standard_normal(A.shape[0]), rng.standard_normal(A.shape[0])
    b = dA.scatter(torch.from_numpy(bg), root=None).clone().requires_grad_(True)   # user numbering
    w = dA.scatter(torch.from_numpy(wg), root=None)
    x = slasolve.solve(dA, b, ex["method"], backend=ex["backend"], rtol=1e-12, atol=1e-300)
    loss = slasolve.global_sum((w * x).sum())
    m = ex["mutation"]
    if m in ("inplace", "one_rank"):
        with torch.no_grad():
            if m == "inplace" or comm.Get_rank() == comm.Get_size() - 1:
                values.mul_(1.5)
    elif m == "optim":
        values.grad = torch.ones_like(values)
        torch.optim.SGD([values], lr=1e-3).step()
        values.grad = None
    elif m == "with_values":
        dA = dA.with_values(values.detach() * 1.5)   # new tensors: the forward's are untouched
    if m in ("inplace", "optim", "one_rank"):
        with pytest.raises(RuntimeError, match="inplace"):
            loss.backward()
        return
    loss.backward()
    lam = ssl.spsolve(A.T.tocsc(), wg)
    xs = ssl.spsolve(A.tocsc(), bg)
    scale = np.abs(lam).max()
    assert np.allclose(dA.gather(b.grad, root=None).numpy(), lam, rtol=1e-7, atol=1e-8 * scale)
    assert np.allclose(dA.gather(x.detach(), root=None).numpy(), xs, rtol=1e-7, atol=1e-8 * np.abs(xs).max())
    # dL/dA_ij = -lam_i x_j on the stored entries, in the tensor's own (partitioned) numbering
    x_all = np.concatenate(comm.allgather(x.detach().numpy()))
    G = dA.local.with_values(values.grad).to_scipy().tocoo()
    lam_own = b.grad.numpy()
    assert np.allclose(G.data, -lam_own[G.row] * x_all[G.col], rtol=1e-9,
                       atol=1e-12 * scale * np.abs(xs).max())


def test_adjoint_after_mutation_or_asymmetry(comm):
    collective_property(comm, cases(), lambda ex: _check(comm, ex), name="adjoint_safety", examples=12,
                        full_examples=200)
