"""Benchmark: distributed FEM assembly vs DOLFINx and scikit-fem, and the phases of one FEM solve.

    python bench/fem.py                          # ~1M triangles (n = 708 -> 1,002,528 cells)
    mpirun -n 2 python bench/fem.py --json fem_2.json

Measured in the same run:

* slasolve: parallel box mesh, ``Assembler`` setup (pattern, nonzero halo plan),
  and assembly of the stiffness matrix with per-cell coefficients (element
  matrices + ``index_add`` + reverse halo + ``with_values``; minimum of
  ``--repeat`` runs, the slowest rank's time). Also the assembly with the
  coefficients requiring grad plus one backward pass.
* scikit-fem (rank 0 only, one process): ``asm(laplace, Basis(mesh, ElementTriP1()))``
  of the same mesh (same points and triangles), and a check that both matrices agree.
* one full manufactured Poisson solve (``fem.manufactured_solve``, CG + GAMG): time per phase.

* DOLFINx (optional; Debian/Ubuntu ``apt-get install -y python3-dolfinx``, built on the same
  PETSc 3.18; skipped with a message when it does not import): the same mesh handed to
  ``dolfinx.mesh.create_mesh``, P1 Poisson (``--n``) and 3-D P1 linear elasticity
  (``--elasticity-n``): load vectors (constant and nodal ``f``) and the re-assembly of the
  stiffness with a new per-cell (DG0) coefficient, the two libraries alternated in one run
  (best of ``--repeat``, slowest rank); Frobenius norms and sums of the matrices and load
  vectors are compared (equal discrete answers).

Needs scikit-fem (``pip install scikit-fem``; the ``bench`` extra).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

try:
    import slasolve  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np
import scipy.sparse as sp
import torch
from mpi4py import MPI

from slasolve.fem import Assembler, box_mesh
from slasolve.fem.problems import manufactured_solve


def timed(comm, fn, repeat=1):
    """Minimum over ``repeat`` runs of the slowest rank's wall time; returns (seconds, last result)."""
    best, out = float("inf"), None
    for _ in range(repeat):
        comm.Barrier()
        t0 = time.perf_counter()
        out = fn()
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        best = min(best, dt)
    return best, out


def bench_slasolve(comm, n, repeat):
    res = {}
    res["mesh"], mesh = timed(comm, lambda: box_mesh(n, cell="triangle", comm=comm))
    res["setup"], V = timed(comm, lambda: Assembler(mesh))
    g = torch.Generator().manual_seed(0)
    kappa = 1.0 + torch.rand(mesh.n_local_cells, generator=g, dtype=torch.float64)
    V.stiffness(kappa)  # warm-up (first-call overheads)
    res["assemble"], A = timed(comm, lambda: V.stiffness(kappa), repeat)

    def with_grad():
        k = kappa.clone().requires_grad_()
        B = V.stiffness(k)
        B.values.sum().backward()
        return k.grad

    res["assemble+backward"], _ = timed(comm, with_grad, repeat)
    res["n_cells"] = mesh.n_global_cells
    res["n_nodes"] = mesh.n_global_nodes
    res["nnz"] = comm.allreduce(V.nnz)
    res["remote_nnz_per_rank_max"] = comm.allreduce(V.n_remote, op=MPI.MAX)
    return res, A, kappa


def bench_skfem(n, kappa_global, repeat):
    from skfem import Basis, ElementTriP1, MeshTri, asm
    from skfem.models.poisson import laplace
    from skfem.helpers import dot, grad
    from skfem import BilinearForm

    ref = box_mesh(n, cell="triangle", comm=MPI.COMM_SELF)
    pts = ref.node_coords.numpy().T.copy()
    tri = ref.cells.numpy().T.copy()
    res = {}
    t0 = time.perf_counter()
    m = MeshTri(pts, tri)
    basis = Basis(m, ElementTriP1())
    res["setup"] = time.perf_counter() - t0

    @BilinearForm
    def kgrad(u, v, w):
        return w["kappa"] * dot(grad(u), grad(v))

    kq = np.repeat(kappa_global[:, None], basis.X.shape[1], axis=1)
    best = float("inf")
    A = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        A = asm(kgrad, basis, kappa=kq)
        best = min(best, time.perf_counter() - t0)
    res["assemble"] = best
    best_c = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        asm(laplace, basis)
        best_c = min(best_c, time.perf_counter() - t0)
    res["assemble_constant_kappa"] = best_c
    return res, A.tocsr()


