"""Plot a training run's `metrics.jsonl` (written by `pf.metrics.RunMetrics`) to a PNG.

    python scripts/plot_run.py runs/lm/metrics.jsonl -o run.png
    python scripts/plot_run.py runs/lm -o run.png --smooth 20      # a run directory works too

Panels, each only when the run has it: every `*loss` scalar, tokens/s (else step time), MFU. `--smooth N`
averages each series logged at (nearly) every step over N steps; sparse ones (validation loss) are drawn as
points. Needs matplotlib (`pip install 'pt3func[metrics]'`).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a `metrics.jsonl` (or of `DIR/metrics.jsonl`) merged into one per step, in step order.

    `RunMetrics.log` adds rows to a step (a validation loss), and a resumed run appends to its file and repeats
    the steps after its checkpoint: the rows of a step are merged, a later value of a key winning.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if "step" in row:
                by_step.setdefault(int(row["step"]), {}).update(row)
    return [by_step[step] for step in sorted(by_step)]


def series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over the rows that have a finite value for it."""
    points = [(row["step"], float(row[key])) for row in rows if isinstance(row.get(key), (int, float))]
    points = [(s, v) for s, v in points if math.isfinite(v)]
    return [s for s, _ in points], [v for _, v in points]


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average over `window` points (1: unchanged)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(rows: Sequence[dict[str, Any]], out: str | Path, title: str | None = None, window: int = 1) -> Path:
    """Draw loss, throughput and MFU panels over steps into the PNG `out`."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    keys = {key for row in rows for key in row}
    panels: list[tuple[str, list[str], float]] = []
    losses = sorted(key for key in keys if key.endswith("loss"))
    if losses:
        panels.append(("loss", losses, 1.0))
    if "tokens_per_s" in keys:
        panels.append(("tokens/s", ["tokens_per_s"], 1.0))
    elif "step_time_s" in keys:
        panels.append(("step time (ms)", ["step_time_s"], 1e3))
    if "mfu" in keys:
        panels.append(("MFU (%)", ["mfu"], 100.0))
    if not panels:
        raise SystemExit("plot_run: no loss, tokens_per_s, step_time_s or mfu in the rows")

    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (label, names, scale) in zip(axes[:, 0], panels):
        for name in names:
            steps, values = series(rows, name)
            values = [v * scale for v in values]
            if len(steps) * 2 >= len(rows):
                ax.plot(steps, smooth(values, window), label=name, linewidth=1.2)
            else:  # logged now and then (a validation loss): averaging its few points would blur it
                ax.plot(steps, values, label=name, linewidth=1.2, marker="o", markersize=3)
        ax.set_ylabel(label)
        if label in ("tokens/s", "step time (ms)"):  # 1.5M, not 1.5 with a 1e6 offset; an MFU of 0.5% stays 0.5
            ax.yaxis.set_major_formatter(EngFormatter(sep=""))
        ax.grid(alpha=0.3)
        if len(names) > 1:
            ax.legend(loc="upper right", fontsize="small")
    axes[-1, 0].set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    if not out.suffix:  # matplotlib would add ".png" itself, and the path printed would be the wrong one
        out = out.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> Path:
    """Parse the flags, plot, print where the PNG went."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", help="a metrics.jsonl, or the run directory holding one")
    parser.add_argument("-o", "--out", default=None, help="PNG to write (default: beside the JSONL, run.png)")
    parser.add_argument("--smooth", type=int, default=1, help="moving-average window in steps")
    parser.add_argument("--title", default=None, help="figure title (default: the run directory's name)")
    args = parser.parse_args(argv)
    source = Path(args.metrics)
    run_dir = source if source.is_dir() else source.parent
    out = Path(args.out) if args.out else run_dir / "run.png"
    rows = load_rows(source)
    if not rows:
        raise SystemExit(f"plot_run: no step rows in {source}")
    path = plot(rows, out, title=args.title or run_dir.resolve().name, window=max(1, args.smooth))
    print(f"wrote {path} ({len(rows)} steps)")
    return path


if __name__ == "__main__":
    main()
