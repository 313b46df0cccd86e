"""The operator and reduction the torch backend hands to the native Krylov kernels.

Built once per solve, so nothing here can go stale: the matrix values are those
``dA`` holds when the solve starts (a solve never sees values change under it),
and the product reads them without copying.

* :func:`krylov_matvec` -- ``x -> A x`` without the per-call work of
  :meth:`DSparseTensor.matvec` that a Krylov iteration does not need (the shape /
  dtype check of a vector the kernel made itself, the autograd Function). With no
  halo exchange (one rank, or no ghost columns and nothing to send) and a scalar
  CSR matrix on the CPU, the torch sparse CSR tensor is built once and each product
  is one ``torch.mv``.
* :func:`krylov_reducer` -- the ``reduce_sum`` of the kernels: ``None`` on one
  rank, else an Allreduce whose ``host_inplace`` attribute sums a NumPy array in
  place (the CPU kernels' reductions then create no tensors).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from mpi4py import MPI

from .._comm import allreduce_sum

__all__ = ["krylov_matvec", "krylov_reducer"]


def krylov_matvec(dA, b: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """Local (the products it returns are collective). ``x -> dA @ x`` for a solve of ``dA x = b``.

    Falls back to ``dA.matvec`` (full checks) unless ``dA`` is a row shard whose
    values match ``b``'s dtype and device.
    """
    L = getattr(dA, "_layout", None)
    vals = dA.values.detach()
    if L is None or vals.dtype != b.dtype or vals.device != b.device:
        return dA.matvec
    from ..dsparse import _forward_product
    halo = L.halo
    if (not (halo.n_ghost or halo.n_send) and L.n_offd == 0 and not L.block
            and vals.device.type == "cpu" and vals.dtype in (torch.float32, torch.float64)):
        P = L.diag
        if P.nnz == 0 or P.M == 0:
            return dA.matvec
        indptr, indices = P.csr32()
        A = torch.sparse_csr_tensor(indptr, indices, vals, size=(P.M, P.N), check_invariants=False)
        mv = torch.mv

        def matvec(x: torch.Tensor) -> torch.Tensor:
            return mv(A, x)
        return matvec

    def matvec(x: torch.Tensor) -> torch.Tensor:
        return _forward_product(L, vals, x)[0]
    return matvec


def krylov_reducer(comm) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """Local. The kernels' ``reduce_sum`` over ``comm`` (``None``: one rank, the identity)."""
    if comm.Get_size() == 1:
        return None

    def reduce_sum(t: torch.Tensor) -> torch.Tensor:
        return allreduce_sum(comm, t)

    def host_inplace(a) -> None:
        comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)

    reduce_sum.host_inplace = host_inplace
    return reduce_sum
