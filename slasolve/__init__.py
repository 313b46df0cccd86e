"""slasolve: MPI-first, PETSc-backed, differentiable sparse solvers for PyTorch."""
__version__ = "0.1.0"

import warnings as _warnings

# torch marks its sparse CSR kernels "beta" with a one-time warning; slasolve
# validates its own patterns, so the warning carries no information for users.
_warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
_warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta")

# -- solvers (krylov) --
from .krylov import ConvergenceError, SolveInfo, bicgstab, cg, gmres, minres, solve  # noqa: E402

# -- foundation: local/distributed sparse tensors, placements, halo, PETSc bridge
from .sparse import SparseTensor  # noqa: E402
from .placement import DSparseSpec, Replicated, Shard, SparseShard, col_shard, row_shard  # noqa: E402
from .halo import HaloPlan  # noqa: E402
from .dsparse import DSparseTensor  # noqa: E402


def from_petsc(mat, **kwargs):
    """Collective. A row-sharded :class:`DSparseTensor` from a ``PETSc.Mat``
    (see :func:`slasolve.petsc.from_petsc`); petsc4py is imported only here."""
    from .petsc import from_petsc as _from_petsc
    return _from_petsc(mat, **kwargs)

# -- eigensolvers --
from .eigen import EigenConvergenceError, EigenInfo, eigsh  # noqa: E402
