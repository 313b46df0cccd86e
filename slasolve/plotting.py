"""Plots of solver results (matplotlib, imported only when a plot is made).

Local: call it on the rank that plots (``SolveInfo`` is identical on every rank).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

__all__ = ["plot_residual_history"]


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plot_residual_history needs matplotlib (pip install matplotlib)") from e
    return plt


def _histories(info, label):
    """``[(label, history)]`` of one SolveInfo (one line per right-hand side of a merged
    multi-column info), a plain sequence of norms, or an object with a ``residual_history``."""
    per_rhs = getattr(info, "per_rhs", None)
    if per_rhs:
        return [(f"{label} [{j}]" if label else f"column {j}", h) for j, i in enumerate(per_rhs)
                for _, h in _histories(i, None)]
    if hasattr(info, "residual_history"):
        hist = info.residual_history
        if hist is None:
            raise ValueError("this SolveInfo has no residual history: solve with record_history=True")
        if label is None:
            label = getattr(info, "method", "") or None
            if label and getattr(info, "pc", ""):
                label += f" + {info.pc}"
        return [(label, hist)]
    if isinstance(info, (list, tuple)) and all(isinstance(v, (int, float)) for v in info):
        return [(label, info)]
    raise TypeError(f"expected a SolveInfo (or a list of residual norms), got {type(info).__name__}")


def plot_residual_history(infos, ax=None, *, labels: Optional[Sequence[str]] = None, relative: bool = False,
                          rtol: Union[bool, float] = False, title: Optional[str] = None, **line_kwargs):
    """Local. Plot residual norm against iteration for one or several solves (log scale).

    Parameters
    ----------
    infos : SolveInfo, list of SolveInfo, or list of residual norms
        Results of :func:`slasolve.solve` with ``record_history=True``
        (``residual_history`` entry 0 is the initial residual). A SolveInfo of a
        multi-column solve draws one line per column.
    ax : matplotlib Axes, optional
        Where to draw; default a new figure's axes.
    labels : sequence of str, optional
        Legend entries, one per element of ``infos``; default ``method + pc``.
    relative : bool
        Divide each history by its initial residual.
    rtol : bool or float
        Draw the tolerance as a horizontal line: ``True`` uses ``info.rtol`` (relative
        plots) or ``info.rtol * ||r_0||`` (with ``x0 = 0``, the stopping threshold).
    title : str, optional
    **line_kwargs
        Passed to ``ax.semilogy``.

    Returns
    -------
    matplotlib.axes.Axes

    Raises ``ImportError`` without matplotlib, ``ValueError`` for an info without a
    recorded history.
    """
    is_one = hasattr(infos, "residual_history") or (
        isinstance(infos, (list, tuple)) and all(isinstance(v, (int, float)) for v in infos))
    items = [infos] if is_one else list(infos)
    if not items:
        raise ValueError("nothing to plot: infos is empty")
    if labels is not None and len(labels) != len(items):
        raise ValueError(f"labels: need one per info ({len(items)}), got {len(labels)}")
    lines = []
    for j, info in enumerate(items):
        lines.append((info, _histories(info, None if labels is None else labels[j])))
    plt = _pyplot()
    if ax is None:
        _, ax = plt.subplots()
    for info, hs in lines:
        for label, hist in hs:
            h = [float(v) for v in hist]
            if relative and h and h[0] > 0:
                h = [v / h[0] for v in h]
            (line,) = ax.semilogy(range(len(h)), h, label=label, **line_kwargs)
            tol = None
            if rtol is True and getattr(info, "rtol", 0.0) > 0:
                tol = info.rtol * (1.0 if relative or not h else h[0])
            elif rtol is not True and rtol:
                tol = float(rtol)
            if tol is not None:
                ax.axhline(tol, color=line.get_color(), linestyle=":", linewidth=1)
    ax.set_xlabel("iteration")
    ax.set_ylabel("relative residual norm" if relative else "residual norm")
    if title:
        ax.set_title(title)
    if any(label for _, hs in lines for label, _ in hs):
        ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    return ax
