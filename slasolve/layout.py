"""The row layout of a row-sharded tensor and its distributed products.

:class:`RowLayout`: a row shard's diagonal / off-diagonal split (index sets into the CSR
values, patterns only), ghosts and halo plan, and the layout's caches (PETSc Mats,
solvers, index arrays); shared by every tensor of the layout (``with_values`` copies).
:func:`forward_product` / :func:`reverse_product`: ``A x`` and ``A^T y`` from the values as
they are now, the halo exchange overlapped with the bulk product; :class:`RowShardMatVec` /
:class:`RowShardRMatVec`: their autograd Functions (gradients to the values and the vector).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional, Tuple

import numpy as np
import torch

from .autograd import saved_tensors
from .halo import HaloPlan
from .sparse import Pattern, SparseTensor, csr_mv, csr_value_grad

__all__ = ["RowLayout", "forward_product", "reverse_product", "RowShardMatVec", "RowShardRMatVec"]


def _unscalar_grad(gs: torch.Tensor, perm, nnz: int, block) -> torch.Tensor:
    if perm is None:
        return gs
    out = gs.new_zeros(nnz * block[0] * block[1])
    out[perm] = gs
    return out.view(nnz, *block)


_CHUNK_ROWS = 1 << 16  # rows per chunk of the O(nnz) scans that need each entry's row


def _pattern_rows(pattern: Pattern) -> torch.Tensor:
    """Each stored entry's row, without caching it on ``pattern`` (8 bytes per nonzero that a
    forward solve never needs to keep)."""
    if pattern._rows is not None:
        return pattern._rows
    return torch.repeat_interleave(torch.arange(pattern.M, device=pattern.device),
                                   pattern.indptr[1:] - pattern.indptr[:-1])


def _sub_indptr(rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    indptr = torch.zeros(n_rows + 1, dtype=torch.int64, device=rows.device)
    indptr[1:] = torch.cumsum(torch.bincount(rows, minlength=n_rows), 0)
    return indptr


class _Pattern32(Pattern):
    """A pattern stored with int32 column ids, the format the CPU sparse kernels take
    (:meth:`Pattern.csr32`): no int64 copy is kept; :attr:`indices` converts on demand."""

    def __init__(self, indptr: torch.Tensor, indices32: torch.Tensor, M: int, N: int):
        self.indptr = indptr
        self._idx32 = indices32
        self.M, self.N = int(M), int(N)
        self._rows = self._transpose = self._csr32 = None
        self._scalar = {}

    @property
    def indices(self) -> torch.Tensor:
        return self._idx32.to(torch.int64)

    @property
    def nnz(self) -> int:
        return int(self._idx32.numel())

    @property
    def device(self) -> torch.device:
        return self._idx32.device

    def csr32(self) -> tuple:
        if self._csr32 is None:
            self._csr32 = (self.indptr.to(torch.int32), self._idx32)
        return self._csr32


def _bulk_pattern(pattern: Pattern, in_diag: torch.Tensor, cstart: int, fill: int, ncols: int) -> Pattern:
    """The pattern of all local entries with owned columns as local ids and ghost columns
    pointed at ``fill``; int32 on the CPU (built in place: no int64 temporaries)."""
    cols = pattern.indices
    small = cols.device.type == "cpu" and pattern.nnz < 2**31 - 1 and ncols < 2**31 - 1
    idx = cols.to(torch.int32) if small else cols.clone()
    idx.sub_(cstart).masked_fill_(~in_diag, fill)
    return _Pattern32(pattern.indptr, idx, pattern.M, ncols) if small else \
        Pattern(pattern.indptr, idx, pattern.M, ncols)


def _rows_of(indptr: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The rows of the entries at positions ``pos`` (no per-entry row array)."""
    return torch.searchsorted(indptr, pos, right=True) - 1


