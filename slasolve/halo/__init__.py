"""Halo exchange over mpi4py point-to-point: :class:`HaloPlan`."""
from .plan import HaloPlan, halo_forward, halo_reverse

__all__ = ["HaloPlan", "halo_forward", "halo_reverse"]
