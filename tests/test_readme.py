"""README "A minute of slasolve" runs as written, at 1 and 2 ranks, and is right.

The python block under that heading is extracted from README.md, followed by checks
against SciPy/LAPACK references (computed here from scratch on every rank) and run
as a script: with plain ``python`` (one rank), under ``mpirun -n 2``, and on one rank
with petsc4py hidden (the native torch backend), each under a timeout. The tests themselves are serial (not marked mpi): each launches its own job.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIRUN = shutil.which("mpirun")

pytest.importorskip("pymetis")  # the snippet partitions with METIS


def readme_snippet() -> str:
    """The first ```python block after the '## A minute of slasolve' heading."""
    with open(os.path.join(ROOT, "README.md")) as fh:
        text = fh.read()
    head = text.index("## A minute of slasolve")
    m = re.compile(r"```python\n(.*?)```", re.S).search(text, head)
    assert m is not None, "no python block under '## A minute of slasolve'"
    nxt = text.find("\n## ", head + 1)
    assert nxt == -1 or m.start() < nxt, "the python block is not in the 'A minute' section"
    return m.group(1)


# Appended to the snippet: every rank checks its part against references computed
# here (SciPy spsolve, LAPACK eigh), then prints one line; the test counts them.
CHECKS = r'''
# ---------------------------------------------------------------- checks (tests/test_readme.py)
import numpy as _np, scipy.linalg as _la, scipy.sparse as _sp, scipy.sparse.linalg as _spla
_T = _sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n))
_A = (_sp.kron(_T, _sp.eye(n)) + _sp.kron(_sp.eye(n), _T)).tocsc()
_bg = _np.linspace(0.0, 1.0, n * n)
_x = _spla.spsolve(_A, _bg)
assert A.global_shape == (n * n, n * n)
# scatter/gather respect METIS' permutation
_perm = _np.asarray(A.spec.partition.perm)
_lo, _hi = A.row_range
assert _np.allclose(b.detach().numpy(), _bg[_perm][_lo:_hi], rtol=0, atol=1e-15), "scatter"
_y = A.gather(y, root=None).numpy()
assert _np.allclose(_y, _A @ _bg, rtol=0, atol=1e-12), "A @ b"
if comm.rank == 0:
    assert _np.abs(x_global.numpy() - _x).max() <= 1e-7 * _np.abs(_x).max(), "solve"
else:
    assert x_global is None
_xs = A.gather(x.detach(), root=None).numpy()
assert _np.abs(_xs - _x).max() <= 1e-7 * _np.abs(_x).max(), "solve (values requiring grad)"
# gradients of loss = ||x||^2: dL/db = A^{-T} 2x; dL/dA_ij = -(dL/db)_i x_j on the stored entries
_lam = _spla.spsolve(_A.T.tocsc(), 2 * _x)
assert abs(loss.item() - _x @ _x) <= 1e-8 * (_x @ _x), "loss"
_lam_p, _x_p = _lam[_perm], _x[_perm]
assert _np.allclose(b.grad.numpy(), _lam_p[_lo:_hi], rtol=1e-6, atol=1e-9 * _np.abs(_lam).max()), "b.grad"
_ip, _cols, _ = A.local_rows_csr()
_rows = _np.repeat(_np.arange(_lo, _hi), _np.diff(_ip.numpy()))
_g = -_lam_p[_rows] * _x_p[_cols.numpy()]
assert _np.allclose(A.values.grad.numpy(), _g, rtol=1e-6, atol=1e-9 * _np.abs(_g).max()), "A.values.grad"
# eigenvalues against LAPACK
_w = _la.eigh(_A.toarray(), eigvals_only=True)[:4]
assert _np.allclose(w.detach().numpy(), _w, rtol=1e-6, atol=1e-10), (w, _w)
# the scalable construction builds the same matrix and solves it
assert _np.abs(x2.numpy() - _x[lo:hi]).max() <= 1e-7 * _np.abs(_x).max(), "from_local_rows solve"
assert _np.allclose(b2.numpy(), _bg[lo:hi], rtol=0, atol=1e-15), "b2"
_y2 = A2 @ b2
assert _np.allclose(_y2.numpy(), (_A @ _bg)[lo:hi], rtol=0, atol=1e-12), "from_local_rows matvec"
print(f"README OK rank {comm.rank}/{comm.size}", flush=True)
'''


def _env():
    # a fresh job: drop this (possibly singleton-MPI) process's MPI variables
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "SLASOLVE_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_mpi_yield_when_idle="1",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return env


def _run(tmp_path, nranks: int, timeout: int = 180, prelude: str = "", epilogue: str = ""):
    script = tmp_path / "minute.py"
    script.write_text(prelude + readme_snippet() + CHECKS + epilogue)
    cmd = [sys.executable, str(script)]
    if nranks > 1:
        cmd = [MPIRUN, "--oversubscribe", "--bind-to", "none", "-n", str(nranks)] + cmd
    out = subprocess.run(["timeout", "-k", "5", str(timeout)] + cmd, capture_output=True, text=True,
                         env=_env(), cwd=tmp_path, timeout=timeout + 30)
    text = out.stdout + out.stderr
    assert out.returncode == 0, f"README snippet failed at {nranks} rank(s) (exit {out.returncode}):\n{text[-4000:]}"
    for r in range(nranks):
        assert f"README OK rank {r}/{nranks}" in text, text[-4000:]
    return text


def test_snippet_is_extracted():
    code = readme_snippet()
    compile(code, "README.md", "exec")
    for name in ("from_global", "scatter", "gather", "solve", "backward", "from_local_rows"):
        assert name in code, name


def test_readme_minute_one_rank(tmp_path):
    _run(tmp_path, 1)


@pytest.mark.skipif(MPIRUN is None, reason="needs mpirun")
def test_readme_minute_two_ranks(tmp_path):
    _run(tmp_path, 2)


# the pip-only path: "import petsc4py" fails as if not installed (tests/test_no_petsc.py)
NO_PETSC = """import sys
sys.modules["petsc4py"] = None
sys.modules["slepc4py"] = None
"""
TORCH_BACKEND = """
import slasolve.krylov
print("default backend:", slasolve.krylov.default_backend(), flush=True)
"""


def test_readme_minute_without_petsc(tmp_path):
    """Without petsc4py the same block runs on the native torch backend (README: notebooks, laptops)."""
    text = _run(tmp_path, 1, prelude=NO_PETSC, epilogue=TORCH_BACKEND)
    assert "default backend: torch" in text, text[-2000:]
