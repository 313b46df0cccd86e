"""Normalise the operators solvers accept into row-sharded DSparseTensors."""
from __future__ import annotations

import scipy.sparse as sp
import torch
from mpi4py import MPI

from ..dsparse import DSparseTensor
from ..layout import RowLayout
from ..placement import DSparseSpec, row_shard
from ..sparse import SparseTensor

__all__ = ["as_row_shard", "needs_grad", "operator_error", "rhs_error"]


def as_row_shard(A) -> DSparseTensor:
    """Local for local input, else a no-op. A row-sharded DSparseTensor for ``A``.

    A ``SparseTensor`` (or SciPy / torch sparse matrix) becomes a one-rank
    DSparseTensor on ``MPI.COMM_SELF`` whose values *are* the input's values, so
    gradients reach them. The layout is cached on the input's pattern, so repeated
    solves with new values reuse it (and the PETSc Mat / KSP cached on it).
    """
    if isinstance(A, DSparseTensor):
        if not A.is_row_shard:
            raise TypeError(f"solvers need a row-sharded DSparseTensor, got placement {A.placement}; "
                            "rebuild it with placement=row_shard()")
        return A
    if sp.issparse(A):
        A = SparseTensor.from_scipy(A)
    elif isinstance(A, torch.Tensor) and A.layout in (torch.sparse_coo, torch.sparse_csr, torch.sparse_bsr):
        A = SparseTensor.from_torch(A)
    if not isinstance(A, SparseTensor):
        raise TypeError("A must be a DSparseTensor, SparseTensor, scipy.sparse matrix or torch sparse "
                        f"tensor, got {type(A).__name__}")
    if A.batch_shape:
        raise ValueError("batched matrices: solve each batch entry (A[i]) separately")
    if A.M != A.N:
        raise ValueError(f"A must be square, got {A.matrix_shape}")
    pattern = A.pattern
    layout = pattern.self_layout
    offs = ((0, A.M), (0, A.N))
    if layout is None:
        layout = RowLayout(MPI.COMM_SELF, pattern, offs[0], offs[1], A.block_shape)
        pattern.self_layout = layout
    spec = DSparseSpec(row_shard(), MPI.COMM_SELF, A.shape, None, offs)
    return DSparseTensor(A, spec, _layout=layout)


def needs_grad(t) -> bool:
    """Local. Whether ``t`` takes part in a backward of this call (grad mode on and it requires grad)."""
    return isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled()


def operator_error(dA):
    """Local. The first problem with the operator, or None."""
    if dA.dtype.is_complex:
        return TypeError(f"complex matrices are not supported (A has dtype {dA.dtype}); solve the "
                         "equivalent real system of twice the size")
    if not dA.dtype.is_floating_point:
        return TypeError(f"A must have a real floating dtype, got {dA.dtype}")
    L = dA._layout
    shape = tuple(dA.global_shape[:2])
    if shape[0] != shape[1] or L.br != L.bc:
        return ValueError(f"A must be square, got global shape {tuple(dA.global_shape)}")
    if (L.rstart, L.rend) != (L.cstart, L.cend):
        return ValueError(f"A's owned rows [{L.rstart}, {L.rend}) and owned columns [{L.cstart}, {L.cend}) "
                          "differ on this rank; solvers need the same row and column ownership")
    return None


def rhs_error(dA, b, x0):
    """Local. The first problem with ``b`` / ``x0``, or None."""
    n = dA.n_local
    if not isinstance(b, torch.Tensor):
        return TypeError(f"b must be a torch.Tensor of this rank's owned rows, got {type(b).__name__}")
    if b.is_complex():
        return TypeError(f"complex right-hand sides are not supported (b has dtype {b.dtype}); "
                         "solve the real and imaginary parts separately")
    if b.dim() not in (1, 2) or b.shape[0] != n:
        return ValueError(f"b must have shape ({n},) or ({n}, k) (this rank's owned rows), "
                          f"got {tuple(b.shape)}")
    if b.dim() == 2 and b.shape[1] == 0:
        return ValueError("b has no columns (shape (n, 0)): nothing to solve")
    if b.dtype != dA.dtype:
        return TypeError(f"b has dtype {b.dtype}, the matrix {dA.dtype}")
    if isinstance(x0, str):
        if x0 != "previous":
            return ValueError(f"x0 must be a tensor, None or 'previous', got {x0!r}")
    elif x0 is not None:
        if not isinstance(x0, torch.Tensor) or x0.shape != b.shape:
            return ValueError(f"x0 must be a tensor shaped like b {tuple(b.shape)}, got "
                              f"{tuple(x0.shape) if isinstance(x0, torch.Tensor) else type(x0).__name__}")
        if x0.is_complex():
            return TypeError(f"complex x0 is not supported (dtype {x0.dtype})")
    return None