# --------------------------------------------------------------------------- DOLFINx
def duel(comm, fa, fb, repeat, first=None, name=None):
    """Alternate ``fa``/``fb`` (A, B, B, A, ...) ``repeat`` times; best slowest-rank time of each.
    The time of ``fa``'s first call (which builds the cached geometry) goes to ``first[name]``."""
    ta = tb = float("inf")
    for i in range(repeat):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            t, _ = timed(comm, fa if which == 0 else fb)
            if which == 0:
                if i == 0 and first is not None:
                    first[name] = t
                ta = min(ta, t)
            else:
                tb = min(tb, t)
    return ta, tb


def _rel(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


def bench_vs_dolfinx(comm, problem, n, repeat):
    """slasolve vs DOLFINx on the *same* mesh (slasolve's box_mesh handed to
    ``dolfinx.mesh.create_mesh``): load vectors and the re-assembly of the stiffness with a new
    per-cell coefficient, timed alternately in one run; norms and sums compared."""
    import dolfinx
    import dolfinx.fem.petsc  # noqa: F401
    import ufl
    from dolfinx import fem
    from petsc4py import PETSc
    from slasolve import global_sum

    tri = problem == "poisson2d"
    cell = "triangle" if tri else "tetra"
    res = {"problem": problem, "n": n}
    res["mesh"], mesh = timed(comm, lambda: box_mesh(n, cell=cell, comm=comm))
    bs = 1 if tri else 3
    res["setup"], V = timed(comm, lambda: Assembler(mesh, bs))
    res["n_cells"], res["dofs"] = mesh.n_global_cells, V.n_global_dofs

    # the same mesh in DOLFINx: our owned node coordinates are contiguous in rank order,
    # exactly the chunked input DOLFINx's create_mesh reads
    def dmesh():
        domain = ufl.Mesh(ufl.VectorElement("Lagrange", ufl.triangle if tri else ufl.tetrahedron, 1))
        return dolfinx.mesh.create_mesh(comm, mesh.cells.numpy().astype(np.int64),
                                        mesh.owned_node_coords().numpy(), domain)
    res["dolfinx_mesh"], msh = timed(comm, dmesh)

    kfun = (lambda x: 1.0 + x[0] + x[1] ** 2) if tri else (lambda x: 1.0 + x[2] + x[0] * x[1])
    ffun = (lambda x: 1.0 + x[0] * x[1]) if tri else (lambda x: 1.0 + x[0] * x[1] * x[2])
    nu = 0.3

    def dsetup():
        Vd = fem.FunctionSpace(msh, ("Lagrange", 1)) if tri else fem.VectorFunctionSpace(msh, ("Lagrange", 1))
        Q = fem.FunctionSpace(msh, ("DG", 0))
        k = fem.Function(Q)
        k.interpolate(lambda x: kfun(x))
        fn = fem.Function(Vd)
        u, v = ufl.TrialFunction(Vd), ufl.TestFunction(Vd)
        if tri:
            fn.interpolate(lambda x: ffun(x))
            a = fem.form(k * ufl.inner(ufl.grad(u), ufl.grad(v)) * ufl.dx)
            Lc = fem.form(fem.Constant(msh, PETSc.ScalarType(1.0)) * v * ufl.dx)
            Lf = fem.form(fn * v * ufl.dx)
        else:
            fn.interpolate(lambda x: np.stack([ffun(x), 0 * x[0], 0 * x[0]]))
            eps = lambda w: ufl.sym(ufl.grad(w))  # noqa: E731
            lam, mu = k * nu / ((1 + nu) * (1 - 2 * nu)), k / (2 * (1 + nu))
            sig = lambda w: 2 * mu * eps(w) + lam * ufl.tr(eps(w)) * ufl.Identity(3)  # noqa: E731
            a = fem.form(ufl.inner(sig(u), eps(v)) * ufl.dx)
            Lc = fem.form(ufl.inner(fem.Constant(msh, PETSc.ScalarType((0.0, 0.0, -1.0))), v) * ufl.dx)
            Lf = fem.form(ufl.inner(fn, v) * ufl.dx)
        A = fem.petsc.create_matrix(a)
        b = fem.petsc.create_vector(Lc)
        return Vd, k, fn, a, Lc, Lf, A, b
    res["dolfinx_setup_incl_jit"], (Vd, k, fn, a, Lc, Lf, A, b) = timed(comm, dsetup)

    def dload(L):
        with b.localForm() as bl:
            bl.set(0.0)
        fem.petsc.assemble_vector(b, L)
        b.ghostUpdate(addv=PETSc.InsertMode.ADD, mode=PETSc.ScatterMode.REVERSE)
        return b

    step = [0]
    k0 = k.x.array.copy()

    def dstiff():
        step[0] += 1
        k.x.array[:] = k0 * (1.0 + 1e-3 * step[0])   # a new per-cell coefficient each call
        A.zeroEntries()
        fem.petsc.assemble_matrix(A, a)
        A.assemble()
        return A

    # slasolve: the same coefficient and data
    kap0 = kfun(V.cell_coords.mean(1).T)
    zero = torch.zeros(V.n_owned_nodes)
    fo = V.interpolate(lambda x: ffun(x.T)) if tri else \
        torch.stack([ffun(V.owned_coords().T), zero, zero], 1).reshape(-1)
    const = 1.0 if tri else torch.tensor([0.0, 0.0, -1.0])
    sstep = [0]

    def sstiff():
        sstep[0] += 1
        kap = kap0 * (1.0 + 1e-3 * sstep[0])
        return V.stiffness(kap) if tri else V.elasticity(kap, nu)

    def sstiff_petsc():
        return sstiff().to_petsc()

    sl, dl, first = {}, {}, {}
    for q, fa, fb in (("load (constant f)", lambda: V.load(const), lambda: dload(Lc)),
                      ("load (nodal f)", lambda: V.load(fo), lambda: dload(Lf)),
                      ("stiffness, new per-cell coef", sstiff, dstiff)):
        sl[q], dl[q] = duel(comm, fa, fb, repeat, first, q)
    sl["stiffness + to_petsc refill"], _ = duel(comm, sstiff_petsc, lambda: None, repeat)
    res["slasolve"], res["dolfinx"], res["slasolve_first_call"] = sl, dl, first

    # ---- equal discrete answers: same coefficient (reset both), norms and sums
    sstep[0] = step[0] = 0
    As = sstiff()
    Ad = dstiff()
    checks = {}
    vals = As.values.detach()
    checks["matrix frobenius"] = (float(global_sum(vals.square().sum())) ** 0.5, Ad.norm(PETSc.NormType.FROBENIUS))
    y = Ad.createVecLeft()
    Ad.mult(fn.vector, y)       # energy f^T A f of the interpolated nodal f: permutation-invariant
    checks["f^T A f"] = (float(global_sum(fo @ (As @ fo))), fn.vector.dot(y))
    for name, sv, L in (("load (constant f)", V.load(const), Lc), ("load (nodal f)", V.load(fo), Lf)):
        bd = dload(L)
        checks[name + " sum"] = (float(global_sum(sv.sum())), bd.sum())
        checks[name + " 2-norm"] = (float(global_sum(sv.square().sum())) ** 0.5, bd.norm())
    res["checks"] = {k_: {"slasolve": a_, "dolfinx": b_, "rel_diff": _rel(a_, b_)} for k_, (a_, b_) in checks.items()}
    res["max_rel_diff"] = max(c["rel_diff"] for c in res["checks"].values())
    # f^T A f of a smooth f is a small difference of large terms: relative rounding ~1e-11 at 1M cells
    res["equal"] = bool(res["max_rel_diff"] < 1e-9)
    return res


def print_dolfinx(say, r, size):
    say(f"\n{r['problem']}: slasolve vs DOLFINx {__import__('dolfinx').__version__} on the same mesh, "
        f"{r['n_cells']:,} cells, {r['dofs']:,} dofs, {size} rank(s) (best of the alternated runs, slowest rank)")
    say(f"{'quantity':<34}{'slasolve [s]':>14}{'DOLFINx [s]':>14}{'ratio':>8}")
    for q, ts in r["slasolve"].items():
        td = r["dolfinx"].get(q)
        fc = r["slasolve_first_call"].get(q)
        say(f"{q:<34}{ts:14.4f}" + (f"{td:14.4f}{ts / td:8.2f}" if td else f"{'':22}")
            + (f"   (slasolve's first call {fc:.3f} s: builds the cached geometry)" if fc else ""))
    say(f"{'mesh / setup':<34}{r['mesh']:7.2f} +{r['setup']:5.2f}{r['dolfinx_mesh']:7.2f} +"
        f"{r['dolfinx_setup_incl_jit']:5.2f}  (DOLFINx setup: spaces, forms (JIT, cached), sparsity)")
    say(("equal discrete answers" if r["equal"] else "MISMATCH (> 1e-9) between slasolve and DOLFINx")
        + f": max relative difference {r['max_rel_diff']:.1e} over " + ", ".join(r["checks"]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=708, help="cells per side (2 n^2 triangles; 708 -> ~1M)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--solve-n", type=int, default=None, help="n of the full solve (default: --n)")
    p.add_argument("--no-skfem", action="store_true")
    p.add_argument("--no-solve", action="store_true")
    p.add_argument("--no-dolfinx", action="store_true", help="skip the DOLFINx comparison")
    p.add_argument("--dolfinx-only", action="store_true", help="only the DOLFINx comparison")
    p.add_argument("--elasticity-n", type=int, default=40,
                   help="cells per side of the 3-D elasticity cube (6 n^3 tetrahedra; 0: skip)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (DOLFINx uses one)")
    p.add_argument("--json", default=None, help="write the results to this JSON file (rank 0)")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_default_dtype(torch.float64)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    per_node = local.Get_size()
    local.Free()
    torch.set_num_threads(args.threads)
    if per_node > 1 and torch.get_num_threads() * per_node > (os.cpu_count() or 1):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))  # no oversubscription
    say = print if rank == 0 else (lambda *a, **k: None)
    out = {"ranks": size, "n": args.n, "torch_threads": torch.get_num_threads(),
           "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__}

    if not args.no_dolfinx:
        try:
            import dolfinx  # noqa: F401
            ok = True
        except ImportError as e:
            ok = False
            say(f"DOLFINx not available ({e}); skipped. Debian/Ubuntu: apt-get install -y python3-dolfinx")
        if comm.allreduce(int(ok), op=MPI.MIN):
            out["dolfinx"] = [bench_vs_dolfinx(comm, "poisson2d", args.n, args.repeat)]
            print_dolfinx(say, out["dolfinx"][-1], size)
            if args.elasticity_n:
                out["dolfinx"].append(bench_vs_dolfinx(comm, "elasticity3d", args.elasticity_n, args.repeat))
                print_dolfinx(say, out["dolfinx"][-1], size)
    mismatch = any(not r["equal"] for r in out.get("dolfinx", []))
    if args.dolfinx_only:
        if args.json and rank == 0:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=2)
        return int(mismatch)
    mine, A, kappa = bench_slasolve(comm, args.n, args.repeat)
    out["slasolve"] = mine
    kappa_all = comm.gather(kappa.numpy(), root=0)
    loc = comm.gather(A.local.to_scipy("csr"), root=0)
    if not args.no_skfem:
        err = None
        if rank == 0:
            try:
                sk, S = bench_skfem(args.n, np.concatenate(kappa_all), args.repeat)
                G = sp.vstack(loc).tocsr()
                diff = abs(G - S).max()
                sk["max_abs_diff_vs_slasolve"] = float(diff)
                out["skfem"] = sk
            except ImportError as e:
                err = f"scikit-fem not available ({e}); pip install scikit-fem"
        err = comm.bcast(err, root=0)
        if err:
            say(err)
    if not args.no_solve:
        r = manufactured_solve("poisson", args.solve_n or args.n, 2, "triangle", comm, pc="gamg", rtol=1e-8)
        out["solve"] = {"n": r.n, "dofs": r.n_dofs, "iterations": r.iterations, "error_l2": r.error_l2,
                        "times": r.timings, "total": sum(r.timings.values())}

    # ---- table
    say(f"\nP1 Poisson stiffness, {mine['n_cells']:,} triangles, {mine['n_nodes']:,} nodes, "
        f"nnz {mine['nnz']:,}; {size} rank(s), {out['torch_threads']} torch thread(s) per rank")
    say(f"{'phase':<28}{'slasolve [s]':>14}{'scikit-fem 1 rank [s]':>24}")
    sk = out.get("skfem", {})
    rows = [("mesh", mine["mesh"], None), ("setup (pattern + halo)", mine["setup"], sk.get("setup")),
            ("assemble (per-cell kappa)", mine["assemble"], sk.get("assemble")),
            ("assemble + backward", mine["assemble+backward"], None),
            ("assemble (constant kappa)", None, sk.get("assemble_constant_kappa"))]
    for name, a, b in rows:
        fa = f"{a:14.3f}" if a is not None else f"{'':>14}"
        fb = f"{b:24.3f}" if b is not None else f"{'':>24}"
        say(f"{name:<28}{fa}{fb}")
    if sk:
        say(f"speed-up of the assembly vs scikit-fem: {sk['assemble'] / mine['assemble']:.1f}x; "
            f"max |A_slasolve - A_skfem| = {sk['max_abs_diff_vs_slasolve']:.2e}")
    if "solve" in out:
        s = out["solve"]
        say(f"\nfull fem_solve run (Poisson, n = {s['n']}, {s['dofs']:,} dofs, CG + GAMG, "
            f"{s['iterations']} iterations, L2 error {s['error_l2']:.3e}):")
        for k, v in s["times"].items():
            say(f"  {k:<10}{v:8.3f} s  ({100 * v / s['total']:5.1f} %)")
        say(f"  {'total':<10}{s['total']:8.3f} s")
    if args.json and rank == 0:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
        say(f"wrote {args.json}")
    return int(mismatch)


if __name__ == "__main__":
    sys.exit(main())  # import slasolve already aborts the job on an unhandled exception
