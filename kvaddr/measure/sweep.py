"""``kvaddr sweep``: what each strategy saves per step, against batch size.

A sweep is a ``kvaddr profile`` run over a list of batch sizes; this module
turns its JSON report (docs/json-schema.md) into series, one per strategy and
panel, of the time saved per step against the per-layer baseline (the
difference of the medians), and draws them in the terminal with rich. Panels:
eager mode (host wall time, what a Python serving loop pays) and graph mode
(GPU time of CUDA-graph replays); the CPU path has the eager panel only.
:mod:`kvaddr.measure.plot` draws the same series with matplotlib.
"""

from __future__ import annotations

import math

from kvaddr.constants import SAVINGS_REFERENCE
from kvaddr.measure.report import count, format_us, measure_label

#: Panels in drawing order: (mode, clock).
PANELS = (("eager", "host"), ("graph", "gpu"))
#: Width of the longest bar of the terminal chart, in characters.
BAR_WIDTH = 40
_PARTIAL = " ▏▎▍▌▋▊▉"


def panels(doc: dict) -> list:
    """The sweep's series, from a ``kvaddr profile`` JSON report.

    Returns
    -------
    list of dict
        One per panel present in the report: ``mode``, ``clock``, ``label``,
        ``batches`` (sorted), ``baseline_us`` (per-layer median per batch),
        ``series`` (``{strategy: [saved us per batch]}``, None where missing)
        and ``verdicts`` (``{strategy: [verdict per batch]}``).
    """
    device = (doc.get("environment") or {}).get("device", "cpu")
    shapes = sorted(doc.get("shapes", []), key=lambda s: s["batch"])
    out = []
    for mode, clock in PANELS:
        rows = {
            s["batch"]: {r["strategy"]: r for r in s["results"] if r["mode"] == mode and r["clock"] == clock}
            for s in shapes
        }
        rows = {b: r for b, r in rows.items() if r}
        if not rows:
            continue
        batches = sorted(rows)
        names = []
        for r in rows.values():
            for name, x in r.items():
                if name not in names and x.get("vs_per_layer") and name != SAVINGS_REFERENCE:
                    names.append(name)
        series = {n: [] for n in names}
        verdicts = {n: [] for n in names}
        baseline = []
        for b in batches:
            base = rows[b].get(SAVINGS_REFERENCE)
            baseline.append(base["summary"]["median"] if base else None)
            for n in names:
                v = (rows[b].get(n) or {}).get("vs_per_layer")
                series[n].append(None if v is None else v["saved_us"])
                verdicts[n].append(None if v is None else v["verdict"])
        out.append(
            {
                "mode": mode,
                "clock": clock,
                "label": measure_label(mode, clock, device),
                "batches": batches,
                "baseline_us": baseline,
                "series": series,
                "verdicts": verdicts,
            }
        )
    return out


def title(doc: dict) -> str:
    """'NVIDIA H200' (or 'CPU (NumPy), <processor>'), model, layers x caches and B."""
    env = doc.get("environment") or {}
    gpu = env.get("gpu") or {}
    where = (
        gpu.get("name")
        if env.get("device") == "cuda" and gpu.get("name")
        else f"CPU (NumPy), {env.get('cpu') or 'unknown processor'}"
    )
    w = doc.get("workload") or {}
    sizes = ", ".join(str(b) for b in dict.fromkeys(w.get("block_sizes", [])))
    extra = ""
    if w.get("spec_tokens"):
        extra += f", {w['spec_tokens']} speculative token(s)"
    if w.get("prefill"):
        extra += f", {w['prefill']['requests']} prefill chunk(s) of {w['prefill']['tokens']}"
    return (
        f"{where}: {w.get('model', '?')}, {count(w.get('num_layers', '?'), 'layer')} x "
        f"{count(w.get('num_caches', '?'), 'cache')} (B = {sizes}){extra}"
    )


def sweep_json(doc: dict) -> dict:
    """The ``sweep`` object added to the profile report by ``kvaddr sweep --json``."""
    return {"title": title(doc), "baseline": SAVINGS_REFERENCE, "unit": "us_per_step_saved", "panels": panels(doc)}


def _bar(value: float, top: float) -> str:
    if top <= 0 or value is None or value <= 0 or not math.isfinite(value):
        return ""
    cells = value / top * BAR_WIDTH
    full = int(cells)
    frac = int((cells - full) * 8)
    return "█" * full + (_PARTIAL[frac] if frac else "")


def render_chart(console, doc: dict) -> None:
    """A terminal bar chart of each panel: saved us per step, per batch size and strategy."""
    from rich.table import Table

    console.print(
        f"saved per step against batch size, vs {SAVINGS_REFERENCE}: {title(doc)}", style="bold", soft_wrap=True
    )
    for p in panels(doc):
        values = [v for s in p["series"].values() for v in s if v is not None]
        top = max(values + [0.0])
        table = Table(
            box=None,
            padding=(0, 1),
            pad_edge=False,
            show_edge=False,
            header_style="bold",
            title=p["label"],
            title_justify="left",
            title_style="bold",
        )
        table.add_column("batch", justify="right")
        table.add_column("strategy", justify="left")
        table.add_column("saved", justify="right")
        table.add_column(f"of {SAVINGS_REFERENCE}", justify="right")
        table.add_column("", justify="left", no_wrap=True)
        for i, b in enumerate(p["batches"]):
            base = p["baseline_us"][i]
            for j, (name, s) in enumerate(p["series"].items()):
                v, verdict = s[i], p["verdicts"][name][i]
                if v is None:
                    cells = ["-", "", ""]
                elif verdict == "within noise":
                    cells = ["within noise", "", ""]
                else:
                    pct = f"{100 * v / base:.0f}%" if base else ""
                    cells = [format_us(v), pct, _bar(v, top) if v > 0 else "(slower)"]
                table.add_row(str(b) if j == 0 else "", name, *cells)
        console.print(table)
        console.print()
