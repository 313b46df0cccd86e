"""slasolve: MPI-first, PETSc-backed, differentiable sparse solvers for PyTorch.

The public API (see README.md): local and distributed sparse tensors
(:class:`SparseTensor`, :class:`DSparseTensor`, placements), halo exchange
(:class:`HaloPlan`), the PETSc bridge (:func:`from_petsc`, ``DSparseTensor.to_petsc``),
Krylov solvers (:func:`solve`, :func:`cg`, :func:`gmres`, :func:`minres`,
:func:`bicgstab`), eigensolvers (:func:`eigsh`) and, in :mod:`slasolve.fem`,
finite elements.

``import slasolve`` is collective under ``mpirun`` (every rank imports it): when
petsc4py/slepc4py are installed it initialises PETSc and SLEPc with ``sys.argv``
(so ``-ksp_monitor``, ``-log_view`` ... on the command line work), and with more
than one rank it makes an unhandled exception on any rank abort the job and
watches for ranks that end while others still wait in a collective, and gives each rank
``cpus // ranks on its node`` torch threads unless ``OMP_NUM_THREADS`` is set. See
:mod:`slasolve._process` and README "Running under mpirun"; opt-outs:
``SLASOLVE_ABORT_ON_EXCEPTION=0``, ``SLASOLVE_EXIT_TIMEOUT=0``.
"""
import warnings as _warnings

# torch marks its sparse CSR kernels "beta" with a one-time warning; slasolve
# validates its own patterns, so the warning carries no information for users.
_warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
_warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta")

try:
    from . import _process  # noqa: E402  (loads the MPI library, through mpi4py)

    # PETSc's start-up is collective: do it here, where every rank is, never lazily on a
    # code path that one rank may leave early (and pass the command line to PETSc).
    _process.init_petsc()
    # under mpirun: one torch thread per core of the node, not per core per rank
    _process.set_torch_threads()
except (ImportError, OSError, RuntimeError) as _exc:  # a broken install: say what and how to fix it
    from .config import import_failed as _import_failed
    _import_failed(_exc)            # raises (python -m slasolve: prints the report, exits 1)

from ._process import abort_on_unhandled_exception, parse_args  # noqa: E402
from .config import show_config  # noqa: E402
from .autograd import global_sum  # noqa: E402
from .dsparse import DSparseTensor, from_petsc  # noqa: E402
from .eigen import EigenConvergenceError, EigenInfo, eigsh  # noqa: E402
from .halo import HaloPlan  # noqa: E402
from .direct import Factorization, FactorizationError, FactorizationInfo, factorized, spsolve  # noqa: E402
from .krylov import ConvergenceError, SolveInfo, bicgstab, cg, cgs, gmres, minres, solve, tfqmr  # noqa: E402
from .nonlinear import NonlinearConvergenceError, NonlinearInfo, nonlinear_solve  # noqa: E402
from .placement import DSparseSpec, Replicated, Shard, SparseShard, col_shard, row_shard  # noqa: E402
from .sparse import SparseTensor  # noqa: E402
from .plotting import plot_residual_history  # noqa: E402

__version__ = "0.1.0"

_process.install()

__all__ = [
    "plot_residual_history",
    "SparseTensor", "DSparseTensor", "DSparseSpec", "Replicated", "SparseShard", "Shard", "row_shard",
    "col_shard", "HaloPlan", "from_petsc", "solve", "cg", "gmres", "minres", "bicgstab", "cgs", "tfqmr", "SolveInfo",
    "ConvergenceError", "nonlinear_solve", "NonlinearInfo", "NonlinearConvergenceError", "eigsh", "EigenInfo",
    "EigenConvergenceError", "abort_on_unhandled_exception",
    "global_sum", "parse_args", "spsolve", "factorized", "Factorization", "FactorizationInfo",
    "FactorizationError", "show_config",
]

