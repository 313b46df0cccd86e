"""The state every cached Krylov solver carries, whatever its backend."""
from __future__ import annotations

__all__ = ["KrylovSolver"]


class KrylovSolver:
    """Local. Base of the backends' solver objects (:class:`~slasolve.krylov.petsc_backend.PetscKrylov`,
    :class:`~slasolve.krylov.torch_backend.TorchKrylov`), cached per layout by :func:`slasolve.solve`:
    ``reuse_state``, the ``reuse_pc`` rule's state between solves, and ``previous``, the last
    solution and adjoint solution for ``x0="previous"``."""

    backend = ""

    def __init__(self) -> None:
        self.reuse_state: dict = {}
        self.previous: dict = {}
