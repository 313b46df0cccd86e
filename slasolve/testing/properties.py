"""Property-based tests under MPI (hypothesis driven by rank 0, every rank checking the same
examples) and the reference checks they use (docs/testing.md)."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

__all__ = ["property_config", "collective_property", "eig_selection_error", "residual_bound_ok"]


# -- reference checks ---------------------------------------------------------------

_WHICH_KEYS = {
    "LA": lambda w, s: -w,
    "SA": lambda w, s: w,
    "LM": lambda w, s: -np.abs(w),
    "SM": lambda w, s: np.abs(w),
}


def eig_selection_error(w, reference, k: int, which: str = "LM", sigma: Optional[float] = None) -> float:
    """Local. How far ``w`` (``k`` computed eigenvalues) is from a valid answer of
    ``eigsh(k, which, sigma)`` for a problem whose full spectrum (with multiplicity) is
    ``reference``: the largest of (a) the distance of the selection keys (``-w`` for
    "LA", ``|w|`` for "SM", ``|w - sigma|`` with ``sigma``, ...) from the ``k`` best
    keys of ``reference`` and (b) the distance of each ``w`` from a distinct reference
    eigenvalue (greedy matching, so a dropped copy of a repeated eigenvalue counts).
    Ties at the selection boundary are therefore accepted either way."""
    w = np.sort(np.asarray(w, dtype=float).ravel())
    ref = np.asarray(reference, dtype=float).ravel()
    if w.size != k:
        return float("inf")
    key = (lambda v: np.abs(v - sigma)) if sigma is not None else (lambda v: _WHICH_KEYS[which](v, None))
    best = np.sort(key(ref))[:k]
    err = float(np.max(np.abs(np.sort(key(w)) - best)))
    free = np.ones(ref.size, dtype=bool)
    for v in w:  # k <= a few dozen: a loop over the computed values only
        d = np.where(free, np.abs(ref - v), np.inf)
        j = int(np.argmin(d))
        free[j] = False
        err = max(err, float(d[j]))
    return err


def residual_bound_ok(A, b, x, rtol: float, atol: float, slack: float = 1.05) -> tuple:
    """Local. ``(ok, ||b - A x||, bound)`` for SciPy's criterion
    ``||b - A x|| <= max(rtol ||b||, atol)``, with a relative ``slack`` and a
    round-off allowance ``100 eps ||A||_1 ||x||`` (the Krylov recurrences track an
    updated, not the true, residual)."""
    r = float(np.linalg.norm(b - A @ x))
    an = float(abs(A).sum(axis=0).max()) if A.shape[0] else 0.0
    bound = slack * max(rtol * float(np.linalg.norm(b)), atol) \
        + 100 * np.finfo(float).eps * an * float(np.linalg.norm(x))
    return r <= bound, r, bound


# -- collective property-based tests (hypothesis under MPI) ---------------------------

def property_config() -> dict:
    """Local. The property-test settings from the environment (docs/testing.md):
    ``SLASOLVE_PROPERTY_FULL=1`` (many examples, shrinking on), ``SLASOLVE_PROPERTY_EXAMPLES``
    (override the number of examples of every property), ``SLASOLVE_PROPERTY_SEED``
    (an int, default 0: the CI slice is the same on every run; ``random``: a fresh seed,
    printed) and ``SLASOLVE_PROPERTY_SHRINK`` (0/1, default: on in full mode only)."""
    import os
    full = os.environ.get("SLASOLVE_PROPERTY_FULL", "0") not in ("", "0", "false", "no")
    ex = os.environ.get("SLASOLVE_PROPERTY_EXAMPLES", "")
    seed = os.environ.get("SLASOLVE_PROPERTY_SEED", "0")
    shrink = os.environ.get("SLASOLVE_PROPERTY_SHRINK", "1" if full else "0")
    return {"full": full, "examples": int(ex) if ex.strip() else None,
            "seed": seed.strip() or "0", "shrink": shrink not in ("", "0", "false", "no")}


def _describe(e: BaseException) -> str:
    import traceback
    tb = traceback.extract_tb(e.__traceback__)
    where = "".join(traceback.format_list(tb[-3:])) if tb else ""
    notes = "\n".join(getattr(e, "__notes__", []) or [])
    return f"{type(e).__name__}: {e}\n{where}{notes}".rstrip()


def _run_collective_example(comm, example, check) -> Optional[str]:
    """Collective. Run ``check(example)`` on every rank; the combined verdict (None
    or the failing ranks' messages) is identical on every rank."""
    err = None
    try:
        check(example)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # any failure on any rank (pytest.fail/raises too) fails it on every rank
        err = _describe(e)
    errs = comm.allgather(err) if comm.Get_size() > 1 else [err]
    bad = [(r, m) for r, m in enumerate(errs) if m is not None]
    if not bad:
        return None
    return "\n".join(f"[rank {r}] {m}" for r, m in bad)


def spsolve_reference(A, b, comm):
    """Collective. SciPy's ``spsolve`` on the gathered system ``A x = b`` (``A`` a row-shard
    :class:`~slasolve.DSparseTensor`, scalar or block; ``b`` this rank's rows): this rank's rows of
    ``x``, as a float64 tensor. A reference for small test systems (every rank holds the whole
    matrix)."""
    import scipy.sparse as sp
    import scipy.sparse.linalg as spla
    import torch
    loc = A.local.scalar() if A.local.is_block else A.local
    n = A.global_shape[0] * (A.local.block_shape[0] if A.local.is_block else 1)
    part = sp.csr_matrix((loc.values.detach().numpy(), loc.indices.numpy(), loc.indptr.numpy()),
                         shape=(loc.indptr.numel() - 1, n))
    Ag = sp.vstack(comm.allgather(part)).tocsc()
    bg = np.concatenate(comm.allgather(b.detach().numpy()))
    d0 = sum(comm.allgather(b.numel())[:comm.rank])
    return torch.from_numpy(spla.spsolve(Ag, bg)[d0:d0 + b.numel()])


def on_root(comm, fn):
    """Collective. ``fn()`` called on rank 0 only and its result broadcast to every rank.

    For a reference that every rank would otherwise compute alike (a one-rank solve on
    ``MPI.COMM_SELF``, a dense LAPACK call): past the cores, ``P`` copies of it compete for
    them. An exception on rank 0 is raised on every rank (as ``AssertionError`` naming it
    elsewhere), so no rank waits in the broadcast while rank 0 raises.
    """
    out = err = None
    if comm.Get_rank() == 0:
        try:
            out = fn()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # re-raised below, on every rank
            err = e
    if comm.Get_size() > 1:
        out, msg = comm.bcast((out, None if err is None else _describe(err)), root=0)
        if msg is not None and err is None:
            raise AssertionError(f"the reference computed on rank 0 failed: {msg}")
    if err is not None:
        raise err
    return out


def collective_property(comm, strategy, check, *, name: str, examples: int = 8,
                        full_examples: int = 200, explicit: Sequence = ()) -> None:
    """Collective. Property-based test of ``check`` over ``strategy`` on every rank of
    ``comm``, with hypothesis driven by rank 0 only.

    Rank 0 runs hypothesis and broadcasts each example (a small picklable value, e.g. a
    dict of ints and names) before every rank runs ``check(example)``; any exception on
    any rank fails that example on every rank (one ``allgather``), so rank 0's
    hypothesis sees the outcome of the whole communicator and shrinks it. The other
    ranks just follow the broadcasts until rank 0 says stop, then raise rank 0's
    failure. Hypothesis' own run is *not* reproducible across processes after a
    failure (its engine stops searching and shrinking on wall-clock limits), which is
    why ranks never run it independently.

    Parameters
    ----------
    comm : MPI.Comm
    strategy : hypothesis strategy producing the examples
    check : callable(example), collective; raises (e.g. ``AssertionError``) on failure
    name : str
        Seeds the (deterministic) generation: every property draws its own sequence.
    examples, full_examples : int
        Examples in the CI slice and with ``SLASOLVE_PROPERTY_FULL=1``
        (``SLASOLVE_PROPERTY_EXAMPLES`` overrides both).
    explicit : sequence
        Examples always run first (known regressions), as hypothesis' ``@example``.
    """
    cfg = property_config()
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank != 0:
        _follow(comm, check)
        return
    n = cfg["examples"] if cfg["examples"] is not None else (full_examples if cfg["full"] else examples)
    final = None
    try:
        _drive(comm, strategy, check, name, n, cfg, explicit)
    except BaseException as e:
        final = _describe(e)
        raise
    finally:
        if size > 1:
            comm.bcast(("stop", final), root=0)


def _follow(comm, check) -> None:
    while True:
        kind, payload = comm.bcast(None, root=0)
        if kind == "stop":
            break
        _run_collective_example(comm, payload, check)
    if payload is not None:
        raise AssertionError(f"property failed (as reported by rank 0):\n{payload}")


def _drive(comm, strategy, check, name, n, cfg, explicit) -> None:
    import hashlib
    from hypothesis import HealthCheck, Phase, Verbosity, example, given, seed, settings
    if cfg["seed"] == "random":
        s = int(np.random.SeedSequence().entropy % (2 ** 62))
        print(f"\n[{name}] SLASOLVE_PROPERTY_SEED={s}", flush=True)
    else:
        s = int(cfg["seed"])
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if cfg["shrink"] else [])

    def run_one(ex):
        if comm.Get_size() > 1:
            comm.bcast(("example", ex), root=0)
        msg = _run_collective_example(comm, ex, check)
        if msg is not None:
            raise AssertionError(msg)

    import re
    run_one.__name__ = run_one.__qualname__ = "property_" + re.sub(r"\W", "_", name)
    test = given(strategy)(run_one)
    for ex in reversed(list(explicit)):
        test = example(ex)(test)
    test = settings(max_examples=max(int(n), 1), derandomize=False, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck), phases=phases,
                    report_multiple_bugs=False, verbosity=Verbosity.normal,
                    print_blob=False)(test)
    digest = hashlib.blake2b(f"{name}:{s}".encode(), digest_size=8).digest()
    test = seed(int.from_bytes(digest, "little") >> 2)(test)
    test()
