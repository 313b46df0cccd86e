import os

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("slasolve property tests (docs/testing.md)")
    group.addoption("--property-full", action="store_true", default=False,
                    help="run the full property set: many hypothesis examples per property, with "
                         "shrinking (same as SLASOLVE_PROPERTY_FULL=1)")
    group.addoption("--property-examples", type=int, default=None,
                    help="examples per property (overrides the CI slice and the full set; "
                         "SLASOLVE_PROPERTY_EXAMPLES)")
    group.addoption("--property-seed", default=None,
                    help="generation seed: an int (default 0, the CI slice) or 'random' "
                         "(SLASOLVE_PROPERTY_SEED)")


def pytest_configure(config):
    # the tests' processes compute in float64 by default; a pytest-xdist controller runs no test and
    # skips importing torch (~2.5 CPU s, before it starts its workers)
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        import torch
        torch.set_default_dtype(torch.float64)
    config.addinivalue_line("markers", "property: hypothesis property-based differential test "
                                       "(tests/test_property_*.py, docs/testing.md)")
    config.addinivalue_line("markers", "once: a test whose check depends on neither the rank count nor the "
                                       "BLAS kernels (a fresh interpreter of its own, a memory-leak count): "
                                       "scripts/test.sh runs it in its serial step only (docs/testing.md)")
    # the options travel to slasolve.testing.property_config through the environment, so a
    # plain `SLASOLVE_PROPERTY_FULL=1 pytest ...` and `pytest --property-full` do the same
    if config.getoption("--property-full"):
        os.environ["SLASOLVE_PROPERTY_FULL"] = "1"
    if config.getoption("--property-examples") is not None:
        os.environ["SLASOLVE_PROPERTY_EXAMPLES"] = str(config.getoption("--property-examples"))
    if config.getoption("--property-seed") is not None:
        os.environ["SLASOLVE_PROPERTY_SEED"] = str(config.getoption("--property-seed"))


def pytest_collection_modifyitems(config, items):
    # scripts/test.sh's serial step: the MPI tests of the files its kernels step runs again at one
    # rank (under other BLAS kernels) and its 2-rank step runs (the machine's kernels) are
    # deselected here (SLASOLVE_DESELECT_MPI_IN: space-separated path prefixes, docs/testing.md)
    prefixes = tuple(os.environ.get("SLASOLVE_DESELECT_MPI_IN", "").split())
    if prefixes:
        gone = [item for item in items
                if item.nodeid.startswith(prefixes) and item.get_closest_marker("mpi") is not None]
        if gone:
            dropped = set(map(id, gone))
            items[:] = [item for item in items if id(item) not in dropped]
            config.hook.pytest_deselected(items=gone)
    # tests marked `petsc` need petsc4py (a pip-only install has none: they skip, with the reason)
    marked = [item for item in items if item.get_closest_marker("petsc") is not None]
    if marked:
        from slasolve.krylov import default_backend
        if default_backend() != "petsc":
            skip = pytest.mark.skip(reason="needs petsc4py (not installed: torch backend only)")
            for item in marked:
                item.add_marker(skip)


@pytest.fixture
def comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


@pytest.fixture
def shared_dir(request):
    """Collective: a temporary directory made on rank 0 and broadcast, so every rank uses the same
    one (pytest's own tmp_path differs per rank, and its cleanup races between ranks); removed by
    rank 0 after a barrier at the end of the test."""
    import shutil
    import tempfile

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    prefix = f"slasolve_{request.module.__name__.rsplit('.', 1)[-1]}_"
    d = world.bcast(tempfile.mkdtemp(prefix=prefix) if world.rank == 0 else None, root=0)
    yield d
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(d, ignore_errors=True)
