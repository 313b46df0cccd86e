"""The operator and reduction the torch backend hands to the native Krylov kernels.

Built once per solve, so nothing here can go stale: the matrix values are those
``dA`` holds when the solve starts (a solve never sees values change under it),
and the product reads them without copying.

* :func:`krylov_matvec` -- ``x -> A x`` without the per-call work of
  :meth:`DSparseTensor.matvec` that a Krylov iteration does not need (the shape /
  dtype check of a vector the kernel made itself, the autograd Function). With no
  halo exchange (one rank, or no ghost columns and nothing to send) and a scalar
  CSR matrix on the CPU, the torch sparse CSR tensor is built once and each product
  is one ``torch.mv`` (into the caller's storage with ``out=``: the fast
  operators have a ``supports_out`` attribute). With a halo (same conditions on every exchanging rank,
  agreed by one Allreduce): a persistent-request exchange made once per solve
  (:class:`_Exchange`: three calls per product whatever the number of neighbours)
  overlapped with the bulk product on a prebuilt CSR tensor, then the few ghost
  / boundary-row entries as small CSR products. Otherwise the layout's own
  product (``_forward_product``) without the checks.
* :func:`krylov_reducer` -- the ``reduce_sum`` of the kernels: ``None`` on one
  rank, else an Allreduce whose ``host_inplace`` attribute sums a NumPy array in
  place (the CPU kernels' reductions then create no tensors).
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch
from mpi4py import MPI

from .. import _log
from .._comm import allreduce_sum

__all__ = ["krylov_matvec", "krylov_reducer"]


_TAG_KRYLOV = 79  # on the halo plans' inner communicator; the plans use 71-73
_EV_START, _EV_FINISH = _log.event("slaHaloStart"), _log.event("slaHaloFinish")


def _csr(rows: torch.Tensor, cols: torch.Tensor, vals: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """A torch CSR tensor from entries whose ``rows`` are non-decreasing (int32 ids)."""
    indptr = torch.zeros(m + 1, dtype=torch.int64)
    if rows.numel():
        indptr[1:] = torch.cumsum(torch.bincount(rows, minlength=m), 0)
    return torch.sparse_csr_tensor(indptr.to(torch.int32), cols.to(torch.int32), vals, size=(m, n),
                                   check_invariants=False)


class _Exchange:
    """A forward halo exchange of the plan's ghost entries with persistent requests.

    The buffers and the request list are made once per solve, so an exchange costs
    three calls whatever the number of neighbours: gather the rows to send
    (``index_select`` into the send buffer), ``Startall``, ``Waitall``. Ghosts are
    sorted, so each neighbour's ghost block lands at its place in the receive
    buffer. No message headers: the Krylov kernels take every decision from reduced
    scalars, so every rank runs the same products in the same order, and the
    vectors were checked (shape, dtype, agreed across ranks) before the solve.
    """

    def __init__(self, plan, dtype: torch.dtype):
        self.send = torch.empty(plan.n_send, dtype=dtype)
        self.recv = torch.empty(plan.n_ghost, dtype=dtype)
        sn, rn = self.send.numpy(), self.recv.numpy()
        comm = plan.comm
        self.reqs = ([comm.Recv_init(rn[a:b], source=r, tag=_TAG_KRYLOV) for r, a, b in plan._recv_slices]
                     + [comm.Send_init(sn[a:b], dest=r, tag=_TAG_KRYLOV) for r, a, b in plan._send_slices])
        self.send_idx = plan.send_idx
        self.startall, self.waitall = MPI.Prequest.Startall, MPI.Request.Waitall

    def start(self, x: torch.Tensor) -> None:
        with _log.phase("halo", _EV_START):   # info.times["halo"], -log_view's slaHaloStart
            torch.index_select(x, 0, self.send_idx, out=self.send)
            self.startall(self.reqs)

    def finish(self) -> torch.Tensor:
        with _log.phase("halo", _EV_FINISH):
            self.waitall(self.reqs)
        return self.recv

    def __del__(self):
        if not MPI.Is_finalized():
            for r in self.reqs:
                if r != MPI.REQUEST_NULL:
                    r.Free()


def _halo_matvec(L, vals: torch.Tensor):
    """``x -> A x`` for a scalar CPU row shard with a halo: persistent exchange overlapped
    with the bulk product, then the ghost (and, in recompute mode, boundary-row) entries
    as small CSR products built once per solve from the few entries they hold. Every
    product takes part in the exchange, whatever this rank's share of it."""
    ex = _Exchange(L.halo, vals.dtype)
    if L.n_offd == 0:   # nothing to receive: only sends
        P = L.diag
        A = (torch.sparse_csr_tensor(*P.csr32(), vals, size=(P.M, P.N), check_invariants=False)
             if P.nnz and P.M else None)

        def matvec(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
            ex.start(x)
            if A is not None:
                y = torch.mv(A, x, out=out)
            else:
                y = x.new_zeros(P.M) if out is None else out.zero_()
            ex.finish()
            return y
        matvec._exchange = ex
        matvec.supports_out = True
        return matvec
    if getattr(L, "bulk", None) is None:   # built on the first product (recompute is set there too)
        L.bulk_patterns()
    ip, ix = L.bulk.csr32()
    n_rows, n_cols, n_ghost = L.rend - L.rstart, L.cend - L.cstart, L.halo.n_ghost
    bulk = torch.sparse_csr_tensor(ip, ix, vals, size=(L.bulk.M, L.bulk.N), check_invariants=False)
    n_bd = L.n_bd
    off_pos, off_row = L.fix_pos[n_bd:], L.fix_row[n_bd:]
    mv, addmv = torch.mv, torch.addmv
    if not L.recompute:
        # bulk on [x; 0]: the ghost columns point at the zero slot, so y_bulk is exact without them
        G = _csr(off_row, L.off_col, vals.index_select(0, off_pos), n_rows, n_ghost)
        xe = vals.new_zeros(n_cols + 1)
        xo = xe[:n_cols]

        def matvec(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
            ex.start(x)
            xo.copy_(x)
            y = mv(bulk, xe, out=out)
            return addmv(y, G, ex.finish(), out=y)
        matvec._exchange = ex
        matvec.supports_out = True
        return matvec
    # recompute mode: the bulk product is wrong on the boundary rows only; recompute them
    brows = L.brows
    nb = brows.numel()
    bd_pos, bd_row = L.fix_pos[:n_bd], L.fix_row[:n_bd]
    F1 = _csr(torch.searchsorted(brows, bd_row), L.bd_col, vals.index_select(0, bd_pos), nb, n_cols)
    F2 = _csr(torch.searchsorted(brows, off_row), L.off_col, vals.index_select(0, off_pos), nb, n_ghost)

    def matvec(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        ex.start(x)
        y = mv(bulk, x, out=out)
        yb = mv(F1, x)
        addmv(yb, F2, ex.finish(), out=yb)
        return y.index_copy_(0, brows, yb)
    matvec._exchange = ex
    matvec.supports_out = True
    return matvec


def krylov_matvec(dA, b: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """Collective (one tiny Allreduce on 2+ ranks). ``x -> dA @ x`` for a solve of ``dA x = b``.

    Falls back to ``dA.matvec`` (full checks) unless ``dA`` is a row shard whose
    values match ``b``'s dtype and device. The persistent halo exchange is used only
    when every rank that exchanges can use it (the choice is agreed by one Allreduce,
    since exchanges of both kinds cannot match each other).
    """
    L = getattr(dA, "_layout", None)
    if L is None:
        return dA.matvec
    vals = dA.values.detach()
    halo = L.halo
    exchange = bool(halo.n_ghost or halo.n_send)
    matched = vals.dtype == b.dtype and vals.device == b.device
    fast = (matched and not L.block and vals.device.type == "cpu"
            and vals.dtype in (torch.float32, torch.float64))
    comm = dA.comm
    if comm.Get_size() > 1:
        flag = np.array([1 if (fast or not exchange) else 0], dtype=np.int32)
        comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MIN)
        fast = fast and bool(flag[0])
    if not matched:
        return dA.matvec
    from ..dsparse import _forward_product

    def generic(x: torch.Tensor) -> torch.Tensor:
        return _forward_product(L, vals, x)[0]

    if not fast:
        return generic
    if not exchange:
        if L.n_offd:
            return generic
        P = L.diag
        if P.nnz == 0 or P.M == 0:
            return dA.matvec
        indptr, indices = P.csr32()
        A = torch.sparse_csr_tensor(indptr, indices, vals, size=(P.M, P.N), check_invariants=False)
        mv = torch.mv

        def matvec(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
            return mv(A, x, out=out)
        matvec.supports_out = True
        return matvec
    return _halo_matvec(L, vals)


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
