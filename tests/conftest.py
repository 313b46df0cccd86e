
import pytest
import torch

torch.set_default_dtype(torch.float64)


@pytest.fixture
def comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD
