"""Command lines and the kind of session: which tokens are PETSc's, ``parse_args``.

Local; imports nothing of MPI or PETSc at module level.
"""
from __future__ import annotations

import builtins
import sys

__all__ = ["interactive", "petsc_key", "petsc_argv", "session_petsc_argv", "split_petsc_args", "parse_args"]


def interactive() -> bool:
    """Local. Jupyter / IPython kernels, ``python -i`` and the REPL: an exception must not kill
    the session, and the end of the session is no synchronisation point."""
    return (hasattr(builtins, "__IPYTHON__") or "ipykernel" in sys.modules or bool(sys.flags.interactive)
            or hasattr(sys, "ps1"))


def petsc_key(token: str) -> bool:
    """Local. PETSc's rule (PetscOptionsValidKey): ``-`` or ``--`` followed by a letter."""
    t = token[2:] if token.startswith("--") else token[1:] if token.startswith("-") else ""
    return bool(t) and t[0].isalpha()


def petsc_argv(argv) -> list:
    """Local. The part of a command line ``argv`` that PETSc gets: everything but GNU-style
    ``--long`` options (the script's own, e.g. ``--n 8``, ``--version``) and their value.

    PETSc would take ``--n 8`` as its option ``-n``; dropping a ``--long`` token together with
    the non-option token after it keeps PETSc's reading of every single-dash option (a
    value always follows its option directly) unchanged."""
    argv = list(argv)
    out, i = argv[:1], 1
    while i < len(argv):
        tok = argv[i]
        i += 1
        if tok.startswith("--"):
            if "=" not in tok and i < len(argv) and not petsc_key(argv[i]):
                i += 1
            continue
        out.append(tok)
    return out


def session_petsc_argv() -> list:
    """Local. What PETSc gets of this session's command line."""
    # a Jupyter kernel's argv (-f kernel.json) is the kernel's, not the user's
    if interactive() or not getattr(sys, "argv", None):
        return [sys.executable]
    return petsc_argv(sys.argv)


def split_petsc_args(args, option_strings=()) -> tuple:
    """Local. Split command-line ``args`` into ``(petsc, rest)``.

    A PETSc option is a single-dash token of more than one letter (``-ksp_monitor``,
    ``-pc_type``, ``-log_view``, ``-help``) that is not one of ``option_strings`` (the
    script's own options); as in PETSc, the next token is its value unless it is
    itself an option (negative numbers are values). Everything else is ``rest``.
    """
    own = set(option_strings)
    petsc, rest, i = [], [], 0
    args = list(args)
    while i < len(args):
        tok = args[i]
        name = tok.split("=", 1)[0]
        if (tok.startswith("-") and not tok.startswith("--") and len(name) > 2 and petsc_key(tok)
                and name not in own):
            petsc.append(tok)
            if i + 1 < len(args) and not petsc_key(args[i + 1]) and args[i + 1] != "--":
                petsc.append(args[i + 1])
                i += 1
        else:
            rest.append(tok)
        i += 1
    return petsc, rest


def parse_args(parser, argv=None):
    """Local. ``parser.parse_args`` that lets PETSc options through.

    Single-dash options such as ``-ksp_monitor -ksp_type gmres -log_view`` are left to
    PETSc (which ``import slasolve`` initialised with ``sys.argv``); anything else the
    ``argparse`` ``parser`` does not know is an error (``parser.error``: exit status 2,
    with a hint that PETSc options take one dash). When ``argv`` is given explicitly
    (not read from ``sys.argv``), its PETSc options are put into PETSc's options
    database, as the command line would. Without petsc4py, PETSc options are an error.
    """
    explicit = argv is not None
    args = list(sys.argv[1:] if argv is None else argv)
    own = [s for a in parser._actions for s in a.option_strings]
    petsc, rest = split_petsc_args(args, own)
    ns, unknown = parser.parse_known_args(rest)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} "
                     f"(PETSc options take a single dash, e.g. -ksp_monitor)")
    if petsc:
        try:
            from petsc4py import PETSc
        except ImportError:
            parser.error(f"PETSc options {' '.join(petsc)} given, but petsc4py is not installed")
        if explicit:
            import shlex
            PETSc.Options().insertString(" ".join(shlex.quote(a) for a in petsc))
    return ns
