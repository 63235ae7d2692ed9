"""The sweep plot (``kvaddr sweep --plot PATH``), drawn with matplotlib.

matplotlib is an optional dependency (``pip install 'kvaddr[plot]'``); without
it :func:`plot_sweep` raises :class:`PlotUnavailable`. The figure is built
with matplotlib's object API and the Agg canvas, so no GUI backend or global
pyplot state is touched.
"""

from __future__ import annotations

from kvaddr.constants import SAVINGS_REFERENCE
from kvaddr.errors import PlotUnavailable
from kvaddr.measure.sweep import panels, title

INSTALL_HINT = "pip install 'kvaddr[plot]'"
#: Legend labels.
LABELS = {
    "per-layer-kernel": "per-layer-kernel (one slot kernel per layer and cache)",
    "hoisted": "hoisted (FastDeploy PR #7367)",
    "one-block": "one-block (FastDeploy after PR #7367, <= 1024 requests)",
    "fused": "fused (kvaddr, one launch)",
    "fused (bound)": "fused, bound once (StepPlanner.bind, eager only)",
}
#: Strategy colours and markers (stable across plots).
STYLE = {
    "per-layer-kernel": ("#1f77b4", "s"),
    "hoisted": ("#ff7f0e", "^"),
    "one-block": ("#9467bd", "D"),
    "fused": ("#2ca02c", "o"),
    "fused (bound)": ("#17becf", "v"),
}


def matplotlib_version() -> str | None:
    """matplotlib's version, or None when it cannot be imported."""
    try:
        import matplotlib
    except Exception:
        return None
    return str(getattr(matplotlib, "__version__", "unknown"))


def plot_sweep(doc: dict, path: str, dpi: int = 150):
    """Write the sweep plot of a ``kvaddr profile`` report to ``path`` (PNG, or any format matplotlib knows).

    One panel per mode (eager: host wall time; graph: GPU time), saved
    microseconds per step against batch size (log2 axis), one line per
    strategy; the per-layer time itself is drawn dashed (the most any
    strategy can save). Differences within noise are drawn as hollow markers.

    Returns
    -------
    matplotlib.figure.Figure
        The figure written (for tests: its axes, labels and lines).

    Raises
    ------
    PlotUnavailable
        matplotlib is missing.
    ValueError
        The report holds no results to plot.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    except Exception as exc:
        raise PlotUnavailable(
            f"--plot needs matplotlib, which is not installed ({type(exc).__name__}); install it with: {INSTALL_HINT}"
        ) from exc
    ps = panels(doc)
    if not ps:
        raise ValueError("the profile report holds no eager or graph results to plot")
    fig = Figure(figsize=(6.4 * len(ps), 5.4 if len(ps) == 1 else 4.9), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(ps), squeeze=False)[0]
    for ax, p in zip(axes, ps):
        xs = p["batches"]
        positive = True
        for name, ys in p["series"].items():
            color, marker = STYLE.get(name, (None, "o"))
            pts = [(x, y, v) for x, y, v in zip(xs, ys, p["verdicts"][name]) if y is not None]
            if not pts:
                continue
            positive &= all(y > 0 for _, y, _ in pts)
            (line,) = ax.plot(
                [x for x, _, _ in pts], [y for _, y, _ in pts], marker=marker, color=color, label=LABELS.get(name, name)
            )
            noisy = [(x, y) for x, y, v in pts if v == "within noise"]
            if noisy:
                ax.plot(
                    [x for x, _ in noisy],
                    [y for _, y in noisy],
                    linestyle="none",
                    marker=marker,
                    markerfacecolor="white",
                    markeredgecolor=line.get_color(),
                )
        base = [(x, y) for x, y in zip(xs, p["baseline_us"]) if y is not None]
        if base:
            ax.plot(
                [x for x, _ in base],
                [y for _, y in base],
                linestyle="--",
                color="0.5",
                label=f"{SAVINGS_REFERENCE}'s own time per step (the most one can save)",
            )
            positive &= all(y > 0 for _, y in base)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(xs))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.xaxis.set_minor_locator(NullLocator())
        if positive:
            ax.set_yscale("log")
        else:  # a saving below zero (slower than per-layer): draw where zero is
            ax.axhline(0, color="0.2", linewidth=0.8, zorder=1)
        ax.set_xlabel("batch size (requests per step)")
        ax.set_ylabel(f"saved per step vs {SAVINGS_REFERENCE} (µs)")
        ax.set_title(p["label"], fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if any(p["verdicts"][n][i] == "within noise" for p in ps for n in p["verdicts"] for i in range(len(p["batches"]))):
        from matplotlib.lines import Line2D

        handles.append(Line2D([], [], linestyle="none", marker="o", markerfacecolor="white", markeredgecolor="0.3"))
        labels.append("hollow: within noise (IQRs overlap)")
    fig.legend(handles, labels, loc="outside lower center", ncols=2 if len(ps) > 1 else 1, fontsize=8, frameon=False)
    fig.suptitle(f"kvaddr: KV-cache addressing time saved per step, vs {SAVINGS_REFERENCE}\n{title(doc)}", fontsize=10)
    fig.savefig(path, dpi=dpi)
    return fig
