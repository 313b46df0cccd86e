"""Serial tests of slasolve.sparse.SparseTensor (local CSR / COO / BSR)."""
import numpy as np
import pytest
import scipy.sparse as sp
import torch

from slasolve import SparseTensor
from slasolve.testing import block_spd_matrix, poisson_matrix, random_matrix

RTOL = 1e-12


def rel(a, b):
    a = a.detach().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    b = b.detach().numpy() if isinstance(b, torch.Tensor) else np.asarray(b)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)


def same_csr(S: SparseTensor, A) -> bool:
    A = A.tocsr()
    A.sort_indices()
    return (np.array_equal(S.indptr.numpy(), A.indptr) and np.array_equal(S.indices.numpy(), A.indices)
            and np.allclose(S.values.detach().numpy(), A.data, rtol=0, atol=0))


MATRICES = {
    "poisson2d": lambda: poisson_matrix((7, 6)),
    "random": lambda: random_matrix(40, seed=3),
    "rect": lambda: random_matrix(30, 45, density=0.1, seed=4),
    "empty_rows": lambda: random_matrix(25, seed=5, empty_rows=[0, 7, 24]),
}


@pytest.fixture(params=sorted(MATRICES))
def A(request):
    return MATRICES[request.param]()


# -- construction -----------------------------------------------------------------
def test_from_coo_sums_duplicates_and_sorts():
    row = [2, 0, 2, 1, 0, 2]
    col = [1, 3, 1, 0, 3, 0]
    val = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    S = SparseTensor.from_coo(row, col, val, (3, 4))
    ref = sp.coo_matrix((val.numpy(), (row, col)), shape=(3, 4)).tocsr()
    ref.sum_duplicates()
    assert S.nnz == 4
    assert same_csr(S, ref)
    assert S.shape == (3, 4) and S.M == 3 and S.N == 4
    assert torch.equal(S.row_indices(), torch.tensor([0, 1, 2, 2]))
    assert np.array_equal(S.to_dense().numpy(), ref.toarray())


def test_from_coo_batched_and_block_duplicates():
    row, col = [0, 1, 0], [1, 0, 1]
    vb = torch.arange(6.0).reshape(2, 3)            # (batch=2, nnz=3)
    Sb = SparseTensor.from_coo(row, col, vb, (2, 2, 2))
    assert Sb.batch_shape == (2,) and Sb.nnz == 2
    assert torch.equal(Sb.values, torch.tensor([[0.0 + 2.0, 1.0], [3.0 + 5.0, 4.0]]))
    blk = torch.arange(12.0).reshape(3, 2, 2)       # (nnz=3, 2, 2)
    Sk = SparseTensor.from_coo(row, col, blk, (2, 2, 2, 2), block_shape=(2, 2))
    assert Sk.block_shape == (2, 2) and Sk.nnz == 2
    assert torch.equal(Sk.values[0], blk[0] + blk[2])
    assert Sk.matrix_shape == (4, 4)


@pytest.mark.parametrize("bad, match", [
    (dict(row=[0, -1], col=[0, 1]), "negative"),
    (dict(row=[0, 3], col=[0, 1]), "out of range"),
    (dict(row=[0, 1], col=[0, -2]), "negative"),
    (dict(row=[0, 1], col=[0, 4]), "out of range"),
    (dict(row=[0, 1, 2], col=[0, 1]), "same length"),
    (dict(values=[1.0, float("nan")]), "NaN or Inf"),
    (dict(values=[1.0, float("inf")]), "NaN or Inf"),
    (dict(values=[1.0, 2.0, 3.0]), "entries"),
])
def test_from_coo_validates(bad, match):
    args = dict(row=[0, 1], col=[0, 1], values=[1.0, 2.0], shape=(3, 4))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        SparseTensor.from_coo(args["row"], args["col"], torch.tensor(args["values"]), args["shape"])


def test_from_coo_type_errors():
    with pytest.raises(TypeError, match="row"):
        SparseTensor.from_coo(torch.tensor([0.0, 1.0]), [0, 1], torch.ones(2), (2, 2))
    with pytest.raises(TypeError, match="values"):
        SparseTensor.from_coo([0, 1], [0, 1], torch.tensor([True, False]), (2, 2))
    with pytest.raises(ValueError, match="block_shape"):
        SparseTensor.from_coo([0], [0], torch.ones(1, 3, 3), (2, 2, 3, 3), block_shape=(2, 2))
    with pytest.raises(ValueError, match="values must have shape"):
        SparseTensor.from_coo([0], [0], torch.ones(1, 3, 2), (2, 2, 3, 3), block_shape=(3, 3))


def test_from_csr_validates():
    with pytest.raises(ValueError, match="M\\+1"):
        SparseTensor.from_csr([0, 1], [0], torch.ones(1), (2, 2))
    with pytest.raises(ValueError, match="non-decreasing"):
        SparseTensor.from_csr([0, 2, 1, 2], [0, 1], torch.ones(2), (3, 2))
    with pytest.raises(ValueError, match="column 5"):
        SparseTensor.from_csr([0, 1, 1], [5], torch.ones(1), (2, 2))
    with pytest.raises(ValueError, match="entries along its nnz"):
        SparseTensor.from_csr([0, 1, 2], [0, 1], torch.ones(3), (2, 2))


# -- conversions -----------------------------------------------------------------
def test_scipy_round_trip(A):
    S = SparseTensor.from_scipy(A)
    assert S.dtype == torch.float64 and S.shape == A.shape
    assert same_csr(S, A)
    B = S.to_scipy()
    assert sp.isspmatrix_csr(B) and (abs(B - A)).max() == 0
    assert (abs(S.to_scipy("coo") - A)).max() == 0


def test_scipy_unsorted_duplicates():
    A = sp.csr_matrix((np.array([1.0, 2.0, 3.0]), np.array([2, 0, 2]), np.array([0, 3, 3])), shape=(2, 3))
    S = SparseTensor.from_scipy(A)
    assert S.nnz == 2 and torch.equal(S.indices, torch.tensor([0, 2]))
    assert torch.equal(S.values, torch.tensor([2.0, 4.0]))


def test_torch_round_trips(A):
    S = SparseTensor.from_scipy(A)
    T = S.to_torch()
    assert T.layout == torch.sparse_csr
    assert np.array_equal(T.to_dense().numpy(), A.toarray())
    S2 = SparseTensor.from_torch(T)
    assert same_csr(S2, A)
    C = A.tocoo()
    coo = torch.sparse_coo_tensor(torch.from_numpy(np.vstack([C.row, C.col]).astype(np.int64)),
                                  torch.from_numpy(C.data), A.shape)
    S3 = SparseTensor.from_torch(coo)
    assert same_csr(S3, A)
    assert np.array_equal(S3.to_dense().numpy(), A.toarray())


@pytest.mark.parametrize("b", [2, 3])
def test_bsr_round_trips(b):
    B = block_spd_matrix((4, 3), b)
    S = SparseTensor.from_scipy(B)
    assert S.is_block and S.block_shape == (b, b) and S.shape == (12, 12, b, b)
    assert S.matrix_shape == B.shape
    assert abs(S.to_scipy("bsr") - B).max() == 0
    T = S.to_torch()
    assert T.layout == torch.sparse_bsr
    assert np.array_equal(T.to_dense().numpy(), B.toarray())
    S2 = SparseTensor.from_torch(T)
    assert torch.equal(S2.values, S.values) and torch.equal(S2.indices, S.indices)
    # a CSR matrix read as blocks
    S3 = SparseTensor.from_scipy(B.tocsr(), blocksize=(b, b))
    assert np.array_equal(S3.to_dense().numpy(), B.toarray())
    # scalar view is the same operator
    assert np.array_equal(S.scalar().to_dense().numpy(), B.toarray())


def test_matrix_market_round_trip(tmp_path, A):
    S = SparseTensor.from_scipy(A)
    path = tmp_path / "a.mtx"
    S.to_mtx(path)
    S2 = SparseTensor.from_mtx(path)
    assert S2.shape == S.shape
    assert rel(S2.to_dense(), S.to_dense()) < 1e-15
    with pytest.raises(FileNotFoundError):
        SparseTensor.from_mtx(tmp_path / "missing.mtx")


