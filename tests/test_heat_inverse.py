"""examples/heat_inverse.py --check: the transient inverse problem (checkpointed adjoint through
the heat equation, Taylor test of the objective's gradient, recomputations at the binomial
optimum, objective and error reduced), with results independent of the rank count, and its
ParaView time series (XDMF + HDF5, or .pvd naming one .pvtu per time).

Run serially and under mpirun -n 2 / 4 with --with-mpi.
"""
import os

import pytest
from mpi4py import MPI

from example_loader import load_example

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD


@pytest.mark.skipif(COMM.size > 2, reason="test-time budget: 1 and 2 ranks")
def test_heat_inverse_check(tmp_path_factory):
    pytest.importorskip("checkpoint_schedules")
    pytest.importorskip("meshio")
    heat = load_example("heat_inverse")
    folder = COMM.bcast(str(tmp_path_factory.mktemp("heat")) if COMM.rank == 0 else None)
    out = os.path.join(folder, "heat.pvd")
    res = heat.main(["--check", "--quiet", "--output", out])
    assert res["passed"], {k: res[k] for k in ("history", "rel_error", "taylor_rate")}
    # the same numbers on every rank, and (to rounding) at every rank count: 1 rank, measured
    assert len({round(v, 12) for v in COMM.allgather(res["history"][-1])}) == 1
    # objective at q = 0: the data misfit alone (noise hashed per global node id)
    assert abs(res["history"][0] - 819.6500047668294) <= 1e-10 * 819.7
    if COMM.rank == 0:
        text = open(out).read()
        assert text.count("<DataSet") == 11 and "heat_00010.pvtu" in text
        assert os.path.exists(os.path.join(folder, "heat_00010.pvtu"))
    from slasolve.fem import read_pvtu
    m = read_pvtu(os.path.join(folder, "heat_00010.pvtu"))
    assert {"u", "q", "q_true"} <= set(m.point_data)


@pytest.mark.skipif(COMM.size > 2, reason="test-time budget: 1 and 2 ranks")
def test_heat_inverse_xdmf_time_series(tmp_path_factory):
    """--output x.xdmf: one XDMF + HDF5 file set with the sources and one temperature per output
    time, read back with slasolve's own XDMF functions on this rank count."""
    pytest.importorskip("h5py")
    heat = load_example("heat_inverse")
    from slasolve.fem import read_mesh, read_point_data, xdmf_steps
    folder = COMM.bcast(str(tmp_path_factory.mktemp("heatx")) if COMM.rank == 0 else None)
    prob = heat.HeatSourceProblem(8, 6, stride=2, obs_times=2, noise=0.0, checkpoints=0,
                                  solver=dict(method="direct"), comm=COMM)
    q = prob.q_true.clone()
    path = heat.write_time_series(os.path.join(folder, "heat.xdmf"), prob, q, 2, COMM)
    times = xdmf_steps(path)
    assert len(times) == 4 and abs(times[-1] - 6 * prob.dt) <= 1e-12
    mesh = read_mesh(path, comm=COMM)
    qt = read_point_data(path, mesh, "q_true")
    assert qt.shape[0] == mesh.n_owned

