"""Dirichlet conditions by symmetric elimination (keeps SPD), differentiable.

For constrained dofs ``D`` with values ``g`` and free dofs ``F``, the system
``A x = b`` becomes

    [ A_FF  0 ] [x_F]   [ b_F - A_FD g ]
    [ 0     I ] [x_D] = [ g            ]

i.e. the rows *and* columns of ``D`` are zeroed, their diagonal set to 1 (or
kept, ``diagonal="keep"``: then ``b_D = A_DD g``) and ``b_F`` lifted by
``A_FD g``. The result has the same pattern and layout as ``A`` (values are
masked, never removed), so the PETSc Mat is refilled in place and the
operation is differentiable in ``A``'s values, ``b`` and ``g``. The masks are
computed once per (space, dofs): a ghost column needs its owner's constrained
flag, fetched by one forward halo exchange at construction.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch

from .._comm import check_collective
from ..dsparse import DSparseTensor
from ..sparse import all_finite
from .assembly import Assembler
from .mesh import boundary_nodes

__all__ = ["DirichletBC", "apply_dirichlet", "boundary_dofs"]


def boundary_dofs(space: Assembler, where: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                  components: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Local. Sorted global ids of the *owned* dofs on the domain boundary.

    ``where``: vectorised predicate on node coordinates (see
    :func:`slasolve.fem.boundary_nodes`); ``components``: for vector spaces, the
    components to constrain (default: all).
    """
    if not isinstance(space, Assembler):
        raise TypeError(f"space must be an Assembler, got {type(space).__name__}")
    nodes = boundary_nodes(space.mesh, where)
    bs = space.bs
    comps = list(range(bs)) if components is None else [int(c) for c in components]
    if any(c < 0 or c >= bs for c in comps):
        raise ValueError(f"components must lie in [0, {bs}), got {comps}")
    if bs == 1:
        return nodes.clone()
    c = torch.as_tensor(comps, dtype=torch.int64)
    return torch.sort((nodes[:, None] * bs + c[None, :]).reshape(-1)).values


