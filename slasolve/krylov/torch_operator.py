"""The operator and reduction the torch backend hands to the native Krylov kernels.

Built once per solve, so nothing here can go stale: the matrix values are those
``dA`` holds when the solve starts (a solve never sees values change under it),
and the product reads them without copying.

* :func:`krylov_matvec` -- ``x -> A x`` without the per-call work of
  :meth:`DSparseTensor.matvec` that a Krylov iteration does not need (the shape /
  dtype check of a vector the kernel made itself, the autograd Function). For a
  scalar CSR matrix on the CPU (float32/float64) the product is ONE ``torch.mv``
  of a CSR tensor over the *extended* columns ``[owned | ghost]`` (the values in
  their stored order, no copy) with an extended vector ``[x_owned | x_ghost]``
  whose ghost part the halo receive writes straight into: a persistent-request
  exchange (:class:`_Exchange`: gather the rows to send, ``Startall``,
  ``Waitall``, whatever the number of neighbours), then the product. With no
  exchange (one rank, or no ghost columns and nothing to send) it is the product
  alone. The exchange is not overlapped with the product: at the local sizes where
  the per-iteration cost matters (about 10^4 rows per rank) a neighbour message
  takes a few microseconds, and splitting the product into bulk and boundary parts
  to hide it cost more than it hid (``bench/torch_overhead.py``). The same
  conditions must hold on every exchanging rank (agreed by one Allreduce).
  Otherwise (blocks, other dtypes or devices) the layout's own product
  (``forward_product``) without the checks.

  The product itself is SciPy's compiled CSR kernel on NumPy views of the same
  arrays where it passes a check (:func:`_scipy_csr_matvec`: a smaller fixed
  cost than ``torch.mv``), else ``torch.mv``.

  The fast operators (``supports_out``) also have ``ghost_slots`` and
  ``bind(xe, out)``: the CPU CG kernel keeps its search direction in the first
  ``n`` entries of an ``n + ghost_slots`` buffer ``xe`` and calls
  ``apply = bind(xe, q)`` once, then ``apply()`` (``q = A xe[:n]``) per
  iteration, so the vector is never copied into the operator's own buffer.
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
_INT32_MAX = 2**31 - 1


def _extended_pattern(L) -> tuple:
    """Local. ``(indptr, indices)`` of the row shard's CSR with owned column ``c`` at
    ``c - cstart`` and ghost column ``j`` (plan order) at ``n_cols + j``: the entries in
    their stored order, so the values tensor is the CSR's values as is. int32 when the
    sizes allow (the CPU kernels' format), built in place from one int32 copy of the
    column ids; cached per layout."""
    def build():
        if L.n_offd == 0:       # every column owned: the diagonal block's own arrays
            return L.diag.csr32()
        P = L._pattern
        n_cols = L.cend - L.cstart
        small = (P.nnz <= _INT32_MAX and int(L.col_offsets[-1]) <= _INT32_MAX
                 and n_cols + L.halo.n_ghost <= _INT32_MAX)
        cols = P.indices
        idx = cols.to(torch.int32) if small else cols.clone()
        idx.sub_(L.cstart)
        idx[L.offd_pos] = (L.off_col + n_cols).to(idx.dtype)
        return P.indptr.to(idx.dtype), idx
    return L.cached("extended_pattern", None, build)


class _Exchange:
    """A forward halo exchange of the plan's ghost entries with persistent requests.

    Bound to one extended vector ``xe = [x_owned | x_ghost]``: the owned rows to send
    are gathered from ``xe[:n]`` into a send buffer, and the receives land in
    ``xe[n:]`` (ghosts are sorted by owner, so each neighbour's block is contiguous
    there). An exchange is three calls whatever the number of neighbours: ``take``,
    ``Startall``, ``Waitall``. No message headers: the Krylov kernels take every
    decision from reduced scalars, so every rank runs the same products in the same
    order, and the vectors were checked (shape, dtype, agreed across ranks) before the
    solve. Logged as ``slaHaloStart`` / ``slaHaloFinish`` and ``info.times['halo']``.
    """

    def __init__(self, plan, xe: torch.Tensor, n: int):
        xn = xe.numpy()
        self.x, rn = xn[:n], xn[n:]
        self.send = np.empty(plan.n_send, dtype=xn.dtype)
        sn = self.send
        comm = plan.comm
        self.reqs = ([comm.Recv_init(rn[a:b], source=r, tag=_TAG_KRYLOV) for r, a, b in plan._recv_slices]
                     + [comm.Send_init(sn[a:b], dest=r, tag=_TAG_KRYLOV) for r, a, b in plan._send_slices])
        self.send_idx = plan.send_idx.numpy()
        self.phase = _log.phase("halo")       # reused: one exchange at a time
        self.startall, self.waitall, self.take = MPI.Prequest.Startall, MPI.Request.Waitall, np.take

    def run(self) -> None:
        """Collective (the plan's neighbours). Fill the ghost part of the bound vector."""
        with self.phase:
            _EV_START.begin()
            self.take(self.x, self.send_idx, out=self.send, mode="clip")   # indices are valid
            self.startall(self.reqs)
            _EV_START.end()
            _EV_FINISH.begin()
            self.waitall(self.reqs)
            _EV_FINISH.end()

    def start(self, x: torch.Tensor) -> None:
        """Collective. Copy ``x`` into the bound owned part and exchange (bench / tests)."""
        self.x[...] = x.numpy()
        self.run()

    def finish(self) -> None:
        """Local. Nothing: :meth:`start` completed the exchange."""

    def __del__(self):
        if not MPI.Is_finalized():
            for r in getattr(self, "reqs", ()):
                if r != MPI.REQUEST_NULL:
                    r.Free()


_CSR_MATVEC: dict = {}   # (index dtype, value dtype) -> SciPy's kernel, or None where it failed its check


def _scipy_csr_matvec(index_dtype: np.dtype, value_dtype: np.dtype):
    """Local. SciPy's compiled ``y += A x`` for CSR arrays (``scipy.sparse._sparsetools``),
    or None. Its fixed cost is ~2.5 us against ~6.5 us for ``torch.mv`` of a CSR tensor
    (which builds an MKL handle per call); at 10^4 rows per rank that is ~5% of a CG
    iteration. A private SciPy module: used only after it gave the right answer on a small
    product of these dtypes, so a SciPy that changed it makes us fall back to ``torch.mv``."""
    key = (np.dtype(index_dtype).str, np.dtype(value_dtype).str)
    if key not in _CSR_MATVEC:
        fn = None
        try:
            from scipy.sparse._sparsetools import csr_matvec as cand
            ip = np.array([0, 2, 2, 3], dtype=index_dtype)
            ix = np.array([2, 0, 1], dtype=index_dtype)
            v = np.array([2.0, 3.0, -1.0], dtype=value_dtype)
            x = np.array([1.0, 10.0, 100.0], dtype=value_dtype)
            y = np.full(3, 1.0, dtype=value_dtype)
            cand(3, 3, ip, ix, v, x, y)
            if y.tolist() == [204.0, 1.0, -9.0]:
                fn = cand
        except Exception:  # noqa: BLE001 - any failure: the torch product
            fn = None
        _CSR_MATVEC[key] = fn
    return _CSR_MATVEC[key]


class _Operator:
    """``x -> A x`` for a scalar float CPU row shard: one CSR product over the extended
    columns ``[owned | ghost]``, after the halo exchange when this rank takes part in one
    (``plan``). ``A``: the torch CSR tensor (None: no entries or no rows)."""

    supports_out = True

    def __init__(self, A: Optional[torch.Tensor], m: int, n: int, plan):
        self._A, self.m, self.n = A, m, n
        self._plan = plan
        self.ghost_slots = plan.n_ghost if plan is not None else 0
        self._np = None
        if A is not None:
            ip, ix, v = A.crow_indices().numpy(), A.col_indices().numpy(), A.values().numpy()
            dense = ip.flags.c_contiguous and ix.flags.c_contiguous and v.flags.c_contiguous
            fn = _scipy_csr_matvec(ix.dtype, v.dtype) if ip.dtype == ix.dtype and dense else None
            if fn is not None:
                self._np = (fn, m, int(A.shape[1]), ip, ix, v)
        self._own = None        # (xe, exchange) for plain calls
        self._exchange = None   # the last bound exchange (bench)

    def _product(self, xe: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = A xe`` (``out`` contiguous)."""
        if self._A is None:
            return out.zero_()
        if self._np is None:
            return torch.mv(self._A, xe, out=out)
        fn, m, N, ip, ix, v = self._np
        on = out.numpy()
        on.fill(0)
        fn(m, N, ip, ix, v, xe.numpy(), on)
        return out

    def bind(self, xe: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
        """Local. ``apply()``: ``out = A @ xe[:n]``, the ghosts received into ``xe[n:]``.

        ``xe``: a contiguous 1-D CPU tensor of ``n + ghost_slots`` entries of the matrix
        dtype, ``out`` one of ``m``; every ``apply()`` is collective over the halo
        neighbours (persistent requests on ``xe``'s memory)."""
        if not (xe.is_contiguous() and out.is_contiguous() and xe.numel() == self.n + self.ghost_slots
                and out.numel() == self.m):
            raise ValueError("bind: xe and out must be contiguous, of n + ghost_slots and m entries")
        ex = None
        if self._plan is not None:
            ex = self._exchange = _Exchange(self._plan, xe, self.n)
        run = ex.run if ex is not None else None
        if self._A is None:
            def product() -> None:
                out.zero_()
        elif self._np is None:
            A, mv = self._A, torch.mv

            def product() -> None:
                mv(A, xe, out=out)
        else:
            fn, m, N, ip, ix, v = self._np
            xn, on = xe.numpy(), out.numpy()
            fill = on.fill

            def product() -> None:
                fill(0)
                fn(m, N, ip, ix, v, xn, on)
        if run is None:
            return product

        def apply() -> None:
            run()
            product()
        apply._exchange = ex
        return apply

    def __call__(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self._own is None:
            xe = x.new_empty(self.n + self.ghost_slots)
            ex = _Exchange(self._plan, xe, self.n) if self._plan is not None else None
            self._own = (xe, ex)
        xe, ex = self._own
        xe[:self.n].copy_(x)
        if ex is not None:
            ex.run()
        y = x.new_empty(self.m) if out is None or not out.is_contiguous() else out
        self._product(xe, y)
        return y if out is None or y is out else out.copy_(y)


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
    if not fast:
        from ..layout import forward_product

        def generic(x: torch.Tensor) -> torch.Tensor:
            return forward_product(L, vals, x)[0]
        return generic
    m, n = L.rend - L.rstart, L.cend - L.cstart
    indptr, indices = _extended_pattern(L)
    A = (torch.sparse_csr_tensor(indptr, indices, vals, size=(m, n + halo.n_ghost), check_invariants=False)
         if indices.numel() and m else None)
    return _Operator(A, m, n, halo if exchange else None)


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
