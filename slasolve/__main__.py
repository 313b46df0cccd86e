"""``python -m slasolve``: what this install is made of, and whether it works.

    python -m slasolve                 # the report (slasolve.show_config())
    python -m slasolve --json          # the same as JSON
    mpiexec -n 2 python -m slasolve    # also checks that mpiexec and mpi4py's MPI agree

Exit status 0 when the install works, 1 when something is broken (mpi4py cannot load MPI,
petsc4py/slepc4py installed but failing to import, an mpiexec of another MPI, ...; the
report's PROBLEMS section says what and what to do). Under ``mpiexec`` rank 0 prints
(other ranks' problems included) and every rank exits with the same status.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    """Collective (every rank of ``COMM_WORLD``). Print the configuration; return the exit
    status (0 = the install works)."""
    from mpi4py import MPI

    from .config import config_info, format_config

    parser = argparse.ArgumentParser(prog="python -m slasolve", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the configuration as JSON")
    args, _petsc = parser.parse_known_args(argv)   # PETSc options (-log_view ...) are PETSc's
    comm = MPI.COMM_WORLD
    info = config_info()
    everyone = comm.gather(info["problems"], root=0)
    if comm.Get_rank() == 0:
        for rank, probs in enumerate(everyone[1:], start=1):
            info["problems"] += [f"rank {rank}: {p}" for p in probs if p not in info["problems"]]
        if args.json:
            print(json.dumps(info, indent=2, default=str), flush=True)
        else:
            print(format_config(info), flush=True)
    return int(comm.bcast(1 if info["problems"] else 0, root=0))


if __name__ == "__main__":
    sys.exit(main())
