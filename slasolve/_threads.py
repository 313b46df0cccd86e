"""torch's intra-op threads per rank under ``mpirun``, at ``import slasolve`` (step 4 of
:mod:`slasolve._process`).

torch starts as many threads per process as the process may run on (its CPU affinity).
Under ``mpirun -n P`` with ranks not pinned to their own cores (``--bind-to none``, or
Open MPI's default socket binding past 2 ranks) each of the P ranks then starts one thread
per core of the node, P times more threads than cores, and every parallel torch kernel
waits for threads that other ranks keep off the cores: a sparse product of 4,225 rows
took 15-20 ms with 2 threads per rank on a busy 2-core machine against 0.05-0.1 ms with
one. PETSc runs one thread per rank, and ``torchrun`` sets ``OMP_NUM_THREADS=1`` for the
same reason. So, when ``COMM_WORLD`` has more than one rank and the environment does not
say otherwise, each rank gets ``max(1, cpus // ranks_on_its_node)`` torch threads (never
more than torch chose itself), where ``cpus`` is the size of its CPU affinity set.

``OMP_NUM_THREADS`` set (any value) leaves torch as it is, as does
``SLASOLVE_TORCH_THREADS=0``; ``SLASOLVE_TORCH_THREADS=k`` sets ``k`` threads per rank.
One process (``python script.py``, a notebook) is never changed. NumPy/SciPy's BLAS
threads are not changed (they are fixed when NumPy loads); set ``OMP_NUM_THREADS`` for
those.
"""
from __future__ import annotations

import os

__all__ = ["set_torch_threads", "torch_threads_note"]

# what set_torch_threads decided, for show_config: "" when nothing was changed
_note = ""


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (macOS): every core
        return os.cpu_count() or 1


def set_torch_threads() -> None:
    """Collective (at import). Give torch ``max(1, cpus // ranks on this node)`` threads
    per rank when ``COMM_WORLD`` has more than one rank, unless ``OMP_NUM_THREADS`` or
    ``SLASOLVE_TORCH_THREADS`` says otherwise (module docstring). One process: nothing."""
    global _note
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        return
    # the node's ranks are counted on every rank, whatever its environment says, so that
    # ranks started with different environments still make the same collective calls
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local = node.Get_size()
    finally:
        node.Free()
    import torch
    explicit = os.environ.get("SLASOLVE_TORCH_THREADS", "").strip()
    # a bad value on some ranks only raises on every rank (the others would wait in their next collective)
    bad_ranks = world.allgather(bool(explicit) and not explicit.isdigit())
    if any(bad_ranks):
        raise ValueError(f"SLASOLVE_TORCH_THREADS={explicit!r} on this rank; ranks "
                         f"{[r for r, b in enumerate(bad_ranks) if b]} have a value that is not a non-negative integer")
    if explicit:
        if int(explicit) == 0:
            return
        wanted, how = int(explicit), "SLASOLVE_TORCH_THREADS"
    elif "OMP_NUM_THREADS" in os.environ:
        return
    else:
        wanted = min(torch.get_num_threads(), max(1, _cpus() // local))
        how = f"{_cpus()} CPUs / {local} ranks on this node"
    if wanted != torch.get_num_threads():
        torch.set_num_threads(wanted)
    _note = f"{wanted} per rank ({how})"


def torch_threads_note() -> str:
    """Local. What :func:`set_torch_threads` did at import ("" when it left torch alone)."""
    return _note
