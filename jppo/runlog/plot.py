"""PNG plots of a run's ``metrics.jsonl``: ``python -m jppo.plot RUN_DIR`` writes them into ``RUN_DIR/plots/``.

Figures (each written only when at least one of its metrics is in the file):

- ``reward.png``: ``reward/mean``, with ``reward/min`` .. ``reward/max`` shaded;
- ``losses.png``: ``actor/pg_loss``, ``critic/vf_loss``, ``actor/entropy``, ``actor/kl_loss``, one panel each
  (their scales differ by orders of magnitude);
- ``kl.png``: ``actor/ppo_kl`` (policy vs. rollout policy) and ``actor/kl_loss`` (policy vs. reference);
- ``response_length.png``: ``response_length/mean`` with ``/min`` .. ``/max`` shaded;
- ``validation.png``: ``val/reward/mean`` and ``val/accuracy`` on the held-out prompts, from step 0 when the run
  validated before training (``trainer.val_before_train``);
- ``sft.png`` (``python -m jppo.sft``): the training and held-out ``-log p`` per loss token, ``sft/nll`` and
  ``val/sft_nll`` (its held-out greedy score, when its rows are a task's, is in ``validation.png``);
- ``summary.png``: a grid of reward, response length, the losses and KL.

Missing metrics are skipped; ``null`` values (NaN/inf at log time) leave gaps. Figures are drawn on matplotlib's
Agg canvas directly, so importing this module changes no global matplotlib state (no pyplot, no backend switch).
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
from etils.epath import Path
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from jppo.core.paths import run_path
from jppo.runlog import METRICS_FILE, read_metrics

PLOTS_DIR = "plots"
_PANEL_INCHES = (5.0, 3.2)
_MARKERS_BELOW = 30  # steps; with fewer points, markers keep single points and short runs visible


@dataclasses.dataclass(frozen=True)
class Chart:
    """One panel: ``lines`` drawn against the step, the area between ``band`` = (low, high) shaded."""

    title: str
    ylabel: str
    lines: tuple[str, ...]
    band: tuple[str, str] | None = None

    def metrics(self) -> tuple[str, ...]:
        return self.lines + (self.band or ())


CHARTS: dict[str, Chart] = {
    "reward": Chart("Reward", "reward", ("reward/mean",), band=("reward/min", "reward/max")),
    "response_length": Chart(
        "Response length", "tokens", ("response_length/mean",), band=("response_length/min", "response_length/max")
    ),
    "pg_loss": Chart("Policy loss", "actor/pg_loss", ("actor/pg_loss",)),
    "vf_loss": Chart("Value loss", "critic/vf_loss", ("critic/vf_loss",)),
    "entropy": Chart("Entropy", "actor/entropy", ("actor/entropy",)),
    "kl_loss": Chart("KL loss (to reference)", "actor/kl_loss", ("actor/kl_loss",)),
    "kl": Chart("KL divergence", "KL", ("actor/ppo_kl", "actor/kl_loss")),
    "validation": Chart("Validation (held-out prompts)", "reward", ("val/reward/mean", "val/accuracy")),
    "sft_nll": Chart("SFT: -log p per loss token", "nll", ("sft/nll", "val/sft_nll")),
}

FIGURES: dict[str, tuple[str, ...]] = {
    "reward.png": ("reward",),
    "losses.png": ("pg_loss", "vf_loss", "entropy", "kl_loss"),
    "kl.png": ("kl",),
    "response_length.png": ("response_length",),
    "validation.png": ("validation",),
    "sft.png": ("sft_nll",),
    "summary.png": ("reward", "response_length", "pg_loss", "vf_loss", "entropy", "kl"),
}


def load_series(run_dir: str | os.PathLike) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{metric: (steps, values)}`` of a run, sorted by step, ``None`` as NaN.

    Raises ``FileNotFoundError`` (no directory or no ``metrics.jsonl``) or ``ValueError`` (no records), one line each.
    """
    run_dir = run_path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} in run directory {str(run_dir)!r}")
    records = sorted(read_metrics(path), key=lambda record: record["step"])
    if not records:
        raise ValueError(f"{path} holds no metrics")
    points: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for name, value in record.items():
            if name != "step":
                points.setdefault(name, []).append((record["step"], _number(value)))
    return {name: (np.array([s for s, _ in p]), np.array([v for _, v in p], dtype=float)) for name, p in points.items()}


def plot_run(run_dir: str | os.PathLike) -> list[Path]:
    """Writes the :data:`FIGURES` whose metrics the run has into ``run_dir/plots/``; returns their paths."""
    series = load_series(run_dir)
    run_dir = run_path(run_dir)
    out_dir = run_dir / PLOTS_DIR
    written = []
    for file_name, chart_names in FIGURES.items():
        charts = [CHARTS[name] for name in chart_names if any(m in series for m in CHARTS[name].metrics())]
        if not charts:
            continue
        out_dir.mkdir(exist_ok=True)
        path = out_dir / file_name
        figure = _draw(charts, series, title=f"{run_dir.name}: {file_name[:-4].replace('_', ' ')}")
        with path.open("wb") as handle:  # through epath: a local file or a cloud object
            figure.savefig(handle, format="png")
        written.append(path)
    return written


def _draw(charts: list[Chart], series: dict[str, tuple[np.ndarray, np.ndarray]], title: str) -> Figure:
    columns = 1 if len(charts) == 1 else 2 if len(charts) in (2, 4) else 3
    rows = math.ceil(len(charts) / columns)
    figure = Figure(figsize=(_PANEL_INCHES[0] * columns, _PANEL_INCHES[1] * rows + 0.4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(title)
    for index, chart in enumerate(charts):
        axes = figure.add_subplot(rows, columns, index + 1)
        for name in chart.lines:
            if name in series:
                steps, values = series[name]
                axes.plot(steps, values, label=name, marker="o" if len(steps) < _MARKERS_BELOW else None, markersize=3)
        low, high = chart.band or (None, None)
        if low in series and high in series:
            steps, low_values, high_values = _aligned(series[low], series[high])
            band_label = f"{low.split('/')[-1]} .. {high.split('/')[-1]}"
            axes.fill_between(steps, low_values, high_values, alpha=0.25, label=band_label)
        axes.set_title(chart.title)
        axes.set_xlabel("step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_ylabel(chart.ylabel)
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    return figure


def _aligned(low: tuple[np.ndarray, np.ndarray], high: tuple[np.ndarray, np.ndarray]):
    """Steps present in both series, with the two series' values there."""
    steps, low_index, high_index = np.intersect1d(low[0], high[0], return_indices=True)
    return steps, low[1][low_index], high[1][high_index]


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
