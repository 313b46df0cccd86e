"""MPI tests of the PETSc bridge: Mat/Vec round trips, in-place refills, BAIJ."""
import numpy as np
import pytest
import torch
from mpi4py import MPI

from slasolve import DSparseTensor, from_petsc
from slasolve.testing import block_spd_matrix, poisson_matrix, random_matrix

PETSc = pytest.importorskip("petsc4py.PETSc", reason="petsc4py is not installed")
from slasolve.petsc import tensor_to_vec, vec_to_tensor  # noqa: E402

pytestmark = pytest.mark.mpi


def all_ok(comm, flag) -> bool:
    return bool(comm.allreduce(int(bool(flag)), op=MPI.MIN))


def rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)


def same_local(dA, dB) -> bool:
    return (dA.row_range == dB.row_range and dA.block_shape == dB.block_shape
            and torch.equal(dA.local.indptr, dB.local.indptr)
            and torch.equal(dA.local.indices, dB.local.indices)
            and torch.equal(dA.values, dB.values))


CASES = {
    "poisson": lambda: poisson_matrix((9, 8)),
    "random": lambda: random_matrix(70, density=0.06, seed=3, empty_rows=[4]),
    "block2": lambda: block_spd_matrix((5, 4), 2, seed=1),
    "block3": lambda: block_spd_matrix((4, 4), 3, seed=2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_and_matmult(comm, case):
    A = CASES[case]()
    dA = DSparseTensor.from_global(A, comm, partition="metis" if case == "random" else "contiguous")
    M = dA.to_petsc()
    blocked = bool(dA.block_shape)
    assert ("baij" in M.getType()) == blocked
    if blocked:
        assert M.getBlockSize() == dA.block_shape[0]
    assert M.getOwnershipRange() == dA.row_range
    assert M.getSize() == A.shape
    dB = from_petsc(M)
    assert ("baij" in M.getType()) == blocked  # from_petsc leaves the Mat as it was
    ok = same_local(dA, dB)
    x = torch.rand(dA.n_local, generator=torch.Generator().manual_seed(comm.rank))
    xv, yv = M.createVecs()
    xv.array[:] = x.numpy()
    M.mult(xv, yv)
    ok &= rel(yv.array, (dA @ x).numpy()) < 1e-12
    M.multTranspose(xv, yv)
    ok &= rel(yv.array, (dA.T @ x).numpy()) < 1e-12
    assert all_ok(comm, ok)


@pytest.mark.parametrize("case", ["random", "block2"])
def test_with_values_refills_the_same_mat(comm, case):
    A = CASES[case]()
    dA = DSparseTensor.from_global(A, comm)
    M = dA.to_petsc()
    assert dA.to_petsc() is M
    v = dA.values * 2.0 + 1.0
    dB = dA.with_values(v)
    MB = dB.to_petsc()
    assert MB is M  # same object, refilled in place
    assert all_ok(comm, same_local(from_petsc(M), dB))
    with torch.no_grad():
        v.mul_(-1.0)  # in-place change of the values: the next to_petsc refills
    assert dB.to_petsc() is M
    assert all_ok(comm, torch.equal(from_petsc(M).values, v))
    x = torch.ones(dA.n_local)
    xv, yv = M.createVecs()
    xv.set(1.0)
    M.mult(xv, yv)
    assert all_ok(comm, rel(yv.array, (dB @ x).numpy()) < 1e-12)


def test_from_petsc_of_a_petsc_built_matrix(comm):
    """A Mat assembled by PETSc itself (PETSc's ownership split) converts correctly."""
    n = 30
    M = PETSc.Mat().createAIJ(((PETSc.DECIDE, n), (PETSc.DECIDE, n)), nnz=3, comm=comm)
    r0, r1 = M.getOwnershipRange()
    for i in range(r0, r1):
        M.setValue(i, i, 2.0 + i)
        if i + 1 < n:
            M.setValue(i, i + 1, -1.0)
        if i > 0:
            M.setValue(i, i - 1, -0.5)
    M.assemble()
    dA = from_petsc(M)
    assert dA.row_range == (r0, r1) and dA.global_shape == (n, n)
    A = np.diag(2.0 + np.arange(n)) + np.diag(-np.ones(n - 1), 1) + np.diag(-0.5 * np.ones(n - 1), -1)
    assert all_ok(comm, np.array_equal(dA.local.to_dense().numpy(), A[r0:r1]))


def test_tensor_to_vec_shares_memory(comm):
    x = torch.arange(5.0) + 10 * comm.rank
    v = tensor_to_vec(x, comm)
    assert v.getSize() == 5 * comm.size and v.getLocalSize() == 5
    x[2] = -7.0  # the Vec sees the tensor's change: no copy was made
    ok = v.getArray(readonly=True)[2] == -7.0
    v.scale(2.0)  # and the tensor sees the Vec's
    ok &= x[2].item() == -14.0
    assert comm.allreduce(float(x.sum())) == pytest.approx(v.sum())
    # float32 / non-contiguous: copied
    x32 = torch.ones(4, dtype=torch.float32)
    v32 = tensor_to_vec(x32, comm)
    x32[0] = 5.0
    ok &= v32.getArray(readonly=True)[0] == 1.0
    assert all_ok(comm, ok)


def test_vec_to_tensor(comm):
    v = PETSc.Vec().createMPI((4, PETSc.DECIDE), comm=comm)
    v.setArray(np.arange(4.0) + comm.rank)
    t = vec_to_tensor(v)
    ok = torch.equal(t, torch.arange(4.0) + comm.rank)
    v.set(0.0)
    ok &= t.sum().item() == 4 * comm.rank + 6  # a copy
    a = vec_to_tensor(v, copy=False)
    v.set(3.0)
    ok &= torch.equal(a, torch.full((4,), 3.0))  # an alias
    ok &= vec_to_tensor(v, dtype=torch.float32).dtype == torch.float32
    assert all_ok(comm, ok)


def test_tensor_to_vec_bad_input_on_one_rank(comm):
    x = torch.zeros(3, 2) if comm.rank == comm.size - 1 else torch.zeros(3)
    with pytest.raises(ValueError, match="1-D"):
        tensor_to_vec(x, comm)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["data", "numpy", "one_rank"])
def test_refill_sees_writes_that_keep_the_version(comm, how):
    """.data / NumPy-view writes do not bump the tensor version; the Mat must still be
    refilled, on every rank together even when only one rank's values changed."""
    A = poisson_matrix((9, 8))
    dA = DSparseTensor.from_global(A, comm)
    M = dA.to_petsc()
    state = M.stateGet()
    assert dA.to_petsc() is M and M.stateGet() == state  # unchanged values: no refill
    if how == "data":
        dA.values.data.mul_(3.0)
    elif how == "numpy":
        dA.values.numpy()[:] *= 3.0
    elif comm.rank == comm.size - 1:
        dA.values.numpy()[:] *= 3.0
    assert dA.to_petsc() is M
    assert all_ok(comm, torch.equal(from_petsc(M).values, dA.values))
