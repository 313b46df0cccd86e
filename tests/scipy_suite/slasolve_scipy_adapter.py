"""Run SciPy 1.10's own test cases against :mod:`slasolve.linalg`.

SciPy's test modules (installed with SciPy) are loaded as *fresh copies* whose
module globals ``cg``, ``gmres``, ``minres``, ``bicgstab`` (and ``spsolve``,
``eigsh`` in the direct/ARPACK modules) are replaced by slasolve's, optionally bound
to a communicator (``comm=COMM_WORLD``: the replicated mode, every rank passing the
same full ``A``/``b``). SciPy's case generator ``IterativeParams`` is rebuilt after
the patch so its skip lists name slasolve's functions, and SciPy's loop tests are
unrolled into one pytest item per (test, case, solver), so a case that cannot apply
is excluded individually, with its reason (:data:`EXCLUDED`).

Nothing of SciPy's test code is copied or edited: every assertion that runs is
SciPy's.
"""
from __future__ import annotations

import importlib.util
import os
import warnings

import numpy as np
import pytest
import scipy

import slasolve.linalg as L

SCIPY_DIR = os.path.dirname(scipy.__file__)
ISOLVE_TESTS = os.path.join(SCIPY_DIR, "sparse", "linalg", "_isolve", "tests")
OURS = ("cg", "gmres", "minres", "bicgstab", "cgs", "tfqmr")
NOT_PROVIDED = ("bicg", "qmr", "lgmres", "gcrotmk")

R_COMPLEX = "complex input: slasolve.linalg is real-only and raises TypeError (tested in test_linalg_scipy)"
R_SOLVER = "solver not provided by slasolve.linalg (SciPy only)"


DSOLVE_TESTS = os.path.join(SCIPY_DIR, "sparse", "linalg", "_dsolve", "tests")
ARPACK_TESTS = os.path.join(SCIPY_DIR, "sparse", "linalg", "_eigen", "arpack", "tests")
R_INTERNAL = "tests a SciPy-internal function (not part of the drop-in API)"
R_SLOW = "SciPy marks it slow and skips it without scikits.umfpack (a 250k-unknown 3-D problem)"
#: items whose SciPy test loops over real then complex dtypes: the real iterations run with
#: SciPy's assertions, the loop ends at the first complex input (slasolve raises TypeError)
PARTIAL = "real dtypes run; stops at the first complex input (TypeError by design)"


def _load(path: str, name: str):
    """A fresh copy of a SciPy test module (inside SciPy's package, so its relative
    imports work), not registered in sys.modules."""
    pkg = ("scipy.sparse.linalg._isolve.tests" if "_isolve" in path else
           "scipy.sparse.linalg._dsolve.tests" if "_dsolve" in path else
           "scipy.sparse.linalg._eigen.arpack.tests" if "arpack" in path else None)
    spec = importlib.util.spec_from_file_location(f"{pkg}.{name}" if pkg else name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


#: backend the suite runs with (None: slasolve's default, PETSc when petsc4py imports);
#: SLASOLVE_SCIPY_SUITE_BACKEND=torch runs it on the native kernels
BACKEND = os.environ.get("SLASOLVE_SCIPY_SUITE_BACKEND") or None


def bound(fn, comm):
    """``fn`` with ``comm=`` (and the suite's backend) bound, as a new function object."""
    def f(*args, **kw):
        if comm is not None:
            kw["comm"] = comm
        if BACKEND is not None:
            kw["backend"] = BACKEND
        return fn(*args, **kw)
    f.__name__ = fn.__name__
    return f


_CACHE: dict = {}


def iterative_module(comm=None):
    """SciPy's test_iterative with slasolve's solvers in its globals and a rebuilt
    ``params`` (skip lists naming slasolve's solvers)."""
    key = ("iterative", None if comm is None else id(comm))
    if key not in _CACHE:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = _load(os.path.join(ISOLVE_TESTS, "test_iterative.py"), "_slasolve_test_iterative")
        mod.scipy_solvers = {n: getattr(mod, n) for n in OURS + NOT_PROVIDED}
        for n in OURS:
            setattr(mod, n, bound(getattr(L, n), comm))
        mod.params = mod.IterativeParams()
        _CACHE[key] = mod
    return _CACHE[key]


def minres_module(comm=None):
    key = ("minres", None if comm is None else id(comm))
    if key not in _CACHE:
        mod = _load(os.path.join(ISOLVE_TESTS, "test_minres.py"), "_slasolve_test_minres")
        mod.minres = bound(L.minres, comm)
        _CACHE[key] = mod
    return _CACHE[key]


# ------------------------------------------------------------------------------------------------
# the items: (id, runner name, args, exclusion reason or None)

def _case_complex(case) -> bool:
    return np.iscomplexobj(case.A) or (hasattr(case.A, "dtype") and np.dtype(case.A.dtype).kind == "c")


def iterative_items():
    """Every item of SciPy's test_iterative, unrolled, with exclusions."""
    mod = iterative_module(None)   # the structure (cases, skips) is the same for every comm
    items = []
    solver_names = [s.__name__ for s in mod.params.solvers]

    def add(test, args, excl=None, ident=None):
        items.append((ident or f"{test}[{'-'.join(str(a) for a in args)}]", test, args, excl))

    # SciPy's loops over params.cases x params.solvers (same skips as SciPy's loops)
    for test, uses_nonconv in (("test_maxiter", True), ("test_convergence", False),
                               ("test_precond_dummy", True)):
        for ci, case in enumerate(mod.params.cases):
            for sname, solver in zip(solver_names, mod.params.solvers):
                skip = case.skip + (case.nonconvergence if uses_nonconv else [])
                if solver in skip:
                    continue     # SciPy's own skip: not an item in SciPy either
                excl = R_SOLVER if sname in NOT_PROVIDED else (R_COMPLEX if _case_complex(case) else None)
                add(test, (ci, case.name + ("-f32" if case.A.dtype.char in "fF" else ""), sname), excl)
    for cname in ("Poisson1D", "Poisson2D"):
        case = getattr(mod.params, cname)
        for sname, solver in zip(solver_names, mod.params.solvers):
            if solver in case.skip or sname == "qmr":
                continue
            add("test_precond_inverse", (cname, sname), R_SOLVER if sname in NOT_PROVIDED else None)
    for sname in ("lgmres", "minres", "gcrotmk", "tfqmr", "cg", "cgs", "bicg", "bicgstab", "gmres", "qmr"):
        add("test_reentrancy", (sname,), R_SOLVER if sname in NOT_PROVIDED else None)
    for test, names in (("test_atol", ("cg", "cgs", "bicg", "bicgstab", "gmres", "qmr", "lgmres", "gcrotmk")),
                        ("test_zero_rhs", ("cg", "cgs", "bicg", "bicgstab", "gmres", "qmr", "minres", "lgmres",
                                           "gcrotmk", "tfqmr")),
                        ("test_x0_working", ("cg", "cgs", "bicg", "bicgstab", "gmres", "qmr", "minres", "lgmres",
                                             "gcrotmk", "tfqmr")),
                        ("test_x0_equals_Mb", ("cg", "cgs", "bicg", "bicgstab", "gmres", "qmr", "minres", "lgmres",
                                               "gcrotmk"))):
        for sname in names:
            add(test, (sname,), R_SOLVER if sname in NOT_PROVIDED else None)
    for sname in ("gmres", "qmr", "lgmres", "cgs", "bicg", "bicgstab", "gcrotmk", "tfqmr"):
        add("test_maxiter_worsening", (sname,), R_COMPLEX if sname in OURS else R_SOLVER)
    add("test_show", ("tfqmr",), "show=True prints slasolve's SolveInfo summary, not SciPy's exact sentence")
    add("TestQMR.test_leftright_precond", (), R_SOLVER)
    for m in ("test_basic", "test_callback", "test_abi", "test_atol_legacy", "test_defective_precond_breakdown",
              "test_defective_matrix_breakdown", "test_callback_type", "test_callback_x_monotonic",
              "test_restrt_dep"):
        excl = R_COMPLEX if m == "test_abi" else None
        if m == "test_defective_precond_breakdown":
            excl = ("asserts M A x == M b with atol=0 where M b has a zero entry, i.e. the last bit of x[0] "
                    "(SciPy's GMRES: 0; slasolve's: 0 or 1.1e-16 depending on the CPU's kernels); the same "
                    "case to rounding in tests/test_linalg_scipy.py::test_gmres_defective_precond_scipy_case")
        if m == "test_callback":
            excl = ("known difference: slasolve's GMRES is right-preconditioned; the pr_norm/legacy callback "
                    "reports ||b - A x||/||b||, SciPy's left-preconditioned GMRES ||M r||/||b||; both halves "
                    "are checked in tests/test_linalg_scipy.py::test_gmres_callback_scipy_case")
        add(f"TestGMRES.{m}", (), excl)
    return items


def minres_items():
    mod = minres_module(None)
    return [(f"test_minres.{n}", n, (), None) for n in sorted(dir(mod))
            if n.startswith("test_") and callable(getattr(mod, n))]


def run_iterative(test, args, comm):
    """Run one unrolled item with SciPy's own check functions / tests."""
    mod = iterative_module(comm)
    sup_msg = ".*called without specifying.*"
    with np.testing.suppress_warnings() as sup:
        sup.filter(DeprecationWarning, sup_msg)
        if test in ("test_maxiter", "test_convergence", "test_precond_dummy"):
            ci, _, sname = args
            check = {"test_maxiter": mod.check_maxiter, "test_convergence": mod.check_convergence,
                     "test_precond_dummy": mod.check_precond_dummy}[test]
            check(getattr(mod, sname), mod.params.cases[ci])
        elif test == "test_precond_inverse":
            cname, sname = args
            mod.check_precond_inverse(getattr(mod, sname), getattr(mod.params, cname))
        elif test == "test_reentrancy":
            # slasolve's solvers keep no global state: reentrant (SciPy's Fortran-backed
            # cg/bicgstab/gmres raise RuntimeError), so SciPy's reentrant branch applies
            mod._check_reentrancy(getattr(mod, args[0]), True)
        elif test == "test_x0_equals_Mb":
            # SciPy's test loops over params.cases itself: the complex cases are left out
            # of its list for this call (R_COMPLEX), the real ones all run
            saved = mod.params.cases
            mod.params.cases = [c for c in saved if not _case_complex(c)]
            try:
                mod.test_x0_equals_Mb(getattr(mod, args[0]))
            finally:
                mod.params.cases = saved
        elif test.startswith("TestGMRES."):
            getattr(mod.TestGMRES(), test.split(".", 1)[1])()
        else:
            getattr(mod, test)(getattr(mod, args[0]))


def run_minres(name, comm):
    mod = minres_module(comm)
    with np.testing.suppress_warnings() as sup:
        sup.filter(DeprecationWarning, ".*called without specifying.*")
        getattr(mod, name)()


def as_params(items):
    out = []
    for ident, test, args, excl in items:
        marks = []
        if excl is not None:
            marks.append(pytest.mark.skip(reason=f"excluded: {excl}"))
        out.append(pytest.param(test, args, marks=marks, id=ident.replace(" ", "_")))
    return out


# ------------------------------------------------------------------------------------------------
# spsolve: _dsolve/tests/test_linsolve.py

def linsolve_module(comm=None):
    key = ("linsolve", None if comm is None else id(comm))
    if key not in _CACHE:
        mod = _load(os.path.join(DSOLVE_TESTS, "test_linsolve.py"), "_slasolve_test_linsolve")
        mod.spsolve = bound(L.spsolve, comm)
        _CACHE[key] = mod
    return _CACHE[key]


LINSOLVE_PARTIAL = ("test_twodiags", "test_dtype_cast")


def linsolve_items():
    mod = linsolve_module(None)
    items = []
    for cls in ("TestLinsolve", "TestFactorized", "TestSplu", "TestSpsolveTriangular"):
        for m in sorted(n for n in dir(getattr(mod, cls)) if n.startswith("test_")):
            excl = None
            if cls != "TestLinsolve":
                excl = R_SOLVER + f" ({cls}: factorized/splu/spilu/spsolve_triangular)"
            elif m == "test_gssv_badinput":
                excl = R_INTERNAL + " (_superlu.gssv)"
            elif m == "test_bug_8278":
                excl = R_SLOW
            items.append((f"{cls}.{m}", f"{cls}.{m}", (), excl))
    return items


def _complex_refusal(e) -> bool:
    return isinstance(e, TypeError) and "complex" in str(e) and "not supported" in str(e)


def run_linsolve(name, comm):
    mod = linsolve_module(comm)
    cls, m = name.split(".")
    obj = getattr(mod, cls)()
    if hasattr(obj, "setup_method"):
        obj.setup_method()
    fn = getattr(type(obj), m)
    fn = getattr(fn, "__wrapped__", fn)  # SciPy's @sup_sparse_efficiency decorator
    with np.testing.suppress_warnings() as sup:
        sup.filter(mod.SparseEfficiencyWarning)
        try:
            fn(obj)
        except TypeError as e:
            if m in LINSOLVE_PARTIAL and _complex_refusal(e):
                return "partial"
            raise
    return "full"


# ------------------------------------------------------------------------------------------------
# eigsh: _eigen/arpack/tests/test_arpack.py

R_EIGS = "uses eigs (nonsymmetric ARPACK), not provided by slasolve.linalg"
R_LINOP_EIG = "matrix-free eigsh (LinearOperator A) is not provided: slasolve.linalg.eigsh raises TypeError"
R_MODE = "mode='buckling'/'cayley' not provided (shift-invert mode='normal' only): ValueError"
R_SIGMA_WHICH = "sigma with which != 'LM' not provided (slasolve: the eigenvalues nearest sigma): ValueError"


def arpack_module(comm=None):
    key = ("arpack", None if comm is None else id(comm))
    if key not in _CACHE:
        mod = _load(os.path.join(ARPACK_TESTS, "test_arpack.py"), "_slasolve_test_arpack")
        mod.eigsh = bound(L.eigsh, comm)
        mod.sym_params = mod.SymmetricParams()
        _CACHE[key] = mod
    return _CACHE[key]


def arpack_items():
    mod = arpack_module(None)
    P = mod.sym_params
    items = []
    for di, D in enumerate(P.real_test_cases):
        for typ in "fd":
            for which in P.which:
                for mattype in P.mattypes:
                    for sigma, modes in P.sigmas_modes.items():
                        for mode in modes:
                            excl = None
                            if mattype is mod.aslinearoperator:
                                excl = R_LINOP_EIG
                            elif mode != "normal":
                                excl = R_MODE
                            elif sigma is not None and which != "LM":
                                excl = R_SIGMA_WHICH
                            ident = f"test_symmetric_modes[{D.name}-{typ}-{which}-{mattype.__name__}-{sigma}-{mode}]"
                            items.append((ident, "test_symmetric_modes", (di, typ, which, mattype.__name__,
                                                                          sigma, mode), excl))
    for name in ("test_hermitian_modes", "test_symmetric_starting_vector", "test_symmetric_no_convergence",
                 "test_real_nonsymmetric_modes", "test_complex_nonsymmetric_modes",
                 "test_standard_nonsymmetric_starting_vector", "test_general_nonsymmetric_starting_vector",
                 "test_standard_nonsymmetric_no_convergence", "test_eigen_bad_shapes", "test_eigen_bad_kwargs",
                 "test_ticket_1459_arpack_crash", "test_linearoperator_deallocation", "test_parallel_threads",
                 "test_reentering", "test_regression_arpackng_1315", "test_eigs_for_k_greater",
                 "test_eigsh_for_k_greater", "test_real_eigs_real_k_subset"):
        excl = None
        if name == "test_hermitian_modes":
            excl = R_COMPLEX
        elif name == "test_linearoperator_deallocation":
            excl = R_INTERNAL + " (arpack.SpLuInv, IterInv, ...)"
        elif name in ("test_parallel_threads", "test_reentering") or "nonsymmetric" in name or "eigs_" in name \
                or name in ("test_eigen_bad_shapes", "test_eigen_bad_kwargs", "test_ticket_1459_arpack_crash",
                            "test_regression_arpackng_1315"):
            excl = R_EIGS
        items.append((name, name, (), excl))
    return items


def run_arpack(test, args, comm):
    mod = arpack_module(comm)
    if test == "test_symmetric_modes":
        di, typ, which, mname, sigma, mode = args
        mattype = {"csr_matrix": mod.csr_matrix, "aslinearoperator": mod.aslinearoperator,
                   "asarray": np.asarray}[mname]
        mod.eval_evec(True, mod.sym_params.real_test_cases[di], typ, 2, which, None, sigma, mattype, None, mode)
    else:
        getattr(mod, test)()
