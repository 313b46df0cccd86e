"""SciPy 1.10's own tests of cg/gmres/minres/bicgstab (``_isolve/tests/test_iterative.py``,
``test_minres.py``) run against :mod:`slasolve.linalg` (see ``slasolve_scipy_adapter``).

Serial: slasolve's functions called as SciPy's (one process). MPI: the same SciPy tests
with slasolve's functions bound to ``comm=COMM_WORLD`` (replicated mode: every rank
passes SciPy's full matrices and vectors, the matrix is distributed by rows, ``x`` comes
back in full on every rank); every rank runs SciPy's assertions.
"""
import pytest
from mpi4py import MPI

import slasolve_scipy_adapter as ad

# SciPy's conventions on matrices of a few dozen rows: at 1 and 2 ranks; the solvers' rank-count
# dependent parts run at 3, 4 and 8 ranks elsewhere (docs/testing.md)
pytestmark = pytest.mark.two_ranks

ITER = ad.as_params(ad.iterative_items())
MINRES = ad.as_params(ad.minres_items())


@pytest.mark.parametrize("test,args", ITER)
def test_scipy_iterative(test, args):
    ad.run_iterative(test, args, None)


@pytest.mark.parametrize("test,args", MINRES)
def test_scipy_minres(test, args):
    ad.run_minres(test, None)


@pytest.mark.mpi
@pytest.mark.parametrize("test,args", ITER)
def test_scipy_iterative_mpi(test, args):
    ad.run_iterative(test, args, MPI.COMM_WORLD)


@pytest.mark.mpi
@pytest.mark.parametrize("test,args", MINRES)
def test_scipy_minres_mpi(test, args):
    ad.run_minres(test, MPI.COMM_WORLD)


LINSOLVE = ad.as_params(ad.linsolve_items())


@pytest.mark.parametrize("test,args", LINSOLVE)
def test_scipy_linsolve(test, args):
    done = ad.run_linsolve(test, None)
    assert done == ("partial" if test.split(".")[1] in ad.LINSOLVE_PARTIAL else "full")


@pytest.mark.mpi
@pytest.mark.parametrize("test,args", LINSOLVE)
def test_scipy_linsolve_mpi(test, args):
    done = ad.run_linsolve(test, MPI.COMM_WORLD)
    assert done == ("partial" if test.split(".")[1] in ad.LINSOLVE_PARTIAL else "full")


ARPACK = ad.as_params(ad.arpack_items())


@pytest.mark.parametrize("test,args", ARPACK)
def test_scipy_arpack(test, args):
    ad.run_arpack(test, args, None)


@pytest.mark.mpi
@pytest.mark.parametrize("test,args", ARPACK)
def test_scipy_arpack_mpi(test, args):
    ad.run_arpack(test, args, MPI.COMM_WORLD)