# -- products against SciPy ------------------------------------------------------------
def test_matvec_vector_multivector_transpose(A):
    S = SparseTensor.from_scipy(A)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(A.shape[1], generator=g)
    X = torch.rand(A.shape[1], 3, generator=g)
    y = torch.rand(A.shape[0], generator=g)
    assert rel(S @ x, A @ x.numpy()) < RTOL
    assert rel(S @ X, A @ X.numpy()) < RTOL
    assert rel(S.T @ y, A.T @ y.numpy()) < RTOL
    assert S.T.shape == (A.shape[1], A.shape[0])
    Xnc = torch.rand(3, A.shape[1], generator=g).T    # non-contiguous multi-vector
    assert rel(S @ Xnc, A @ Xnc.numpy()) < RTOL
    assert rel(S @ X[:, 1], A @ X[:, 1].numpy()) < RTOL  # strided vector


def test_matvec_batched_values(A):
    S = SparseTensor.from_scipy(A)
    g = torch.Generator().manual_seed(1)
    V = torch.rand(4, S.nnz, generator=g)
    Sb = S.with_values(V)
    assert Sb.batch_shape == (4,) and Sb.shape == (4,) + A.shape
    x = torch.rand(A.shape[1], generator=g)
    xb = torch.rand(4, A.shape[1], 2, generator=g)
    yb = Sb @ x
    yb2 = Sb @ xb
    for b in range(4):
        Ab = sp.csr_matrix((V[b].numpy(), A.indices, A.indptr), shape=A.shape)
        assert rel(yb[b], Ab @ x.numpy()) < RTOL
        assert rel(yb2[b], Ab @ xb[b].numpy()) < RTOL
        assert rel(Sb[b] @ x, Ab @ x.numpy()) < RTOL
    y = torch.rand(A.shape[0], generator=g)
    yt = Sb.T @ y
    for b in range(4):
        Ab = sp.csr_matrix((V[b].numpy(), A.indices, A.indptr), shape=A.shape)
        assert rel(yt[b], Ab.T @ y.numpy()) < RTOL


@pytest.mark.parametrize("b", [2, 3])
def test_matvec_block(b):
    B = block_spd_matrix((4, 3), b, seed=b)
    S = SparseTensor.from_scipy(B)
    g = torch.Generator().manual_seed(2)
    x = torch.rand(B.shape[1], generator=g)
    X = torch.rand(B.shape[1], 2, generator=g)
    assert rel(S @ x, B @ x.numpy()) < RTOL
    assert rel(S @ X, B @ X.numpy()) < RTOL
    assert rel(S.T @ x, B.T @ x.numpy()) < RTOL
    # non-symmetric blocks: transpose must transpose every block
    Sn = S.with_values(torch.rand(S.values.shape, generator=g))
    Bn = Sn.to_scipy()
    assert rel(Sn.T @ x, Bn.T @ x.numpy()) < RTOL
    assert rel(Sn.diagonal(), Bn.diagonal()) < RTOL
    # batched block values
    Vb = torch.rand((2,) + tuple(S.values.shape), generator=g)
    Sbb = S.with_values(Vb)
    yb = Sbb @ x
    for k in range(2):
        assert rel(yb[k], Sbb[k].to_scipy() @ x.numpy()) < RTOL


def test_matvec_shape_and_dtype_errors():
    S = SparseTensor.from_scipy(poisson_matrix((3, 3)))
    with pytest.raises(ValueError, match="x must have shape"):
        S @ torch.ones(8)
    with pytest.raises(TypeError, match="dtype"):
        S @ torch.ones(9, dtype=torch.float32)
    with pytest.raises(TypeError):
        S @ np.ones(9)
    with pytest.raises(ValueError, match="values must have shape"):
        S.with_values(torch.ones(S.nnz + 1))
    with pytest.raises(ValueError, match="NaN"):
        S.with_values(torch.full((S.nnz,), float("nan")))


def test_diagonal_and_dense(A):
    S = SparseTensor.from_scipy(A)
    assert rel(S.diagonal(), A.diagonal()) < RTOL
    assert np.array_equal(S.to_dense().numpy(), A.toarray())


