"""PETSc and SLEPc start-up with the command line, at ``import slasolve`` (step 1 of
:mod:`slasolve._process`)."""
from __future__ import annotations

import sys

from ._argv import session_petsc_argv

__all__ = ["init_petsc"]


def init_petsc() -> bool:
    """Collective (at import). Initialise PETSc and SLEPc with ``sys.argv`` if petsc4py /
    slepc4py import and the program has not initialised them already. Returns True when
    petsc4py is available."""
    try:
        import petsc4py
    except ImportError:
        return False
    if "petsc4py.PETSc" not in sys.modules:
        petsc4py.init(session_petsc_argv())
    from petsc4py import PETSc  # noqa: F401  (initialises PETSc if the user imported petsc4py only)
    try:
        import slepc4py
    except ImportError:
        return True
    if "slepc4py.SLEPc" not in sys.modules:
        slepc4py.init(session_petsc_argv())
    from slepc4py import SLEPc  # noqa: F401
    return True
