"""PNG plots the benchmarks write beside their ``--json`` figures (``docs/benchmarks.md``).

Each function draws one figure with matplotlib's file-only backend (no display needed) and
writes it to ``path``: a CDF of latencies, rates per round per configuration, or curves of a
metric along the stream per learner.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def _save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cdf(path: str, samples: Mapping[str, Sequence[float]], xlabel: str,
             title: str) -> None:
    """Empirical CDFs, one line per name (log x axis when the values span > 100x).

    Args:
        path: the PNG to write.
        samples: name -> values.
        xlabel: x axis label.
        title: figure title.
    """
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    spread = []
    for name, values in samples.items():
        v = np.sort(np.asarray(values, dtype=np.float64))
        if not len(v):
            continue
        spread += [v[0], v[-1]]
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=f"{name} (n={len(v)})")
    positive = [x for x in spread if x > 0]
    if positive and max(positive) / min(positive) > 100:
        ax.set_xscale("log")
    for q in (0.5, 0.99):
        ax.axhline(q, color="#bbb", lw=0.8, ls="--")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction ≤ x")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_rounds(path: str, per_round: Mapping[str, Sequence[float]], ylabel: str,
                title: str) -> None:
    """One line per configuration over the rounds of a benchmark (noise shows as spread).

    Args:
        path: the PNG to write.
        per_round: configuration -> value per round.
        ylabel: y axis label.
        title: figure title.
    """
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, values in per_round.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", label=name)
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_curves(path: str, x: Sequence[float], curves: Mapping[str, Sequence[float]],
                xlabel: str, ylabel: str, title: str) -> None:
    """One line per learner of a metric along the stream.

    Args:
        path: the PNG to write.
        x: the common x positions.
        curves: learner -> value at each x (None / NaN: no value there).
        xlabel: x axis label.
        ylabel: y axis label.
        title: figure title.
    """
    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    for name, values in curves.items():
        y = np.asarray([np.nan if v is None else v for v in values], dtype=np.float64)
        ax.plot(x[:len(y)], y, label=name, lw=1.4)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)


def plot_scale(path: str, rows: Sequence[int], seconds: Mapping[str, Sequence[float]],
               gigabytes: Mapping[str, Sequence[float]], title: str) -> None:
    """Costs against a table's rows, log-log: seconds in one panel, sizes in the other.

    Args:
        path: the PNG to write.
        rows: the table sizes (x).
        seconds: stage -> seconds at each size.
        gigabytes: what -> GB at each size.
        title: figure title.
    """
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 4.0))
    for ax, series, ylabel in ((left, seconds, "seconds"), (right, gigabytes, "GB")):
        for name, values in series.items():
            ax.plot(rows[:len(values)], values, marker="o", label=name, lw=1.4)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("table rows")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(title)
    _save(fig, path)
