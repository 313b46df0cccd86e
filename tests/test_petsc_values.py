"""The cached PETSc Mat compared with its own value arrays (slasolve._petsc_values): no
private copy of the values for scalar AIJ Mats, and every change is still seen (writes
that bump no version, a change on one rank only, the Mat changed behind slasolve's back).
Answers against SciPy. Runs at any rank count."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch
from mpi4py import MPI

import slasolve
from slasolve.testing import distribute

pytest.importorskip("petsc4py")
from slasolve.petsc import to_petsc_mat  # noqa: E402

COMM = MPI.COMM_WORLD


def _matrix(n=60, seed=3):
    A = sp.random(n, n, density=0.08, random_state=seed) + n * sp.eye(n)
    A = sp.csr_matrix(A)
    A.sort_indices()
    return A


def _solve_err(dA, A_now, b):
    r0, r1 = dA.row_range
    x = slasolve.solve(dA, torch.from_numpy(b[r0:r1].copy()).to(dA.values.dtype), "gmres", pc="jacobi",
                       rtol=1e-12)
    ref = spla.spsolve(sp.csc_matrix(A_now), b)
    return COMM.allreduce(float(np.abs(x.double().numpy() - ref[r0:r1]).max(initial=0.0)), op=MPI.MAX)


@pytest.mark.mpi
@pytest.mark.parametrize("partition", ["contiguous", "metis"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_changes_seen_without_a_copy(partition, dtype):
    A = _matrix()
    n = A.shape[0]
    dA = distribute(A, COMM, partition)
    dA = dA.with_values(dA.values.to(dtype))
    to_petsc_mat(dA)
    mat, snapshot, view = dA._layout.cache("petsc_mats")["aij"]
    assert view is not None and snapshot is None       # compared with the Mat, no 8 B/nnz copy
    b = np.linspace(1.0, 2.0, n)     # in dA's numbering, like _global_now
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    for step in range(4):
        if step == 1:      # every rank, through a NumPy view: no version bump
            dA.values.detach().numpy()[:] *= 2
        elif step == 2:    # one rank only (the last one), one entry
            if COMM.rank == COMM.size - 1 and dA.values.numel():
                dA.values.detach().numpy()[0] += 1.0
        elif step == 3:    # behind slasolve's back, in the PETSc Mat itself
            r0, _ = mat.getOwnershipRange()
            if mat.getOwnershipRange()[1] > r0:
                mat.setValue(r0, r0, 1e3)
            mat.assemble()
        G = _global_now(dA)
        assert _solve_err(dA, G, b) < tol * max(1.0, np.abs(spla.spsolve(sp.csc_matrix(G), b)).max())


def _global_now(dA):
    """The whole current matrix (small test sizes) in dA's numbering, from every rank's rows."""
    loc = dA.local
    r0, _ = dA.row_range
    ip, ix = loc.indptr.numpy(), loc.indices.numpy()
    rows = r0 + np.repeat(np.arange(ip.size - 1), np.diff(ip))
    parts = COMM.allgather((rows, ix.astype(np.int64), loc.values.detach().double().numpy()))
    r = np.concatenate([p[0] for p in parts])
    c = np.concatenate([p[1] for p in parts])
    v = np.concatenate([p[2] for p in parts])
    N = dA.global_shape[0]
    return sp.csr_matrix((v, (r, c)), shape=(N, N))


@pytest.mark.mpi
def test_block_tensors_keep_their_copy_and_answer_right():
    A = sp.bsr_matrix(sp.kron(_matrix(20, seed=5), np.array([[2.0, 0.5], [0.3, 1.0]])), blocksize=(2, 2))
    n = A.shape[0]
    dA = distribute(A, COMM, "contiguous")
    assert dA.local.is_block
    to_petsc_mat(dA)
    entry = next(iter(dA._layout.cache("petsc_mats").values()))
    assert entry[1] is not None and entry[2] is None      # block Mats: compared with a copy
    dA.values.detach().numpy()[...] *= 3
    b = torch.linspace(1.0, 2.0, n, dtype=torch.float64)
    x = slasolve.solve(dA, dA.scatter(b, root=None), "gmres", rtol=1e-12)
    ref = spla.spsolve(sp.csc_matrix(3 * A), b.numpy())
    assert np.abs(dA.gather(x, root=None).numpy() - ref).max() < 1e-9


@pytest.mark.mpi
def test_a_comparer_failing_on_one_rank_refills_instead_of_hanging(monkeypatch):
    """The comparison runs on each rank before the Allreduce that decides the refill: if it
    fails on one rank only, that rank must vote 'refill' rather than raise alone."""
    from slasolve import _petsc_values
    A = _matrix()
    dA = distribute(A, COMM, "contiguous")
    to_petsc_mat(dA)
    assert dA._layout.cache("petsc_mats")["aij"][2] is not None
    real = _petsc_values.AIJValues.equal

    def flaky(self, values):
        if COMM.rank == 0:
            raise RuntimeError("simulated failure on rank 0")
        return real(self, values)
    monkeypatch.setattr(_petsc_values.AIJValues, "equal", flaky)
    dA.values.detach().numpy()[:] *= 2
    b = np.linspace(1.0, 2.0, A.shape[0])
    assert _solve_err(dA, _global_now(dA), b) < 1e-10 * np.abs(spla.spsolve(sp.csc_matrix(2 * A), b)).max()
