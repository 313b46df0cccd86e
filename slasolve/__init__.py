"""slasolve: MPI-first, PETSc-backed, differentiable sparse solvers for PyTorch."""
__version__ = "0.1.0"

import warnings as _warnings

# torch marks its sparse CSR kernels "beta" with a one-time warning; slasolve
# validates its own patterns, so the warning carries no information for users.
_warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
_warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta")