class RowLayout:
    """Collective (constructor). Diagonal/off-diagonal split and halo plan of a row shard.

    Memory: the forward product needs only the bulk pattern (or the diagonal block when the
    rank has no ghost columns, which then shares the tensor's own index arrays) and the few
    off-diagonal / boundary entries. The diagonal-block pattern and its positions
    (:attr:`diag`, :attr:`diag_pos`), the off-diagonal pattern and the transposed pattern are
    built on first use (backward, transposed products, ``dA.diag``) and then cached.
    """

    def __init__(self, comm, pattern: Pattern, row_offsets, col_offsets, block):
        rank = comm.Get_rank()
        self.comm = comm
        self.block = tuple(block)
        self.row_offsets = np.asarray(row_offsets, dtype=np.int64)
        self.col_offsets = np.asarray(col_offsets, dtype=np.int64)
        self.rstart, self.rend = int(self.row_offsets[rank]), int(self.row_offsets[rank + 1])
        self.cstart, self.cend = int(self.col_offsets[rank]), int(self.col_offsets[rank + 1])
        n_loc_rows, n_loc_cols = self.rend - self.rstart, self.cend - self.cstart
        self._pattern = pattern
        cols = pattern.indices
        in_diag = (cols >= self.cstart) & (cols < self.cend)
        self.offd_pos = torch.nonzero(~in_diag).flatten()
        self.n_offd = int(self.offd_pos.numel())
        self._diag = self._diag_pos = self._offd = None
        offd_cols = cols[self.offd_pos]
        self.ghost_ids = torch.unique(offd_cols, sorted=True)
        self.off_col = torch.searchsorted(self.ghost_ids, offd_cols)
        self.halo = HaloPlan(comm, (self.cstart, self.cend), self.ghost_ids, offsets=self.col_offsets)
        self.recompute = False
        if self.n_offd == 0:
            # every entry is in the diagonal block: share the tensor's arrays (a view when cstart == 0)
            local = cols if self.cstart == 0 else cols - self.cstart
            self._diag = Pattern(pattern.indptr, local, n_loc_rows, n_loc_cols)
            self.off_row = self.offd_pos
        else:
            self.off_row = _rows_of(pattern.indptr, self.offd_pos)
        self.bulk = None  # the forward product's index arrays: built on the first product
        self._transposed = None
        self._diag_entries = None  # (rows, positions) of the stored diagonal, found on first use
        self._caches: dict = {}    # name -> cache (cache / cached)
        self.petsc_mat = None
        self.petsc_filled_from = None

    def cache(self, name: str) -> dict:
        """Local. This layout's cache ``name`` (a dict made on first use), shared by every
        tensor of the layout (``with_values`` copies). Caches hold what the pattern and the
        layout determine (PETSc Mats, solvers, factorisations, index arrays, start vectors),
        never values that could go stale: whatever depends on values is checked against them
        when used."""
        cache = self._caches.get(name)
        if cache is None:
            cache = self._caches[name] = OrderedDict()
        return cache

    def cached(self, name: str, key, build: Callable[[], Any], size: Optional[int] = None):
        """Local; collective when ``build`` is (then every rank passes the same ``key``, and
        every rank hits, misses and evicts at the same call). The entry ``key`` of the cache
        ``name``, made by ``build()`` on a miss. With ``size``, least recently used entries
        beyond ``size`` are dropped, not destroyed: an autograd graph may still hold one for
        its backward; PETSc destroys dropped objects at its next
        :func:`slasolve.petsc.garbage_cleanup`, which the PETSc solvers run (collectively)
        before creating one."""
        cache = self.cache(name)
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        value = cache[key] = build()
        while size is not None and len(cache) > size:
            cache.popitem(last=False)
        return value

    def bulk_patterns(self) -> None:
        """Index arrays for products straight from the values in CSR order (see
        :func:`forward_product`): patterns only, never values. Built on the first forward
        product (a solve on the petsc backend never needs them)."""
        pattern, in_diag = self._pattern, self._in_diag()
        n_loc_rows, n_loc_cols = self.rend - self.rstart, self.cend - self.cstart
        ip = pattern.indptr
        cols = pattern.indices
        brows = torch.unique(self.off_row, sorted=True)
        in_b = torch.zeros(n_loc_rows, dtype=torch.bool, device=cols.device)
        in_b[brows] = True
        entry_in_b = torch.repeat_interleave(in_b, ip[1:] - ip[:-1])
        # recomputing the boundary rows costs about their entries; the zero-slot copy of x
        # costs n_loc_cols: recompute when boundary rows hold few entries
        self.recompute = n_loc_cols > 0 and int(entry_in_b.sum()) * 4 <= pattern.nnz
        if self.recompute:
            self.bulk = _bulk_pattern(pattern, in_diag, self.cstart, 0, n_loc_cols)
            self.brows = brows
            bd_pos = torch.nonzero(in_diag & entry_in_b).flatten()
        else:
            self.bulk = _bulk_pattern(pattern, in_diag, self.cstart, n_loc_cols, n_loc_cols + 1)
            bd_pos = self.offd_pos[:0]
        # entries added after the exchange: fix_pos = [boundary owned-column entries, ghost entries]
        self.n_bd = int(bd_pos.numel())
        self.bd_col = cols[bd_pos] - self.cstart
        self.fix_pos = torch.cat([bd_pos, self.offd_pos])
        self.fix_row = _rows_of(ip, self.fix_pos)

    def _in_diag(self) -> torch.Tensor:
        cols = self._pattern.indices
        return (cols >= self.cstart) & (cols < self.cend)

    @property
    def diag_pos(self) -> torch.Tensor:
        """Positions (in ``values``) of the diagonal-block entries, built on first use."""
        if self._diag_pos is None:
            nnz = self._pattern.nnz
            self._diag_pos = (torch.arange(nnz, device=self._pattern.device) if self.n_offd == 0
                              else torch.nonzero(self._in_diag()).flatten())
        return self._diag_pos

    @property
    def diag(self) -> Pattern:
        """Diagonal-block pattern (owned columns, local ids), built on first use."""
        if self._diag is None:
            pos = self.diag_pos
            n_loc_rows = self.rend - self.rstart
            rows = _pattern_rows(self._pattern)[pos]
            self._diag = Pattern(_sub_indptr(rows, n_loc_rows), self._pattern.indices[pos] - self.cstart,
                                 n_loc_rows, self.cend - self.cstart)
        return self._diag

    @property
    def offd(self) -> Pattern:
        """Off-diagonal pattern (ghost columns, compressed ids), built on first use."""
        if self._offd is None:
            n_loc_rows = self.rend - self.rstart
            self._offd = Pattern(_sub_indptr(self.off_row, n_loc_rows), self.off_col, n_loc_rows,
                                 int(self.ghost_ids.numel()))
        return self._offd

    def transposed(self) -> Tuple[Pattern, torch.Tensor]:
        """``(scalar pattern of A_diag^T with one extra zero row, perm)``: the transposed
        diagonal-block product's values are ``values.reshape(-1)[perm]``."""
        if self._transposed is None:
            if self.n_offd == 0:
                P = self.diag
            elif self.bulk is not None and not self.recompute:
                P = self.bulk
            else:
                n_loc_cols = self.cend - self.cstart
                P = _bulk_pattern(self._pattern, self._in_diag(), self.cstart, n_loc_cols, n_loc_cols + 1)
            if self.block:
                ps, perm_s = P.scalar(*self.block)
            else:
                ps, perm_s = P, None
            pt, perm_t = ps.transpose()
            self._transposed = (pt, perm_t if perm_s is None else perm_s[perm_t])
        return self._transposed

    def diagonal(self, values: torch.Tensor, present: bool = False):
        """The diagonal block's scalar main diagonal (zeros where not stored), from ``values``
        as they are now. With ``present``, also a bool per scalar row: a diagonal entry is
        stored."""
        n, ncols = self.rend - self.rstart, self.cend - self.cstart
        br, bc = self.br, self.bc
        k = min(n * br, ncols * bc)
        if self.block and br != bc:
            d = self.diag
            sub = SparseTensor._make(d, values[self.diag_pos], (d.M, d.N) + self.block, 2)
            out = sub.diagonal()
            return (out, torch.ones(k, dtype=torch.bool, device=out.device)) if present else out
        rows, pos = self._diagonal_entries()
        v = values.index_select(0, pos)   # 3-4x faster than values[pos] for long value arrays
        if self.block:
            v = v.diagonal(dim1=-2, dim2=-1)
        out = values.new_zeros((n, br)).index_add_(0, rows, v.reshape(-1, br))
        out = out.reshape(-1)[:k]
        if not present:
            return out
        have = torch.zeros((n, br), dtype=torch.bool, device=values.device)
        have[rows] = True
        return out, have.reshape(-1)[:k]

    def _diagonal_entries(self):
        """Local. ``(rows, positions)`` of the stored main-diagonal entries (O(rows) int64 each),
        found once by scanning the rows in chunks: the pattern never changes, and solvers whose
        preconditioner needs a nonzero diagonal read it on every call."""
        found = self._diag_entries
        if found is None:
            p = self._pattern
            n = self.rend - self.rstart
            ip, cols = p.indptr, p.indices
            rows, poss = [], []
            for a in range(0, n, _CHUNK_ROWS):
                b = min(n, a + _CHUNK_ROWS)
                lo, hi = int(ip[a]), int(ip[b])
                r = torch.repeat_interleave(torch.arange(a, b, device=cols.device), ip[a + 1:b + 1] - ip[a:b])
                pos = torch.nonzero(cols[lo:hi] - self.cstart == r).flatten()
                rows.append(r[pos])
                poss.append(pos + lo)
            empty = torch.zeros(0, dtype=torch.int64, device=cols.device)
            found = self._diag_entries = (torch.cat(rows) if rows else empty, torch.cat(poss) if poss else empty)
        return found

    @property
    def bc(self) -> int:
        return self.block[1] if self.block else 1

    @property
    def br(self) -> int:
        return self.block[0] if self.block else 1


def _mv(pattern: Pattern, values: torch.Tensor, x: torch.Tensor, block) -> torch.Tensor:
    """``A x`` with ``values`` exactly as stored (CSR, or BSR for blocks): no gather."""
    if not block:
        return csr_mv(pattern, values, x)
    br, bc = block
    if pattern.nnz == 0 or pattern.M == 0:
        return x.new_zeros((pattern.M * br,) + tuple(x.shape[1:]))
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64):
        indptr, indices = pattern.csr32()
        A = torch.sparse_bsr_tensor(indptr, indices, values.contiguous(), size=(pattern.M * br, pattern.N * bc),
                                    check_invariants=False)
        return A @ x
    ps, perm = pattern.scalar(br, bc)  # no BSR kernel for this dtype/device: gather per call
    return csr_mv(ps, values.reshape(-1)[perm], x)


def _entry_products(v: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
    """Per stored entry ``v_e @ x_e``: ``v`` (m, br, bc), ``xb`` (m, bc, K) -> (m, br, K)."""
    if v.shape[1] == 1 and v.shape[2] == 1:
        return v * xb
    return torch.bmm(v, xb)


def forward_product(L: "RowLayout", values: torch.Tensor, x: torch.Tensor):
    """``(A x, x_ghost)`` from the values as they are now (no cache that can go stale).

    The halo exchange is overlapped with the bulk product. When the rank has ghost
    columns, the bulk product runs over all local entries in CSR order, either with
    the ghost columns pointed at column 0 and the few *boundary rows* (rows with a
    ghost entry) recomputed exactly afterwards from gathered boundary entries, or,
    when boundary rows hold most entries, on ``[x; 0]`` with the ghost columns
    pointed at the zero slot. Either way no O(nnz) gather per product.
    """
    trailing = tuple(x.shape[1:])
    K = int(np.prod(trailing, dtype=np.int64))
    halo = L.halo
    br, bc = L.br, L.bc
    n_cols = L.cend - L.cstart
    exchange = halo.n_ghost or halo.n_send
    if L.n_offd and L.bulk is None:
        L.bulk_patterns()
    if exchange:
        pending = halo.start_forward(x.reshape((n_cols, bc) + trailing))
    if L.n_offd == 0:
        y = _mv(L.diag, values, x, L.block)
    elif L.recompute:
        y = _mv(L.bulk, values, x, L.block)
    else:
        xe = x.new_zeros(((n_cols + 1) * bc,) + trailing)
        xe[:n_cols * bc] = x
        y = _mv(L.bulk, values, xe, L.block)
    if not exchange:
        return y, x.new_zeros((0,) + trailing)
    xg = halo.finish(pending).reshape((halo.n_ghost * bc,) + trailing)
    if L.n_offd:
        # the entries to (re)compute: the boundary rows' owned-column entries (recompute
        # mode) and the ghost entries, multiplied with gathered x / ghost rows
        vb = values.index_select(0, L.fix_pos)
        if L.block:
            xs = x.new_empty((L.fix_pos.numel(), bc, K))
            torch.index_select(x.reshape(n_cols, bc, K), 0, L.bd_col, out=xs[:L.n_bd])
            torch.index_select(xg.reshape(halo.n_ghost, bc, K), 0, L.off_col, out=xs[L.n_bd:])
            prod = torch.bmm(vb, xs)
            yv = y.view(L.rend - L.rstart, br, K)
        else:
            xs = x.new_empty((L.fix_pos.numel(),) + trailing)
            torch.index_select(x, 0, L.bd_col, out=xs[:L.n_bd])
            torch.index_select(xg, 0, L.off_col, out=xs[L.n_bd:])
            prod = vb * xs if xs.dim() == 1 else vb[:, None] * xs
            yv = y
        if L.recompute:
            yv.index_fill_(0, L.brows, 0)
        yv.index_add_(0, L.fix_row, prod)
    return y, xg


def reverse_product(L: "RowLayout", values: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``A^T y`` on the owned columns: reverse halo of the off-diagonal products,
    overlapped with the transposed diagonal-block product. Transposed values are
    gathered per call (not the hot path; nothing cached can go stale)."""
    trailing = tuple(y.shape[1:])
    K = int(np.prod(trailing, dtype=np.int64))
    halo = L.halo
    br, bc = L.br, L.bc
    n_cols = L.cend - L.cstart
    exchange = halo.n_ghost or halo.n_send
    if exchange:
        tg = y.new_zeros((halo.n_ghost, bc, K))
        if L.n_offd:
            vo = values.view(-1, br, bc).index_select(0, L.offd_pos)
            yo = y.reshape(L.rend - L.rstart, br, K).index_select(0, L.off_row)
            tg.index_add_(0, L.off_col, _entry_products(vo.transpose(1, 2), yo))
        pending = halo.start_reverse(tg.reshape((halo.n_ghost, bc) + trailing))
    pt, perm = L.transposed()
    out = csr_mv(pt, values.reshape(-1).index_select(0, perm), y)[:n_cols * bc]
    if exchange:
        out = out + halo.finish(pending).reshape(out.shape)
    return out


def _values_grad(L: "RowLayout", values: torch.Tensor, left: torch.Tensor, right: torch.Tensor,
                 right_ghost: torch.Tensor) -> torch.Tensor:
    """``d <left, A right> / d values`` (``right_ghost``: the ghost rows of ``right``)."""
    pd, permd = (L.diag, None) if not L.block else L.diag.scalar(*L.block)
    if L.n_offd == 0:  # every entry is a diagonal-block entry, in order
        return _unscalar_grad(csr_value_grad(pd, left, right), permd, values.shape[0], L.block)
    gv = torch.zeros_like(values)
    nd, no = L.diag.nnz, L.offd_pos.numel()
    gv[L.diag_pos] = _unscalar_grad(csr_value_grad(pd, left, right), permd, nd, L.block)
    if no:
        po, permo = (L.offd, None) if not L.block else L.offd.scalar(*L.block)
        gv[L.offd_pos] = _unscalar_grad(csr_value_grad(po, left, right_ghost), permo, no, L.block)
    return gv


class RowShardMatVec(torch.autograd.Function):
    """y = A_diag x + A_offd x_ghost, halo exchange overlapped with the diagonal product."""

    @staticmethod
    def forward(ctx, values, x, layout):
        y, xg = forward_product(layout, values, x)
        ctx.layout = layout
        ctx.save_for_backward(values, x, xg)
        return y

    @staticmethod
    def backward(ctx, g):
        L = ctx.layout
        values, x, xg = saved_tensors(ctx, L.comm, "backward of a DSparseTensor product")
        g = g.contiguous()
        gx = reverse_product(L, values.detach(), g) if ctx.needs_input_grad[1] else None
        gv = _values_grad(L, values, g, x, xg) if ctx.needs_input_grad[0] else None
        return gv, gx, None


class RowShardRMatVec(torch.autograd.Function):
    """A^T y = A_diag^T y + reverse halo of A_offd^T y."""

    @staticmethod
    def forward(ctx, values, y, layout):
        out = reverse_product(layout, values, y)
        ctx.layout = layout
        ctx.save_for_backward(values, y)
        return out

    @staticmethod
    def backward(ctx, g):
        L = ctx.layout
        values, y = saved_tensors(ctx, L.comm, "backward of a DSparseTensor transposed product")
        g = g.contiguous()
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            return None, None, None
        gy, gg = forward_product(L, values.detach(), g)  # A g, and the ghost rows of g
        gv = _values_grad(L, values, y, g, gg) if ctx.needs_input_grad[0] else None
        return gv, (gy if ctx.needs_input_grad[1] else None), None