# -- dtype / device ------------------------------------------------------------------
def test_dtype_and_device_moves():
    A = random_matrix(20, seed=7)
    S = SparseTensor.from_scipy(A)
    S32 = S.to(torch.float32)
    assert S32.dtype == torch.float32 and S32.pattern is S.pattern
    x = torch.rand(20)
    assert rel((S32 @ x.float()).double(), A @ x.numpy()) < 1e-5
    assert S.float().dtype == torch.float32 and S32.double().dtype == torch.float64
    Sc = S.to("cpu")
    assert Sc.device.type == "cpu" and Sc.pattern is S.pattern
    S16 = SparseTensor.from_scipy(A, dtype=torch.float32)
    assert S16.dtype == torch.float32
    if torch.cuda.is_available():  # pragma: no cover - only with a GPU
        Sg = S.to("cuda")
        assert Sg.indices.device.type == "cuda"
        assert rel((Sg @ x.cuda()).cpu(), A @ x.numpy()) < RTOL


# -- gradients -----------------------------------------------------------------------
def _small():
    return SparseTensor.from_scipy(random_matrix(9, 7, density=0.3, seed=11))


def test_gradcheck_scalar():
    S = _small()
    v = S.values.clone().requires_grad_(True)
    x = torch.rand(7, requires_grad=True)
    X = torch.rand(7, 2, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v, x: S.with_values(v) @ x, (v, x))
    assert torch.autograd.gradcheck(lambda v, x: S.with_values(v) @ x, (v, X))
    y = torch.rand(9, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v, y: S.with_values(v).T @ y, (v, y))


def test_gradcheck_batched():
    S = _small()
    V = torch.rand(3, S.nnz, requires_grad=True)
    x = torch.rand(7, requires_grad=True)
    xb = torch.rand(3, 7, requires_grad=True)
    assert torch.autograd.gradcheck(lambda V, x: S.with_values(V) @ x, (V, x))
    assert torch.autograd.gradcheck(lambda V, x: S.with_values(V) @ x, (V, xb))


def test_gradcheck_block():
    S = SparseTensor.from_scipy(block_spd_matrix((3, 2), 2, seed=1))
    v = torch.rand(S.values.shape, requires_grad=True)
    x = torch.rand(S.matrix_shape[1], requires_grad=True)
    assert torch.autograd.gradcheck(lambda v, x: S.with_values(v) @ x, (v, x))
    assert torch.autograd.gradcheck(lambda v, x: S.with_values(v).T @ x, (v, x))


def test_value_gradient_formula():
    """d(g . A x)/d values[k] = g[row_k] x[col_k] on the stored entries only."""
    S = _small()
    v = S.values.clone().requires_grad_(True)
    x, g = torch.rand(7), torch.rand(9)
    (S.with_values(v) @ x).dot(g).backward()
    expect = g[S.row_indices()] * x[S.indices]
    assert torch.allclose(v.grad, expect, rtol=1e-14, atol=0)


@pytest.mark.parametrize("block", [None, (2, 3)])
def test_products_see_writes_that_bypass_version(block):
    """SparseTensor caches patterns only: ``.data`` / NumPy-view writes reach every product."""
    import scipy.sparse as sp
    A = sp.random(12, 18, density=0.3, random_state=0, format="csr")
    S = SparseTensor.from_scipy(A if block is None else A.tobsr(blocksize=block))
    x = torch.rand(18, dtype=torch.float64)
    y = torch.rand(12, dtype=torch.float64)
    for t in (S @ x, S.T @ y, S.to_dense(), S.diagonal()):
        pass  # fill whatever could be cached
    S.values.data.mul_(2.0)
    S.values.numpy()[...] *= -1.5
    assert np.allclose((S @ x).numpy(), -3.0 * (A @ x.numpy()), rtol=1e-13)
    assert np.allclose((S.T @ y).numpy(), -3.0 * (A.T @ y.numpy()), rtol=1e-13)
    assert np.allclose(S.to_dense().numpy(), -3.0 * A.toarray(), rtol=1e-13)
