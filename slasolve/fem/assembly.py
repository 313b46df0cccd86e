"""Distributed, vectorised, differentiable finite element assembly.

An :class:`Assembler` is built once per mesh and dof layout (collective). It
precomputes, with no Python loop over elements or nonzeros,

* the CSR pattern of the rows this rank owns (element connectivity -> COO keys
  -> ``unique``), including the entries that *other* ranks' cells contribute to
  its rows;
* for every entry ``(e, i, j)`` of every local element matrix, its slot: a
  position in the owned nonzeros, or a position in the list of *remote*
  nonzeros (rows owned by another rank);
* a :class:`~slasolve.halo.HaloPlan` over the distributed nonzero numbering
  (each rank's owned-row nonzeros numbered contiguously, rank after rank): the
  remote nonzeros are its ghosts. The owners' nnz positions of the remote
  ``(row, col)`` pairs are learnt once, by point-to-point messages;
* a node-level HaloPlan (owned nodes / ghost nodes of the mesh) for load
  vectors and for fetching ghost values of nodal fields.

Every assembly is then: element matrices for all local cells at once
(:mod:`slasolve.fem.elements`, differentiable in the coefficients), one
``index_add`` into ``owned + remote`` slots, ``plan.reverse(remote)`` added to
the owned values, and ``template.with_values(values)``: the returned
:class:`~slasolve.DSparseTensor` always has the *same* layout, halo plan and
cached PETSc Mat (refilled in place by ``to_petsc``).

Dofs. Scalar spaces (``block_size=1``): dof = global node id. Vector spaces
(``block_size=dim`` for elasticity): dof ``node * bs + component``
(node-major), stored as a block (BSR) tensor with ``block_shape (bs, bs)``.
Rank ``r`` owns the dofs of its owned nodes, ``dof_range = (start * bs, end * bs)``.
Vectors are torch tensors of the owned dofs, shape ``(n_owned_dofs,)``.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import numpy as np
import torch
from mpi4py import MPI

from .. import _log
from .._comm import check_collective, exchange_by_rank, reply_by_rank
from ..dsparse import DSparseTensor
from ..sparse import all_finite
from ..halo import HaloPlan
from . import elements as _el
from .mesh import Mesh

__all__ = ["Assembler", "FunctionSpace"]

Coef = Union[float, int, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]



class Assembler:
    """Collective (constructor). Assembly of matrices and vectors on a distributed :class:`Mesh`.

    Parameters
    ----------
    mesh : Mesh
    block_size : int
        1 for scalar problems (Poisson, heat), ``mesh.dim`` for vector problems
        (linear elasticity): block (BSR) matrices with ``block_shape (bs, bs)``.
    device : torch device, optional
        Where element matrices and assembled values live (default: the mesh's).

    Attributes
    ----------
    dof_range : (start, end) owned scalar dofs; ``n_owned_dofs``, ``n_global_dofs``.
    cell_range : (start, end) the global indices of the local cells (cells are
        numbered contiguously rank after rank; for :func:`box_mesh` this is the
        lexicographic cell order, independent of the number of ranks).
    nnz : owned (block) nonzeros; ``nnz_plan``: the nonzero-level HaloPlan;
    ``node_plan``: the node-level HaloPlan.

    Examples
    --------
    Poisson ``-div(kappa grad u) = 1`` on the unit square, ``u = 0`` on the boundary,
    P1 triangles, and the gradient of a global quantity with respect to the per-cell
    conductivity (runs unchanged under ``mpirun``):

    >>> import torch, slasolve
    >>> from mpi4py import MPI
    >>> from slasolve.fem import Assembler, DirichletBC, boundary_dofs, box_mesh
    >>> mesh = box_mesh(16)
    >>> space = Assembler(mesh)
    >>> kappa = torch.ones(mesh.n_local_cells, dtype=torch.float64, requires_grad=True)
    >>> bc = DirichletBC(space, boundary_dofs(space), 0.0)
    >>> A, b = bc.apply(space.stiffness(kappa), space.load(1.0))
    >>> u = slasolve.solve(A, b, "cg", pc="jacobi", rtol=1e-10)
    >>> round(mesh.comm.allreduce(u.max().item(), op=MPI.MAX), 3)   # continuous: 0.0737
    0.073
    >>> slasolve.global_sum(u.sum()).backward()
    >>> kappa.grad.shape == (mesh.n_local_cells,)
    True
    """

    @_log.logged("slaAssembly", "slaAsmSetup")
    def __init__(self, mesh: Mesh, block_size: int = 1, *, device=None):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a slasolve.fem.Mesh, got {type(mesh).__name__}")
        comm = mesh.comm
        err = None
        if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or \
                block_size not in (1, mesh.dim):
            err = ValueError(f"block_size must be 1 (scalar) or mesh.dim = {mesh.dim} (vector), "
                             f"got {block_size!r}")
        check_collective(comm, err, agree={"block_size": repr(block_size)})
        self.mesh = mesh
        self.comm = comm
        self.bs = int(block_size)
        self.cell = mesh.cell_type
        self.dim = mesh.dim
        self.device = torch.device(device) if device is not None else mesh.node_coords.device
        rank, size = comm.Get_rank(), comm.Get_size()
        s, e = mesh.owned_range
        self.node_offsets = np.asarray(comm.allgather(int(s)) + [int(mesh.n_global_nodes)], dtype=np.int64) \
            if size > 1 else np.array([0, mesh.n_global_nodes], dtype=np.int64)
        N = int(mesh.n_global_nodes)
        self.N = N
        bs = self.bs
        self.dof_range = (s * bs, e * bs)
        self.n_owned_nodes = e - s
        self.n_owned_dofs = (e - s) * bs
        self.n_global_dofs = N * bs
        ncells = comm.allgather(int(mesh.n_local_cells)) if size > 1 else [int(mesh.n_local_cells)]
        c0 = int(sum(ncells[:rank]))
        self.cell_range = (c0, c0 + int(mesh.n_local_cells))
        self.n_global_cells = int(sum(ncells))

        # ---- geometry of the local cells
        lc = mesh.local_cells()                                     # (E, nv) positions in node_ids
        self.cell_coords = mesh.node_coords[lc].to(self.device)
        self.local_cells = lc.to(self.device)
        owned_mask = mesh.owned_mask()
        self._owned_pos = torch.nonzero(owned_mask).flatten()      # contiguous
        self._ghost_pos = torch.nonzero(~owned_mask).flatten()
        self.node_plan = HaloPlan(comm, (s, e), mesh.node_ids[~owned_mask], offsets=self.node_offsets)

        # ---- matrix pattern (node level)
        gc = mesh.cells.to(torch.int64)
        E, nv = gc.shape
        self.nv = nv
        key = (gc[:, :, None] * N + gc[:, None, :]).reshape(-1)   # entry (e, i, j): row * N + col
        owned_vert = (gc >= s) & (gc < e)
        all_owned = bool(owned_vert.all())
        own_row = None if all_owned else owned_vert[:, :, None].expand(E, nv, nv).reshape(-1)
        if all_owned:
            rkeys, rinv = key[:0], key[:0]
        else:
            rkeys, rinv = torch.unique(key[~own_row], sorted=True, return_inverse=True)
        rk = rkeys.numpy()
        owner = np.searchsorted(self.node_offsets, rk // N, side="right") - 1
        send_counts = np.bincount(owner, minlength=size).astype(np.int64)
        xcomm = comm.Dup() if size > 1 else comm
        try:
            if size > 1:
                recv_keys, recv_counts = exchange_by_rank(xcomm, np.ascontiguousarray(rk), send_counts)
            else:
                recv_keys, recv_counts = np.empty(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
            own_keys = key if all_owned else key[own_row]
            n_own_entries = own_keys.numel()
            okeys, oinv = torch.unique(torch.cat([own_keys, torch.from_numpy(recv_keys)]), sorted=True,
                                       return_inverse=True)
            self.nnz = int(okeys.numel())
            nnz_counts = comm.allgather(self.nnz) if size > 1 else [self.nnz]
            self.nnz_offsets = np.concatenate([[0], np.cumsum(nnz_counts)]).astype(np.int64)
            off = int(self.nnz_offsets[rank])
            if size > 1:
                ans = (oinv[n_own_entries:].numpy() + off).astype(np.int64)
                remote_gid = reply_by_rank(xcomm, ans, recv_counts, send_counts)
            else:
                remote_gid = np.empty(0, dtype=np.int64)
        finally:
            if size > 1:
                xcomm.Free()
        prow = torch.div(okeys, N, rounding_mode="floor")
        self.indices = okeys - prow * N                            # global node (block) columns
        self.indptr = torch.zeros(e - s + 1, dtype=torch.int64)
        self.indptr[1:] = torch.cumsum(torch.bincount(prow - s, minlength=e - s), 0)
        self.nnz_plan = HaloPlan(comm, (off, off + self.nnz), remote_gid, offsets=self.nnz_offsets)
        self.n_remote = int(remote_gid.size)
        if all_owned:
            slot = oinv[:n_own_entries]
        else:
            slot = torch.empty(E * nv * nv, dtype=torch.int64)
            slot[own_row] = oinv[:n_own_entries]
            slot[~own_row] = self.nnz + rinv
        self._slot = slot.to(self.device)
        self._node_slot = self.local_cells.reshape(-1)

        dtype = mesh.node_coords.dtype
        shape = (N, N) + ((bs, bs) if bs > 1 else ())
        zeros = torch.zeros((self.nnz,) + ((bs, bs) if bs > 1 else ()), dtype=dtype)
        self.template = DSparseTensor.from_local_rows(self.indptr, self.indices, zeros, shape, comm,
                                                      block_shape=(bs, bs) if bs > 1 else ()).to(self.device)
        # position of each stored entry's column in cat(owned nodes, template ghosts)
        L = self.template._layout
        self._row_local = self.template.local.row_indices().to(self.device)        # 0-based owned row
        cols_t = self.indices.to(self.device)
        ghosts = L.ghost_ids.to(self.device)
        is_own = (cols_t >= s) & (cols_t < e)
        colpos = torch.where(is_own, cols_t - s,
                             (e - s) + torch.searchsorted(ghosts, cols_t).clamp(max=max(ghosts.numel() - 1, 0)))
        self._col_ext = colpos
        self._geo_cache: dict = {}

    # ------------------------------------------------------------------ helpers
    def __repr__(self) -> str:
        return (f"Assembler(cell={self.cell!r}, block_size={self.bs}, owned_dofs={self.n_owned_dofs}, "
                f"global_dofs={self.n_global_dofs}, nnz={self.nnz}, remote_nnz={self.n_remote})")

    @property
    def dtype(self) -> torch.dtype:
        return self.cell_coords.dtype

    def _coef(self, name: str, c: Coef) -> Union[float, torch.Tensor]:
        """Numbers and per-cell tensors pass through; callables are evaluated at the cell centroids
        (vertex averages; of the distinct vertices on collapsed Q1 cells)."""
        if callable(c) and not isinstance(c, torch.Tensor):
            c = c(_el.distinct_mean(self.cell_coords))
            if not isinstance(c, torch.Tensor):
                c = torch.as_tensor(np.asarray(c), dtype=self.dtype, device=self.device)
        if isinstance(c, torch.Tensor):
            E = self.mesh.n_local_cells
            if c.dim() == 1 and c.shape[0] != E:
                raise ValueError(f"{name} must have one value per local cell ({E},) "
                                 f"(cells {self.cell_range[0]}..{self.cell_range[1]} of {self.n_global_cells}), "
                                 f"got shape {tuple(c.shape)}")
        return c

    def _geo(self, name: str, build: Callable[[], torch.Tensor]):
        """Geometry-only per-cell data (reference element matrices, volumes), built once per
        Assembler: no user coefficient is ever part of a cached value. Keyed on the identity
        and version counter of ``cell_coords``, so an in-place change of the coordinates
        rebuilds them; coordinates that require grad (shape derivatives) are never cached."""
        c = self.cell_coords
        if c.requires_grad:
            return build()
        key = (c, c._version)   # the tensor itself, not id(c): a freed id can be reused
        hit = self._geo_cache.get(name)
        if hit is not None and _same_key(hit[0], key):
            return hit[1]
        val = build()
        self._geo_cache[name] = (key, val)
        return val

    def _ref_stiffness(self) -> torch.Tensor:
        """(E, nv, nv) stiffness matrices with unit coefficient (cached geometry)."""
        return self._geo("stiffness", lambda: _el.stiffness(self.cell_coords, 1.0, self.cell))

    def _ref_mass(self) -> torch.Tensor:
        """(E, nv, nv) mass matrices with unit density (cached geometry)."""
        return self._geo("mass", lambda: _el.mass(self.cell_coords, 1.0, self.cell))

    def _cell_coef(self, name: str, c: Coef) -> Union[float, torch.Tensor]:
        """A validated coefficient: a Python float, or an ``(E, 1, 1)`` tensor (differentiable)."""
        c = self._coef(name, c)
        if not isinstance(c, torch.Tensor):
            if isinstance(c, bool) or not isinstance(c, (int, float)):
                raise TypeError(f"{name} must be a number, a tensor of shape ({self.mesh.n_local_cells},) "
                                f"or a callable, got {type(c).__name__}")
            c = float(c)
            if not np.isfinite(c):
                raise ValueError(f"{name} must be finite, got {c}")
            return c
        return _el._coef(name, c, self.mesh.n_local_cells, self.cell_coords)[:, None, None]

    def _collective(self, fn, *args):
        """Run a local kernel; a ValueError/TypeError on any rank is raised on every rank."""
        out, err = None, None
        try:
            out = fn(*args)
        except (ValueError, TypeError) as ex:
            err = ex
        check_collective(self.comm, err)
        return out

    def owned_coords(self) -> torch.Tensor:
        """Local. ``(n_owned_nodes, dim)`` coordinates of the owned nodes (dof order)."""
        return self.mesh.owned_node_coords().to(self.device)

    def owned_dof_coords(self) -> torch.Tensor:
        """Local. ``(n_owned_dofs, dim)`` coordinates of every owned dof."""
        x = self.owned_coords()
        return x.repeat_interleave(self.bs, 0) if self.bs > 1 else x

    def interpolate(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Local. Nodal interpolant of ``fn`` on the owned dofs, ``(n_owned_dofs,)``.
        ``fn(x)`` gets ``(n, dim)`` coordinates and returns ``(n,)`` or ``(n, bs)``."""
        v = fn(self.owned_coords())
        return torch.as_tensor(v, dtype=self.dtype, device=self.device).reshape(-1)

    def fetch_ghosts(self, x_owned: torch.Tensor) -> torch.Tensor:
        """Collective. Values on every local node (``mesh.node_ids`` order), shape
        ``(n_local_nodes, bs)`` (``(n_local_nodes,)`` for scalars), from the owned dofs.
        Differentiable (forward halo exchange)."""
        bs = self.bs
        xo = x_owned.reshape(self.n_owned_nodes, bs)
        xg = self.node_plan.forward(xo)
        n = self.mesh.node_ids.shape[0]
        out = xo.new_zeros((n, bs))
        out = out.index_copy(0, self._owned_pos.to(xo.device), xo)
        out = out.index_copy(0, self._ghost_pos.to(xo.device), xg)
        return out if bs > 1 else out.reshape(-1)

    # ------------------------------------------------------------------ generic assembly
    @_log.logged("slaAssembly", "slaAssembleMat")
    def assemble_matrix(self, element_matrices: torch.Tensor, *, check: bool = True) -> DSparseTensor:
        """Collective. Sum element matrices ``(E, nv*bs, nv*bs)`` (local dofs node-major) into the
        distributed matrix. Differentiable in ``element_matrices``; same layout every call.
        ``check=False`` skips the (collective) shape/finiteness validation."""
        E, nv, bs = self.mesh.n_local_cells, self.nv, self.bs
        err = None
        n = nv * bs
        if not check:
            pass
        elif not isinstance(element_matrices, torch.Tensor):
            err = TypeError(f"element_matrices must be a torch.Tensor, got {type(element_matrices).__name__}")
        elif element_matrices.shape != (E, n, n):
            err = ValueError(f"element_matrices must have shape ({E}, {n}, {n}), got "
                             f"{tuple(element_matrices.shape)}")
        elif not bool(torch.isfinite(element_matrices.detach()).all()):
            err = ValueError("element_matrices contains NaN or infinite values")
        if check:
            check_collective(self.comm, err)
        Ke = element_matrices.to(self.device)
        if bs > 1:
            flat = Ke.reshape(E, nv, bs, nv, bs).permute(2, 4, 0, 1, 3).reshape(bs * bs, E * nv * nv)
        else:
            flat = Ke.reshape(E * nv * nv)
        return self._assemble_slots(flat)

    def _assemble_slots(self, flat: torch.Tensor) -> DSparseTensor:
        """Collective. Entries in element-slot order -> the matrix: ``(E*nv*nv,)`` for scalars,
        ``(bs*bs, E*nv*nv)`` (block entry major) for blocks: an ``index_add`` along the last
        dim is several times faster than one over ``(bs, bs)`` rows."""
        buf = flat.new_zeros(flat.shape[:-1] + (self.nnz + self.n_remote,))
        buf = buf.index_add(flat.dim() - 1, self._slot, flat)
        if flat.dim() > 1:
            buf = buf.T.reshape(-1, self.bs, self.bs)
        values = buf[:self.nnz]
        if self.comm.Get_size() > 1:
            values = values + self.nnz_plan.reverse(buf[self.nnz:])
        return self.template.with_values(values)

    def _fast_cells(self) -> bool:
        """Local. Whether per-cell coefficients are assembled by a cached sparse operator
        (:meth:`_cell_operator`): CPU, geometry fixed (coordinates that require grad are not)."""
        return self.device.type == "cpu" and not self.cell_coords.requires_grad

    def _stiffness_operator(self):
        """Local. :meth:`_cell_operator` of the unit-coefficient stiffness matrices."""
        E, nv = self.mesh.n_local_cells, self.nv
        return self._cell_operator(_el.stiffness(self.cell_coords, 1.0, self.cell).reshape(1, E, nv * nv))

    def _cell_operator(self, *parts: torch.Tensor):
        """Local. ``(R, R^T)``: the matrix ``R`` (SciPy CSC, ``(nnz + n_remote) * bs * bs`` rows, ``m E`` columns) with
        ``R @ cat(c_1, ..., c_m)`` the values (owned then remote slots, each a row-major block) of
        ``sum_k c_k[e] P_k[e]`` summed over the cells: ``parts`` ``(bs*bs, E, nv*nv)`` each, the
        geometry-only element matrices of the ``m`` per-cell coefficients (block entry major).
        Column ``k E + e`` holds cell ``e``'s entries of ``P_k``, so one product assembles every
        cell (a scatter-add in column order) and its transpose is the gradient with respect to
        the coefficients (a dot product per cell). A slot sums its cells in the same order as its
        mirror slot does, so exactly symmetric element matrices give an exactly symmetric matrix."""
        import scipy.sparse as sps
        bs2 = self.bs * self.bs
        E, nn = self.mesh.n_local_cells, self.nv * self.nv
        rows = (self._slot.reshape(1, E, nn) * bs2 + torch.arange(bs2).reshape(bs2, 1, 1))
        rows = rows.permute(1, 2, 0).reshape(-1)                           # (e, ij, ab) order
        n_rows = (self.nnz + self.n_remote) * bs2
        idx = rows.to(torch.int32 if max(n_rows, len(parts) * E) < 2 ** 31 else torch.int64).numpy()
        data = torch.cat([P.permute(1, 2, 0).reshape(-1) for P in parts]).numpy()
        step = nn * bs2
        indptr = np.arange(0, len(parts) * E * step + 1, step, dtype=idx.dtype)
        R = sps.csc_matrix((data, np.tile(idx, len(parts)), indptr), shape=(n_rows, len(parts) * E))
        return R, R.T   # the transpose made once (a view; SciPy checks its format on every .T)

    @_log.logged("slaAssembly", "slaAssembleMat")
    def _assemble_cells(self, coefs: Callable[[], torch.Tensor], operator: Callable[[], object]) -> DSparseTensor:
        """Collective. The matrix ``R @ c`` for ``c = coefs()`` (validated here: ``ValueError`` /
        ``TypeError`` on every rank) and ``R, R^T = operator()`` (:meth:`_cell_operator`), differentiable
        in ``c``. One Allreduce: the coefficients' check and the finiteness of the sums made (an
        overflow) ride on it, and the values go into the template unchecked (they have its
        shape and dtype by construction)."""
        buf, err = None, None
        try:
            R, RT = operator()
            buf = _CellLinear.apply(coefs().to(self.dtype), R, RT)
            if not all_finite(buf):
                raise ValueError("the assembled values overflow (NaN or infinite entries)")
        except (ValueError, TypeError) as ex:
            err = ex
        check_collective(self.comm, err)
        if self.bs > 1:
            buf = buf.reshape(-1, self.bs, self.bs)
        values = buf[:self.nnz]
        if self.comm.Get_size() > 1:
            values = values + self.nnz_plan.reverse(buf[self.nnz:])
        return self.template._with_checked_values(values)

    @_log.logged("slaAssembly", "slaAssembleVec")
    def assemble_vector(self, element_vectors: torch.Tensor, *, check: bool = True) -> torch.Tensor:
        """Collective. Sum element vectors ``(E, nv*bs)`` (or ``(E, nv, bs)``) into the owned
        dofs ``(n_owned_dofs,)``; ghost-node contributions go to their owners (reverse halo)."""
        E, nv, bs = self.mesh.n_local_cells, self.nv, self.bs
        err = None
        if not check:
            pass
        elif not isinstance(element_vectors, torch.Tensor):
            err = TypeError(f"element_vectors must be a torch.Tensor, got {type(element_vectors).__name__}")
        elif element_vectors.numel() != E * nv * bs or element_vectors.shape[0] != E:
            err = ValueError(f"element_vectors must have shape ({E}, {nv * bs}), got "
                             f"{tuple(element_vectors.shape)}")
        elif not bool(torch.isfinite(element_vectors.detach()).all()):
            err = ValueError("element_vectors contains NaN or infinite values")
        if check:
            check_collective(self.comm, err)
        return self._owned_from_local(self._local_sums(element_vectors.to(self.device).reshape(E, nv, bs)))

    def _local_sums(self, element_vectors: torch.Tensor) -> torch.Tensor:
        """Local. Sums of element vectors ``(E, nv, bs)`` on every local node ``(n_local_nodes, bs)``,
        before the reverse halo (no checks)."""
        E, nv, bs = element_vectors.shape
        n = self.mesh.node_ids.shape[0]
        # index_add along the last dim: over (n, bs) rows torch takes a slow row-by-row path
        fe = element_vectors.permute(2, 0, 1).reshape(bs, E * nv)
        return fe.new_zeros((bs, n)).index_add(1, self._node_slot, fe).T

    def _owned_from_local(self, buf: torch.Tensor) -> torch.Tensor:
        """Collective. Sums on every local node ``(n_local_nodes, bs)`` -> owned dofs (reverse halo)."""
        owned = buf[self._owned_pos.to(buf.device)]
        if self.comm.Get_size() > 1:
            owned = owned + self.node_plan.reverse(buf[self._ghost_pos.to(buf.device)])
        return owned.reshape(-1)

    # ------------------------------------------------------------------ operators
    @_log.logged("slaAssembly")
    def stiffness(self, kappa: Coef = 1.0) -> DSparseTensor:
        """Collective. Stiffness ``∫ kappa ∇u·∇v`` (scalar space). ``kappa``: number, per-local-cell
        tensor ``(E,)`` (may require grad) or a callable of the cell centroids ``(E, dim)``."""
        if self.bs != 1:   # the same on every rank (block_size agreed at construction)
            raise ValueError("stiffness() needs a scalar space (block_size=1); use elasticity()")
        if self._fast_cells():
            return self._assemble_cells(lambda: _cell_values(self._cell_coef("kappa", kappa), self.mesh.n_local_cells),
                                        lambda: self._geo("stiffness operator", self._stiffness_operator))

        def kernel():
            k = self._cell_coef("kappa", kappa)
            return self._ref_stiffness() * k
        return self.assemble_matrix(self._collective(kernel), check=False)

    @_log.logged("slaAssembly")
    def mass(self, rho: Coef = 1.0) -> DSparseTensor:
        """Collective. Consistent mass ``∫ rho u·v`` (``rho`` as ``kappa`` in :meth:`stiffness`);
        for a vector space the block mass ``M ⊗ I``."""
        Me = self._collective(lambda: self._ref_mass() * self._cell_coef("rho", rho))
        if self.bs > 1:
            E, nv, bs = Me.shape[0], self.nv, self.bs
            eye = torch.eye(bs, dtype=Me.dtype, device=Me.device)
            Me = (Me[:, :, None, :, None] * eye[None, None, :, None, :]).reshape(E, nv * bs, nv * bs)
        return self.assemble_matrix(Me, check=False)

    @_log.logged("slaAssembly")
    def elasticity(self, young: Coef = 1.0, nu: Coef = 0.3, kind: Optional[str] = None) -> DSparseTensor:
        """Collective. Isotropic linear elasticity (vector space, ``block_size=dim``).
        ``kind``: ``"plane_strain"`` (2-D default here) / ``"plane_stress"`` / ``"3d"``."""
        if self.bs != self.dim:   # the same on every rank (block_size agreed at construction)
            raise ValueError(f"elasticity() needs a vector space (block_size={self.dim})")
        if kind is None:
            kind = "plane_strain" if self.dim == 2 else "3d"
        E, nv, bs = self.mesh.n_local_cells, self.nv, self.bs

        def parts():
            # (bs*bs, E, nv*nv): the layout _assemble_slots scatters, so no permute per call
            KL, KM = _el._elasticity_parts_blocked(self.cell_coords, self.cell)
            # exactly symmetric element matrices (the products round the (a, i, b, k) and
            # (b, k, a, i) entries differently), so K is exactly symmetric: spsolve's default
            # then picks Cholesky, and the adjoint's symmetry check passes without a margin
            KL, KM = (0.5 * (K + K.permute(1, 0, 2, 4, 3)) for K in (KL, KM))
            return KL.reshape(bs * bs, E, nv * nv), KM.reshape(bs * bs, E, nv * nv)

        def coefs():
            _, lam, mu = _el._elasticity_coefs(E, self.dim, self._coef("young", young), self._coef("nu", nu),
                                               kind, self.cell_coords)
            return lam, mu

        if self._fast_cells():
            return self._assemble_cells(lambda: torch.cat(coefs()[::-1]), lambda: self._geo(
                "elasticity operator", lambda: self._cell_operator(*parts()[::-1])))   # columns: mu, lam

        def kernel():
            lam, mu = coefs()
            KL, KM = self._geo("elasticity", parts)
            return torch.addcmul(mu[:, None] * KM, lam[:, None], KL).reshape(bs * bs, E * nv * nv)
        return self._assemble_slots(self._collective(kernel))

    def _nodal_on_cells(self, f) -> torch.Tensor:
        """(E, nv, bs) values of ``f`` at each local cell's vertices."""
        E, nv, bs = self.mesh.n_local_cells, self.nv, self.bs
        dt, dev = self.dtype, self.device
        if callable(f) and not isinstance(f, torch.Tensor):
            v = f(self.mesh.node_coords.to(dev))
            v = torch.as_tensor(v, dtype=dt, device=dev) if not isinstance(v, torch.Tensor) else v
            n = self.mesh.node_ids.shape[0]
            if v.numel() != n * bs:
                raise ValueError(f"f(x) must return ({n},)" + ("" if bs == 1 else f" or ({n}, {bs})") +
                                 f" values for {n} points, got shape {tuple(v.shape)}")
            vloc = v.reshape(n, bs)
        elif isinstance(f, torch.Tensor) and f.dim() >= 2 and f.shape[0] == E and f.shape[1] == nv:
            if f.numel() != E * nv * bs:
                raise ValueError(f"f must have shape ({E}, {nv}" + ("" if bs == 1 else f", {bs}") +
                                 f") (values at each cell's vertices), got {tuple(f.shape)}")
            return f.to(dtype=dt, device=dev).reshape(E, nv, bs)
        elif isinstance(f, torch.Tensor) and f.dim() in (1, 2) and f.shape[0] in (self.n_owned_dofs,
                                                                                 self.n_owned_nodes) \
                and f.numel() == self.n_owned_dofs:
            raise _OwnedValues(f)  # owned nodal values: the caller fetches ghosts collectively
        elif isinstance(f, (int, float, torch.Tensor)) and not isinstance(f, bool) and \
                (not isinstance(f, torch.Tensor) or f.numel() in (1, bs)):
            c = torch.as_tensor(f, dtype=dt, device=dev).reshape(-1)
            if not bool(torch.isfinite(c.detach()).all()):
                raise ValueError(f"f must be finite, got {f}")
            return c.expand(bs).reshape(1, 1, bs).expand(E, nv, bs)
        elif isinstance(f, torch.Tensor):
            raise ValueError(f"f has shape {tuple(f.shape)}; expected owned nodal values ({self.n_owned_dofs},), "
                             f"per-cell vertex values ({E}, {nv}" + ("" if bs == 1 else f", {bs}") +
                             ") or a constant")
        else:
            raise TypeError("f must be a number, a callable f(x), a tensor of owned nodal values "
                            f"({self.n_owned_dofs},) or of per-cell vertex values ({E}, {nv}"
                            + ("" if bs == 1 else f", {bs}") + f"), got {type(f).__name__}")
        if not bool(torch.isfinite(vloc.detach()).all()):
            raise ValueError("f contains NaN or infinite values")
        return self._gather_cells(vloc)

    def _gather_cells(self, vloc: torch.Tensor) -> torch.Tensor:
        """(n_local_nodes, bs) -> (E, nv, bs), a view of a contiguous (bs, E, nv) gather (the
        layout of :meth:`_load_kernel`; gathering (bs,) rows is slow)."""
        return vloc.T[:, self.local_cells].permute(1, 2, 0)

    @_log.logged("slaAssembly", "slaAssembleVec")
    def load(self, f=1.0) -> torch.Tensor:
        """Collective. Consistent load vector ``∫ f·v`` on the owned dofs, ``(n_owned_dofs,)``.

        ``f``: a number (or ``bs`` numbers), a callable ``f(x)`` of ``(n, dim)`` node
        coordinates returning ``(n,)`` / ``(n, bs)``, a tensor of owned nodal values
        ``(n_owned_dofs,)`` (ghost values fetched; differentiable), or per-cell vertex
        values ``(E, nv[, bs])``. ``f`` is interpolated with the element's shape functions.
        """
        fe, err, owned = None, None, None
        try:
            fe = self._nodal_on_cells(f)
        except _OwnedValues as o:
            owned = o.values
        except (ValueError, TypeError) as ex:
            err = ex
        check_collective(self.comm, err)
        # ranks must agree on the branch (owned values need a collective ghost fetch)
        flag = self.comm.allreduce(int(owned is not None), op=MPI.MAX) if self.comm.Get_size() > 1 \
            else int(owned is not None)
        if flag:
            check_collective(self.comm, None if owned is not None else
                             ValueError("f is owned nodal values on some ranks but not on others"))
            if not bool(torch.isfinite(owned.detach()).all()):
                err = ValueError("f contains NaN or infinite values")
            check_collective(self.comm, err)
            vo = owned.to(dtype=self.dtype, device=self.device)
            # b = M f with the assembled (scalar, node-level) mass matrix: one SpMV instead of
            # per-cell work. It is cached geometry; ranks agree (one Allreduce) on whether to
            # (re)build it (collective) or, for coordinates that require grad, not to use it.
            c = self.cell_coords
            key = None if c.requires_grad else (c, c._version)
            hit = self._geo_cache.get("mass(nodes)")
            need = 2 if key is None else int(hit is None or not _same_key(hit[0], key))
            if self.comm.Get_size() > 1:
                need = self.comm.allreduce(need, op=MPI.BOR)
            if not need & 2:
                if need & 1:
                    self._geo_cache["mass(nodes)"] = (key, self._node_mass())
                Ms = self._geo_cache["mass(nodes)"][1]
                return (Ms @ vo.reshape(self.n_owned_nodes, self.bs)).reshape(-1)
            vloc = self.fetch_ghosts(vo)
            fe = self._gather_cells(vloc.reshape(-1, self.bs))
        if fe.dim() == 3 and fe.stride(0) == 0 and fe.stride(1) == 0:
            # a constant: scale the cached ∫ v of every local node (no per-cell work). The branch
            # is the same on every rank (a rank without cells has a (0, nv, bs) expanded constant)
            w = self._geo("load(1)", lambda: self._local_sums(self._load_kernel(
                torch.ones((1, 1, 1), dtype=self.dtype, device=self.device).expand(fe.shape[0], self.nv, 1))))
            return self._owned_from_local(w * (fe[0, 0] if fe.shape[0] else fe.new_zeros(fe.shape[2:])))
        be = self._collective(lambda: self._load_kernel(fe))
        return self._owned_from_local(self._local_sums(be))

    def _node_mass(self) -> DSparseTensor:
        """Collective. The assembled scalar mass matrix on the node pattern (geometry only)."""
        M0 = self._ref_mass().reshape(-1)
        buf = M0.new_zeros(self.nnz + self.n_remote).index_add(0, self._slot, M0)
        values = buf[:self.nnz]
        if self.comm.Get_size() > 1:
            values = values + self.nnz_plan.reverse(buf[self.nnz:])
        if self.bs == 1:
            return self.template.with_values(values)
        N = self.N
        return DSparseTensor.from_local_rows(self.indptr, self.indices, values.cpu(), (N, N),
                                             self.comm).to(self.device)

    def _load_kernel(self, fe: torch.Tensor) -> torch.Tensor:
        """``be[e,i,:] = Σ_j M_e[i,j] fe[e,j,:]`` for vertex values ``fe (E, nv, bs)``."""
        if self.cell in ("triangle", "tetra"):
            # P1 simplex mass: |e| (1 + δ_ij) / ((d+1)(d+2)); only the volumes are cached
            d = self.dim
            c = self._geo("volume/(d+1)(d+2)", lambda: (_el.element_volume(self.cell_coords, self.cell)
                                                        / ((d + 1) * (d + 2)))[:, None])
            x = fe.permute(2, 0, 1)          # (bs, E, nv): the layout _local_sums scatters
            tot = x[..., 0]
            for j in range(1, x.shape[2]):   # over the nv vertices (torch's sum over a short dim is slow)
                tot = tot + x[..., j]
            return (x + tot[..., None]).mul_(c).permute(1, 2, 0)
        return torch.einsum("eij,ejd->eid", self._ref_mass(), fe)

    def neumann(self, g=1.0, where: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
        """Collective. Neumann load ``∫_Γ g·v ds`` on the boundary facets selected by ``where``
        (flux for scalar spaces, traction for vector spaces); see
        :func:`slasolve.fem.facets.neumann_load`."""
        from .facets import neumann_load
        return neumann_load(self, g, where)

    def zeros(self) -> torch.Tensor:
        """Local. A zero vector of the owned dofs."""
        return torch.zeros(self.n_owned_dofs, dtype=self.dtype, device=self.device)


def _cell_values(c, E: int) -> torch.Tensor:
    """Local. A validated coefficient of ``Assembler._cell_coef`` as ``(E,)`` values."""
    return c.reshape(E) if isinstance(c, torch.Tensor) else torch.full((E,), c, dtype=torch.float64)


class _CellLinear(torch.autograd.Function):
    """``R @ x`` for a SciPy sparse ``R`` (CPU); its gradient is ``R^T @ g``, itself a
    ``_CellLinear`` (so higher derivatives exist)."""

    @staticmethod
    def forward(ctx, x, R, RT):
        ctx.R, ctx.RT = R, RT
        return torch.from_numpy(np.asarray(R @ x.detach().contiguous().numpy()))

    @staticmethod
    def backward(ctx, g):
        return _CellLinear.apply(g.contiguous(), ctx.RT, ctx.R), None, None


def _same_key(a, b) -> bool:
    """Cached geometry key: the same coordinate tensor object at the same version."""
    return a[0] is b[0] and a[1] == b[1]


class _OwnedValues(Exception):
    def __init__(self, values):
        super().__init__("owned values")
        self.values = values


FunctionSpace = Assembler
