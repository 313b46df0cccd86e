"""``slasolve.show_config()`` / ``python -m slasolve``: the report matches what is installed,
every preconditioner it lists solves, and broken installs (mpi4py that cannot load MPI,
petsc4py that cannot load PETSc, an mpiexec of another MPI) exit non-zero with the fix."""
import io
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import scipy
import scipy.sparse.linalg as spla
import torch
from mpi4py import MPI

import slasolve
from slasolve.testing import distribute, poisson_matrix

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMM = MPI.COMM_WORLD


def _run(args, tmp_path, pythonpath=(), env=None, timeout=120):
    """A fresh single-process interpreter (outside any mpirun), slasolve from this checkout
    first unless it is installed (the pip-only venv tests the installed copy)."""
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("OMPI_", "PMIX_", "PMI_", "HYDRA_", "MPI_LOCAL"))}
    e.update(OMP_NUM_THREADS="1", SLASOLVE_EXIT_TIMEOUT="0")
    paths = list(pythonpath) + ([] if "site-packages" in slasolve.__file__ else [ROOT])
    e["PYTHONPATH"] = os.pathsep.join(paths + [e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e.update(env or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=str(tmp_path), env=e)


def _petsc():
    if slasolve.krylov.default_backend() != "petsc":
        return None
    from petsc4py import PETSc
    return PETSc


# ---------------------------------------------------------------- the report is right
@pytest.mark.mpi
def test_show_config_matches_the_installed_packages():
    out = io.StringIO()
    info = slasolve.show_config(file=out)
    text = out.getvalue()
    v = info["versions"]
    assert v["torch"] == torch.__version__ and v["numpy"] == np.__version__ and v["scipy"] == scipy.__version__
    import mpi4py
    assert v["mpi4py"] == mpi4py.__version__
    assert info["slasolve"]["version"] == slasolve.__version__
    assert info["python"]["version"] == "%d.%d.%d" % sys.version_info[:3]
    mpi = info["mpi"]
    assert mpi["ok"] and mpi["size"] == COMM.Get_size() and mpi["rank"] == COMM.Get_rank()
    assert mpi["library"] == " ".join(MPI.Get_library_version().splitlines()[0].split())
    assert info["torch"]["cuda_available"] == torch.cuda.is_available()
    assert info["default_backend"] == slasolve.krylov.default_backend()
    assert info["backends"]["petsc"] == (_petsc() is not None) and info["backends"]["torch"]
    PETSc = _petsc()
    if PETSc is None:
        assert not info["petsc"]["ok"] and "petsc" not in info["preconditioners"]
        assert "PETSc:    not found" in text
    else:
        assert info["petsc"]["version"] == "%d.%d.%d" % PETSc.Sys.getVersion()
        assert info["petsc"]["external"] == [p for p in slasolve.config.PETSC_EXTERNAL
                                             if PETSc.Sys.hasExternalPackage(p)]
        assert ("hypre" in info["preconditioners"]["petsc"]) == PETSc.Sys.hasExternalPackage("hypre")
        assert f"PETSc:    {info['petsc']['version']}" in text
    assert ("slepc" in info["eigensolvers"]) == (slasolve.eigen.default_backend() == "slepc")
    for m, ver in info["optional"].items():
        try:
            __import__(m)
            assert ver is not None, m
        except ImportError:
            assert ver is None, m
    assert info["problems"] == [] and text.rstrip().endswith("status: OK"), text


@pytest.mark.mpi
def test_every_listed_preconditioner_solves():
    """Each (backend, pc) the report lists gives SciPy's answer on a distributed Poisson matrix
    (GMRES: PETSc's default ASM is restricted, not symmetric, and stalls CG at 3 ranks)."""
    info = slasolve.config.config_info()
    A = poisson_matrix((9, 8)).tocsr()
    dA = distribute(A, COMM)
    lo, hi = dA.row_range
    b_glob = np.linspace(1.0, 2.0, A.shape[0])
    ref = spla.spsolve(A.tocsc(), b_glob)[lo:hi]
    b = torch.as_tensor(b_glob[lo:hi])
    for backend, pcs in info["preconditioners"].items():
        for pc in pcs:
            pc_arg = (lambda r: r) if pc == "callable" else pc
            x, sinfo = slasolve.solve(dA, b, "gmres", backend=backend, pc=pc_arg, rtol=1e-11, maxiter=2000,
                                      return_info=True)
            err = COMM.allreduce(float(np.abs(x.numpy() - ref).max()), op=MPI.MAX)
            assert sinfo.backend == backend and err < 1e-7 * np.abs(ref).max(), (backend, pc, err)


@pytest.mark.mpi
def test_mpiexec_of_another_mpi_is_a_problem(monkeypatch):
    """An mpiexec that announced N processes while mpi4py's MPI sees another size (every
    process rank 0 of 1: the launcher of another MPI) is reported."""
    wrong = COMM.Get_size() + 1
    monkeypatch.setenv("PMI_SIZE", str(wrong))
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    problems = slasolve.config.config_info()["problems"]
    assert len(problems) == 1 and f"mpiexec for {wrong} processes" in problems[0], problems
    monkeypatch.setenv("PMI_SIZE", str(COMM.Get_size()))
    assert slasolve.config.config_info()["problems"] == []


# ---------------------------------------------------------------- python -m slasolve
def test_python_m_slasolve(tmp_path, capsys):
    """``python -m slasolve`` in a fresh interpreter (the entry point, the report, exit status 0);
    its ``--json`` option through the same ``main`` in this process (one fresh interpreter less:
    ~3.5 CPU s of imports; at one rank, as the fresh interpreter is)."""
    if COMM.Get_size() > 1:
        pytest.skip("starts its own single-process interpreter")
    out = _run(["-m", "slasolve"], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "status: OK" in out.stdout and f"torch      {torch.__version__}" in out.stdout
    from slasolve.__main__ import main
    capsys.readouterr()
    assert main(["--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["versions"]["numpy"] == np.__version__ and info["problems"] == []
    assert info["mpi"]["size"] == 1


def test_without_petsc4py(tmp_path):
    """A pip-only install: no petsc4py/slepc4py. The report says so, and it is no problem."""
    if COMM.Get_size() > 1:
        pytest.skip("starts its own single-process interpreters")
    script = textwrap.dedent("""
        import io, sys
        sys.modules["petsc4py"] = None
        sys.modules["slepc4py"] = None
        import slasolve
        from slasolve.__main__ import main
        info = slasolve.show_config(file=io.StringIO())
        assert info["problems"] == [], info["problems"]
        assert info["backends"] == {"petsc": False, "torch": True} and info["default_backend"] == "torch"
        assert list(info["preconditioners"]) == ["torch"], info["preconditioners"]
        assert info["eigensolvers"] == ["torch (lobpcg, lanczos)"]
        assert "SuperLU" in info["torch_ilu"]
        assert not info["petsc"]["found"] and not info["slepc"]["found"]
        sys.exit(main([]))
    """)
    out = _run(["-c", script], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PETSc:    not found" in out.stdout and "solve backends:   torch (default)" in out.stdout


def _fake_package(root, name, init, **modules):
    d = root / name
    d.mkdir(parents=True)
    (d / "__init__.py").write_text(textwrap.dedent(init))
    for mod, text in modules.items():
        (d / f"{mod}.py").write_text(textwrap.dedent(text))
    return str(root)


def test_mpi4py_that_cannot_load_mpi(tmp_path):
    """mpi4py installed, MPI library missing (what mpi4py>=4's wheels raise without one)."""
    if COMM.Get_size() > 1:
        pytest.skip("starts its own single-process interpreters")
    fake = _fake_package(tmp_path / "fake", "mpi4py", '__version__ = "4.1.2"\n', MPI="""
        raise RuntimeError("cannot load MPI library\\n"
                           "libmpi.so.12: cannot open shared object file: No such file or directory")
    """)
    out = _run(["-m", "slasolve"], tmp_path, pythonpath=[fake])
    assert out.returncode == 1, out.stdout + out.stderr
    assert "MPI:      BROKEN (RuntimeError: cannot load MPI library; libmpi.so.12" in out.stdout, out.stdout
    assert "PROBLEMS (1)" in out.stdout and 'slasolve[mpi]' in out.stdout
    assert "mpi4py     4.1.2" in out.stdout
    imp = _run(["-c", "import slasolve"], tmp_path, pythonpath=[fake])
    assert imp.returncode == 1 and "ImportError: import slasolve: mpi4py cannot load an MPI library" \
        in imp.stderr, imp.stderr


def test_petsc4py_that_fails_to_import(tmp_path):
    """petsc4py installed but its PETSc does not load: an error, not a silent torch fallback."""
    if COMM.Get_size() > 1:
        pytest.skip("starts its own single-process interpreters")
    fake = _fake_package(tmp_path / "fake", "petsc4py", """
        __version__ = "3.18.5"
        def init(args=None, **kw):
            pass
        def get_config():
            return {"PETSC_DIR": "/nonexistent", "PETSC_ARCH": ""}
    """, PETSc="""
        raise ImportError("libpetsc_real.so.3.18: cannot open shared object file: No such file or directory")
    """)
    out = _run(["-m", "slasolve"], tmp_path, pythonpath=[fake])
    assert out.returncode == 1, out.stdout + out.stderr
    assert "PETSc:    BROKEN (petsc4py installed, ImportError: libpetsc_real.so.3.18" in out.stdout, out.stdout
    assert "petsc4py is installed but fails to import" in out.stdout
    assert "MPI:      BROKEN" not in out.stdout and "petsc4py   3.18.5" in out.stdout
    imp = _run(["-c", "import slasolve"], tmp_path, pythonpath=[fake])
    assert imp.returncode == 1 and "ImportError: import slasolve: petsc4py/slepc4py is installed but " \
        "PETSc/SLEPc fails to load" in imp.stderr, imp.stderr
