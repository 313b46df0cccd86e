"""torch threads per rank under mpirun (slasolve/_threads.py): ``cpus // ranks on the node``
unless ``OMP_NUM_THREADS`` or ``SLASOLVE_TORCH_THREADS`` says otherwise; one process unchanged.

A serial test launching one small ``mpirun`` job (under ``timeout``) of three ranks started
with different environments (MPMD): the default, ``SLASOLVE_TORCH_THREADS=2`` and
``OMP_NUM_THREADS=1`` -- which also shows that ranks whose environments differ still make
the same collective calls at import (no hang).
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

MPIRUN = shutil.which("mpirun")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# each rank prints torch's threads before and after import slasolve, its CPU affinity, the
# ranks on its node and what slasolve did
SCRIPT = """
import json, os, sys, torch
before = torch.get_num_threads()
import slasolve, slasolve._threads as t
from mpi4py import MPI
local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
# one file per rank: the ranks' stdout lines may interleave
with open(os.path.join(sys.argv[1], f"rank{MPI.COMM_WORLD.rank}.json"), "w") as fh:
    json.dump({"rank": MPI.COMM_WORLD.rank, "before": before, "after": torch.get_num_threads(),
               "cpus": len(os.sched_getaffinity(0)), "local": local, "note": t.torch_threads_note()}, fh)
"""


@pytest.mark.skipif(MPIRUN is None, reason="needs mpirun")
def test_threads_per_rank_under_mpirun(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "SLASOLVE_")) and k != "OMP_NUM_THREADS"}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_mpi_yield_when_idle="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    py = [sys.executable, "-c", SCRIPT, str(tmp_path)]
    cmd = ["timeout", "-k", "5", "120", MPIRUN, "--oversubscribe", "--bind-to", "none",
           "-n", "1", *py, ":", "-n", "1", "env", "SLASOLVE_TORCH_THREADS=2", *py,
           ":", "-n", "1", "env", "OMP_NUM_THREADS=1", *py]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {}
    for f in tmp_path.glob("rank*.json"):
        r = json.loads(f.read_text())
        rows[r["rank"]] = r
    assert sorted(rows) == [0, 1, 2], out.stdout + out.stderr
    default, explicit, omp = rows[0], rows[1], rows[2]
    assert default["after"] == min(default["before"], max(1, default["cpus"] // default["local"])), default
    assert f"{default['local']} ranks on this node" in default["note"], default
    assert explicit["after"] == 2 and "SLASOLVE_TORCH_THREADS" in explicit["note"], explicit
    assert omp["after"] == omp["before"] and omp["note"] == "", omp


def test_one_process_unchanged():
    import slasolve._threads as t
    assert t.torch_threads_note() == ""   # pytest's own process: one rank (or a singleton MPI)


@pytest.mark.skipif(MPIRUN is None, reason="needs mpirun")
def test_bad_value_on_one_rank_raises_on_every_rank():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "SLASOLVE_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_mpi_yield_when_idle="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    py = [sys.executable, "-c", "import slasolve"]
    cmd = ["timeout", "-k", "5", "120", MPIRUN, "--oversubscribe", "--bind-to", "none",
           "-n", "1", *py, ":", "-n", "1", "env", "SLASOLVE_TORCH_THREADS=two", *py]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=150)
    assert out.returncode not in (0, 124), out.stdout + out.stderr   # failed, did not hang
    assert (out.stdout + out.stderr).count("have a value that is not a non-negative integer") == 2, \
        out.stdout + out.stderr
