"""Rigid-body modes of a vector (elasticity) space: the near-nullspace of linear elasticity.

Pass them to :func:`slasolve.solve` as ``near_nullspace=`` with ``pc="gamg"``:
smoothed-aggregation AMG then builds its coarse spaces from translations *and*
rotations instead of the block-constant default, which cuts the iteration count of
elasticity solves (the rotations are the low-energy modes it otherwise misses).
"""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from .._comm import check_collective
from .assembly import Assembler

__all__ = ["rigid_body_modes"]


def rigid_body_modes(space: Assembler) -> torch.Tensor:
    """Collective. The rigid-body modes on this rank's owned dofs, ``(n_owned_dofs, m)``.

    ``m = 3`` in 2-D (two translations, the rotation ``(-y, x)``), ``m = 6`` in 3-D (three
    translations, the rotations about the x, y and z axes: ``(0, -z, y)``, ``(z, 0, -x)``,
    ``(-y, x, 0)``), in the space's dof layout (node-major: dof ``node * dim + component``,
    as :class:`~slasolve.fem.Assembler` with ``block_size=dim`` numbers them). Rotations
    are about the centroid of the nodes (one reduction), which keeps the columns well
    conditioned far from the origin; the span is the same for any centre. The columns
    are not orthonormal (:func:`slasolve.solve` orthonormalises them). Every mode lies
    in the kernel of the *unconstrained* elasticity stiffness (``A @ Z ~ 0``).

    Parameters
    ----------
    space : Assembler
        A vector space: ``block_size == mesh.dim`` (2 or 3).

    Raises
    ------
    ValueError
        On every rank, for a scalar space.
    """
    if not isinstance(space, Assembler):
        raise TypeError(f"space must be a slasolve.fem.Assembler, got {type(space).__name__}")
    dim, bs = space.dim, space.bs
    check_collective(space.comm, None if bs == dim and dim in (2, 3) else
                     ValueError(f"rigid_body_modes needs a vector space (block_size = mesh.dim = {dim}), "
                                f"got block_size={bs}"))
    x = space.owned_coords().to(torch.float64)                      # (n_owned_nodes, dim)
    comm = space.comm
    tot = np.concatenate([x.sum(0).cpu().numpy(), [x.shape[0]]]).astype(np.float64)
    if comm.Get_size() > 1:
        comm.Allreduce(MPI.IN_PLACE, tot, op=MPI.SUM)
    c = torch.as_tensor(tot[:dim] / max(tot[dim], 1.0), dtype=x.dtype, device=x.device)
    x = x - c
    n = x.shape[0]
    m = 3 if dim == 2 else 6
    Z = x.new_zeros((n, dim, m))
    idx = torch.arange(dim, device=x.device)
    Z[:, idx, idx] = 1.0                                           # translations
    if dim == 2:
        Z[:, 0, 2], Z[:, 1, 2] = -x[:, 1], x[:, 0]
    else:
        X, Y, W = x[:, 0], x[:, 1], x[:, 2]
        Z[:, 1, 3], Z[:, 2, 3] = -W, Y                             # about x: (0, -z, y)
        Z[:, 0, 4], Z[:, 2, 4] = W, -X                             # about y: (z, 0, -x)
        Z[:, 0, 5], Z[:, 1, 5] = -Y, X                             # about z: (-y, x, 0)
    return Z.reshape(n * dim, m).to(space.dtype)
