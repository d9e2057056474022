"""Loss, validation loss and throughput curves of one or more runs, from their metrics.jsonl.

    mlra plot runs/mlra4_tiny                        # -> runs/mlra4_tiny/curves.png
    mlra plot runs/mla_tiny runs/mlra4_tiny --out compare.png

One figure: training loss (solid) and validation loss (dashed, markers) against the step, each held-out
set's val/NAME/loss, and tokens per second, one colour per run, as the paper compares variants. In a
notebook, `show_runs([...])` draws it inline. Needs matplotlib (`pip install -e '.[plot]'`). The runs are
only read; the image goes to --out (default curves.png in the first run's folder), which may not be one of the
runs' own files, and which is written whole (a kill leaves the earlier image or the new one).
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from mlra_jax.cli import command_parser
from mlra_jax.command import command
from mlra_jax.paths import as_path, is_remote
from mlra_jax.progress import configure_cli_logging

log = logging.getLogger(__name__)


class MetricsFileError(ValueError):
    """A run has no usable metrics.jsonl; the message names the file."""


def metrics_file(run: str | os.PathLike) -> Any:
    """RUN/metrics.jsonl (or RUN itself when it is a .jsonl file)."""
    path = as_path(run)
    return path if path.name.endswith(".jsonl") else path / "metrics.jsonl"


def read_records(run: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl in file order. A line that is not a record (one torn by a kill) is
    skipped with a warning; a missing file or one without records is a MetricsFileError."""
    path = metrics_file(run)
    if not path.is_file():
        raise MetricsFileError(
            f"{path} does not exist: give a run directory (the --workdir of "
            f"mlra train, which writes metrics.jsonl) or a metrics.jsonl file"
        )
    records = []
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        try:
            record = json.loads(line.decode())  # a line of other bytes than UTF-8 text is no record either
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("no integer 'step'")
        except ValueError as err:
            log.warning("%s line %d is not a metrics record (%s); skipped", path, number, err)
            continue
        records.append(record)
    if not records:
        raise MetricsFileError(
            f"{path} holds no metrics records (the run has not logged a step yet, or the file "
            f"is not a run's metrics.jsonl)"
        )
    return records


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that hold a number under `key` (the last record of a step wins)."""
    by_step = {r["step"]: r[key] for r in records if isinstance(r.get(key), (int, float))}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def _labels(runs: Sequence[str | os.PathLike]) -> list[str]:
    names = [metrics_file(run).parent.name for run in runs]
    return names if len(set(names)) == len(names) else [os.fspath(metrics_file(run).parent) for run in runs]


def plot_runs(runs: Sequence[str | os.PathLike], out: str | os.PathLike | None = None) -> Any:
    """The curves of `runs` as a matplotlib Figure, also saved as a PNG at `out` when given. Every run is read
    (and checked) before anything is drawn or written."""
    from matplotlib.figure import Figure

    data = [read_records(run) for run in runs]
    held_out = sorted(
        {k for records in data for r in records for k in r if k.startswith("val/") and k.endswith("/loss")}
    )
    panels = ["loss", *held_out, "tokens_per_s"]
    fig = Figure(figsize=(5 * len(panels), 4), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for index, (label, records) in enumerate(zip(_labels(runs), data)):
        color = f"C{index % 10}"
        for ax, key in zip(axes, panels):
            steps, values = series(records, key)
            if steps:
                ax.plot(steps, values, color=color, label=f"{label} train" if key == "loss" else label)
        steps, values = series(records, "val_loss")
        if steps:
            axes[0].plot(steps, values, "o--", color=color, markersize=3, label=f"{label} validation")
    titles = {"loss": "loss (solid: train, dashed: validation)", "tokens_per_s": "tokens per second"}
    for ax, key in zip(axes, panels):
        ax.set_title(titles.get(key, f"{key} (held-out set)"))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    if out is not None:
        from mlra_jax.guards import atomic_write_bytes  # (guards imports JAX: only when an image is written)

        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=100)
        atomic_write_bytes(out, png.getvalue())
    return fig


def show_runs(runs: Sequence[str | os.PathLike], out: str | os.PathLike | None = None) -> Any:
    """Draw the curves of `runs` inline in a notebook (and save them at `out` when given); returns the Figure.
    Outside IPython (a plain script) nothing is drawn: the Figure and `out` are what it gives."""
    fig = plot_runs(runs, out)
    try:
        from IPython.display import Image, display
    except ImportError:
        return fig
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    display(Image(data=png.getvalue()))
    return fig


def _check_output(out: Any, runs: Sequence[str]) -> bool:
    """Refuse an --out that would replace a run's metrics or other own files, or whose folder is missing or cannot
    take it; whether it replaces an earlier image."""
    from mlra_jax.guards import InputError, check_output_path

    folder = out.parent
    if is_remote(out) or not any(os.path.isfile(p) for p in (folder, *folder.parents)):
        if not folder.is_dir():
            raise InputError(f"--out {out}: the folder {folder} does not exist; create it or choose another path")
    files = [metrics_file(run) for run in runs]
    return check_output_path(out, inputs=files, run_dirs=[f.parent for f in files])


@command
def main(argv: list[str] | None = None) -> int:
    parser = command_parser("mlra plot", __doc__)
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run directories (or their metrics.jsonl files)")
    parser.add_argument("--out", help="the PNG to write (default: curves.png in the first run's folder)")
    args = parser.parse_args(argv)
    configure_cli_logging()
    out = as_path(args.out) if args.out else metrics_file(args.runs[0]).parent / "curves.png"
    replaced = _check_output(out, args.runs)
    try:
        plot_runs(args.runs, out)
    except ImportError as err:
        print(f"error: {err.name or 'matplotlib'} is missing: pip install -e '.[plot]'", file=sys.stderr)
        return 2
    print(
        f"wrote {out} ({len(args.runs)} run{'s' if len(args.runs) > 1 else ''}"
        f"{'; replaced the earlier image' if replaced else ''})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
