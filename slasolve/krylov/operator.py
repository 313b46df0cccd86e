"""Normalise the operators solvers accept into row-sharded DSparseTensors."""
from __future__ import annotations

import scipy.sparse as sp
import torch
from mpi4py import MPI

from ..dsparse import DSparseTensor, _RowLayout
from ..placement import DSparseSpec, row_shard
from ..sparse import SparseTensor

__all__ = ["as_row_shard"]


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
    layout = getattr(pattern, "_self_layout", None)
    offs = ((0, A.M), (0, A.N))
    if layout is None:
        layout = _RowLayout(MPI.COMM_SELF, pattern, offs[0], offs[1], A.block_shape)
        pattern._self_layout = layout
    spec = DSparseSpec(row_shard(), MPI.COMM_SELF, A.shape, None, offs)
    return DSparseTensor(A, spec, _layout=layout)