class DirichletBC:
    """Collective (constructor). Dirichlet condition ``x[dofs] = values`` on an :class:`Assembler`'s layout.

    Parameters
    ----------
    space : Assembler
    dofs : int tensor / array
        Global ids of constrained dofs *owned by this rank* (e.g. from
        :func:`boundary_dofs`); may be empty on some ranks.
    values : number, tensor ``(len(dofs),)`` or callable
        The prescribed values ``g``. A callable gets the ``(k, dim)`` coordinates of
        the constrained dofs' nodes and returns ``(k,)`` or, for vector spaces,
        ``(k, bs)`` (the constrained component is picked). A tensor may require grad.
    diagonal : 1.0 (default) or "keep"
        The diagonal of the constrained rows: 1 (``b_D = g``), or the assembled
        diagonal (``b_D = A_DD g``; better scaled for large coefficients).

    Out-of-range or non-owned dofs, duplicates with tensor values, or non-finite
    values raise ``ValueError`` on every rank.
    """

    def __init__(self, space: Assembler, dofs, values: Union[float, torch.Tensor, Callable] = 0.0, *,
                 diagonal: Union[float, str] = 1.0):
        if not isinstance(space, Assembler):
            raise TypeError(f"space must be an Assembler, got {type(space).__name__}")
        comm = space.comm
        self.space = space
        err = None
        d0, d1 = space.dof_range
        dev, dt = space.device, space.dtype
        idx = None
        try:
            if diagonal != "keep" and not (isinstance(diagonal, (int, float)) and not isinstance(diagonal, bool)
                                           and float(diagonal) > 0):
                raise ValueError(f"diagonal must be a positive number or 'keep', got {diagonal!r}")
            d = dofs if isinstance(dofs, torch.Tensor) else torch.as_tensor(np.asarray(dofs))
            if d.is_floating_point() or d.dtype == torch.bool or d.is_complex():
                raise TypeError(f"dofs must be an integer array of global dof ids, got {d.dtype}")
            d = d.reshape(-1).to(torch.int64).cpu()
            if d.numel():
                lo, hi = int(d.min()), int(d.max())
                if lo < d0 or hi >= d1:
                    bad = d[(d < d0) | (d >= d1)]
                    raise ValueError(f"dofs must be owned by this rank, in [{d0}, {d1}) of "
                                     f"{space.n_global_dofs} global dofs; got {bad.numel()} outside "
                                     f"(e.g. {int(bad[0])})")
            uniq = torch.unique(d, sorted=True)
            gvals = None
            if callable(values) and not isinstance(values, torch.Tensor):
                x = space.owned_coords()[((uniq - d0) // space.bs).to(dev)]
                v = values(x)
                v = torch.as_tensor(v, dtype=dt, device=dev) if not isinstance(v, torch.Tensor) else v.to(dt)
                k = uniq.numel()
                if v.numel() == k * space.bs and space.bs > 1:
                    v = v.reshape(k, space.bs).gather(1, ((uniq - d0) % space.bs).to(dev)[:, None]).reshape(-1)
                elif v.numel() != k:
                    raise ValueError(f"values(x) must return ({k},) or ({k}, {space.bs}) values, "
                                     f"got shape {tuple(v.shape)}")
                gvals, idx = v.reshape(-1), uniq
            elif isinstance(values, torch.Tensor) and values.dim() > 0 and values.numel() != 1:
                if values.shape != (d.numel(),):
                    raise ValueError(f"values must have shape ({d.numel()},) (one per dof), got "
                                     f"{tuple(values.shape)}")
                if uniq.numel() != d.numel():
                    raise ValueError("dofs contains duplicates (not allowed with a tensor of values)")
                gvals, idx = values.to(dtype=dt, device=dev), d
            elif isinstance(values, (int, float, torch.Tensor)) and not isinstance(values, bool):
                gvals = torch.as_tensor(values, dtype=dt, device=dev).reshape(1).expand(uniq.numel())
                idx = uniq
            else:
                raise TypeError(f"values must be a number, a tensor or a callable, got {type(values).__name__}")
            if not bool(torch.isfinite(gvals.detach()).all()):
                raise ValueError("values contains NaN or infinite values")
        except (ValueError, TypeError) as ex:
            err = ex
        check_collective(comm, err)
        self.dofs = idx
        self.values = gvals
        self.diagonal = diagonal
        self._local = (idx - d0).to(dev)
        n_glob = comm.allreduce(int(idx.numel())) if comm.Get_size() > 1 else int(idx.numel())
        self.n_constrained_global = int(n_glob)

        # ---- masks on the template's nonzeros
        bs = space.bs
        T = space.template
        L = T._layout
        flag = torch.zeros(space.n_owned_dofs, dtype=dt, device=dev)
        flag[self._local] = 1.0
        self.constrained = flag > 0                                         # (n_owned_dofs,)
        fo = flag.reshape(-1, bs)
        fg = L.halo.forward_raw(fo) if L.halo.n_ghost or comm.Get_size() > 1 else fo.new_zeros((0, bs))
        ext = torch.cat([fo, fg.to(dev)], 0) > 0                            # (n_owned + n_ghost, bs)
        row_c = (fo > 0)[space._row_local]                                  # (nnz, bs)
        col_c = ext[space._col_ext]                                         # (nnz, bs)
        is_diag = (T.local.indices.to(dev) - space.mesh.owned_range[0]) == space._row_local
        if bs > 1:
            eye = torch.eye(bs, dtype=torch.bool, device=dev)
            self._zero = row_c[:, :, None] | col_c[:, None, :]
            self._fD = (~row_c)[:, :, None] & col_c[:, None, :]
            self._diag = is_diag[:, None, None] & eye[None] & row_c[:, :, None]
        else:
            self._zero = (row_c | col_c).reshape(-1)
            self._fD = ((~row_c) & col_c).reshape(-1)
            self._diag = is_diag & row_c.reshape(-1)
        self._zero_kept = self._zero & ~self._diag     # diagonal="keep": what is zeroed
        self._fills: dict = {}

    def _fill(self, dtype: torch.dtype) -> torch.Tensor:
        """Local. The values of the zeroed entries (``diagonal`` on the constrained rows' diagonal,
        0 elsewhere), made once per dtype."""
        hit = self._fills.get(dtype)
        if hit is None:
            hit = self._fills[dtype] = self._diag.to(dtype) * float(self.diagonal)
        return hit

    def __repr__(self) -> str:
        return f"DirichletBC(n_local={self.dofs.numel()}, n_global={self.n_constrained_global})"

    def full(self, values: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Local. The owned-dof vector with ``g`` on the constrained dofs and 0 elsewhere."""
        g = self.values if values is None else values
        return self.space.zeros().index_put((self._local,), g.to(self.space.dtype))

    def apply(self, A: DSparseTensor, b: Optional[torch.Tensor] = None,
              values: Optional[torch.Tensor] = None):
        """Collective. ``(A_bc, b_bc)`` by symmetric elimination (``b_bc`` is ``None`` when
        ``b`` is). ``A`` must come from this space's assembler (same layout). ``values``
        overrides the prescribed values (same shape as ``self.values``), e.g. to
        differentiate with respect to them. Differentiable in ``A.values``, ``b`` and ``g``."""
        space = self.space
        err = None
        if not isinstance(A, DSparseTensor) or A._layout is not space.template._layout:
            err = ValueError("A must be a matrix assembled by this DirichletBC's Assembler (same layout)")
        elif b is not None and (not isinstance(b, torch.Tensor) or b.shape != (space.n_owned_dofs,)):
            err = ValueError(f"b must be a tensor of the owned dofs, shape ({space.n_owned_dofs},), got "
                             f"{tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__}")
        elif values is not None and (not isinstance(values, torch.Tensor) or values.shape != self.values.shape):
            err = ValueError(f"values must be a tensor of shape {tuple(self.values.shape)}")
        elif values is not None and not bool(torch.isfinite(values.detach()).all()):
            err = ValueError("values contains NaN or infinite values")
        v_bc = None
        if err is None:
            v = A.values
            zero = torch.zeros((), dtype=v.dtype, device=v.device)
            # one pass: the zeroed entries take their new value (0, or the diagonal of a constrained row)
            v_bc = torch.where(self._zero, self._fill(v.dtype), v) if self.diagonal != "keep" else \
                torch.where(self._zero_kept, zero, v)
            if not all_finite(v_bc):
                err = ValueError("A's values (on the rows and columns kept) contain NaN or infinite values")
        # whether any rank prescribes a nonzero or differentiable g (else there is no lifting); the
        # checks of A's values ride on this Allreduce, so A_bc takes them unchecked (same layout)
        lifted = values is not None or self.values.requires_grad or bool(self.values.detach().any())
        lifted = check_collective(space.comm, err, flag=lifted)
        A_bc = A._with_checked_values(v_bc)
        if b is None:
            return A_bc, None
        if not lifted:   # g = 0 everywhere: A[:, D] g and the constrained rows' diagonal * g are zero
            return A_bc, torch.where(self.constrained, torch.zeros((), dtype=b.dtype, device=b.device), b)
        g = self.full(values)
        lift = A.with_values(torch.where(self._fD, v, zero)).matvec(g)
        bD = A_bc.matvec(g)  # diagonal * g on D (zero rows/cols elsewhere)
        b_bc = torch.where(self.constrained, bD, b - lift)
        return A_bc, b_bc


def apply_dirichlet(A: DSparseTensor, b: Optional[torch.Tensor], bc: DirichletBC, values=None):
    """Collective. Functional form of :meth:`DirichletBC.apply`."""
    return bc.apply(A, b, values)
