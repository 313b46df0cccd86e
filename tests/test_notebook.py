"""examples/notebook.ipynb runs top to bottom in a fresh kernel (serial; not an MPI test).

The kernel is this interpreter's own (``python3`` spec pointed at ``sys.executable``), so the
notebook sees the same environment as the tests; matplotlib draws with the Agg backend.
"""
import json
import os
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "examples", "notebook.ipynb")


def _own_kernelspec(root) -> str:
    """A ``python3`` kernelspec that runs this interpreter; returns the directory to put first
    on ``JUPYTER_PATH`` (which wins over user / environment / system kernelspecs)."""
    d = os.path.join(str(root), "jupyter")
    k = os.path.join(d, "kernels", "python3")
    os.makedirs(k, exist_ok=True)
    with open(os.path.join(k, "kernel.json"), "w") as fh:
        json.dump({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                   "display_name": "Python 3 (slasolve tests)", "language": "python"}, fh)
    return d


@pytest.mark.timeout(300)
def test_notebook_executes(tmp_path, monkeypatch):
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("the notebook is a single-rank workflow")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    # a kernel started from inside an mpirun'd/singleton MPI process must not inherit its MPI state
    for k in list(os.environ):
        if k.startswith(("OMPI_COMM_WORLD", "PMIX_", "OMPI_MCA_orte_ess", "OMPI_FILE_LOCATION")):
            monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("JUPYTER_PATH", _own_kernelspec(tmp_path) + os.pathsep + os.environ.get("JUPYTER_PATH", ""))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=240, kernel_name="python3", allow_errors=False,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()   # raises CellExecutionError if any cell fails
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "converged=True" in text and "finite difference" in text
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure was produced"
