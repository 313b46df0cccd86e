"""A notebook user without petsc4py: slasolve imports, solves and differentiates on one rank."""
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys
    sys.modules["petsc4py"] = None      # make "import petsc4py" fail as if not installed
    sys.modules["slepc4py"] = None
    import numpy as np, scipy.sparse as sp, scipy.sparse.linalg as spla, torch
    import argparse, contextlib, io
    import slasolve
    from slasolve.krylov import default_backend
    assert "petsc4py.PETSc" not in sys.modules and "slepc4py.SLEPc" not in sys.modules
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=1)
    assert slasolve.parse_args(parser, ["--n", "3"]).n == 3
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            slasolve.parse_args(parser, ["-ksp_monitor"])
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError("PETSc options without petsc4py must be an error")
    assert "petsc4py is not installed" in err.getvalue(), err.getvalue()
    assert default_backend() == "torch", default_backend()
    n = 12
    D = sp.diags([-1, 2, -1], [-1, 0, 1], (n, n))
    A = (sp.kron(sp.identity(n), D) + sp.kron(D, sp.identity(n))).tocsr()
    S = slasolve.SparseTensor.from_scipy(A)
    v = S.values.clone().requires_grad_()
    b = torch.ones(n * n, dtype=torch.float64, requires_grad=True)
    for pc in (None, "jacobi", "ilu"):
        x, info = slasolve.cg(S.with_values(v), b, rtol=1e-10, pc=pc)
        assert info.backend == "torch" and info.converged
        assert np.allclose(x.detach().numpy(), spla.spsolve(A.tocsc(), np.ones(n * n)), atol=1e-8)
    x.sum().backward()
    assert b.grad is not None and v.grad is not None
    try:
        slasolve.solve(S, b.detach(), backend="petsc")
    except ImportError as e:
        assert "petsc4py" in str(e)
    else:
        raise AssertionError("backend='petsc' without petsc4py must raise ImportError")
    w, V = slasolve.eigsh(S, k=2, which="SA")          # native eigensolver
    assert np.allclose(np.sort(w.numpy()), np.sort(np.linalg.eigvalsh(A.toarray()))[:2], atol=1e-6)
    print("OK")
""")


def test_solve_without_petsc4py():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout
