"""Loss parity of training settings against a reference setting, over seeds and repeated runs.

    mlra bench loss_parity --experiment=gqa_tiny --workdir=/tmp/parity --seeds=1,2 --repeats=2 --parallel=4 \\
        --override=--model.compute_dtype=bfloat16 --override=--data.dataset=CORPUS \\
        --setting=bf16= --setting=fp8=--model.matmul_dtype=float8

Each run is `mlra train` in a process of its own, under --workdir/SETTING/seedS_runR (a finished run there is
read again, not retrained; an interrupted one resumes). Runs of one seed see the same data in the same order
from the same initial weights, yet on a GPU they part: its reductions are not reproducible bit for bit. So one
run per setting cannot tell a setting's effect from that noise, and the first setting (the reference) is run
--repeats times per seed to measure it. --parallel runs share the device (on a GPU each takes 0.9 / parallel of
its memory unless XLA_PYTHON_CLIENT_MEM_FRACTION is set).

The record holds every run's loss and validation-loss curves and, per setting and seed (`results`):
- the final validation loss of each run, and the reference's range over its repeats;
- the first step line's loss (the mean of the first log_every steps: how fast a setting starts);
- the worst relative gap of each run to the reference's mean after step --after, and how far it lies outside
  the reference's own range there (0 where it lies within it).
--figure draws each seed's training loss relative to the reference's mean, with the reference's range shaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

Curve = dict[int, float]  # step -> value


def parse_setting(text: str) -> tuple[str, list[str]]:
    """NAME=OVERRIDES (OVERRIDES split as a shell would; empty for the experiment as it is) -> (name, overrides)."""
    name, sep, overrides = text.partition("=")
    if not sep or not name or "/" in name or name.startswith("-"):
        raise ValueError(
            f"--setting={text!r} must be NAME=OVERRIDES (a name without '/', then '=', then the train overrides, "
            f"e.g. fp8=--model.matmul_dtype=float8, or bf16= for the experiment as it is)"
        )
    return name, shlex.split(overrides)


def run_directory(workdir: Path, setting: str, seed: int, repeat: int) -> Path:
    return workdir / setting / f"seed{seed}_run{repeat}"


def train_command(experiment: str, common: list[str], overrides: list[str], seed: int, directory: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mlra_jax.train",
        f"--experiment={experiment}",
        *common,
        *overrides,
        f"--train.seed={seed}",
        f"--workdir={directory}",
    ]


def run_all(commands: list[tuple[list[str], Path]], parallel: int) -> list[int]:
    """Each command (with its run directory, which gets the process's output as train.log), at most `parallel` at
    once; their exit codes in order."""
    env = dict(os.environ)
    if parallel > 1:
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / parallel:.3f}")
    codes: list[int | None] = [None] * len(commands)
    running: dict[int, subprocess.Popen] = {}
    pending = list(range(len(commands)))
    while pending or running:
        while pending and len(running) < parallel:
            index = pending.pop(0)
            command, directory = commands[index]
            directory.mkdir(parents=True, exist_ok=True)
            with open(directory / "train.log", "ab") as log_file:
                running[index] = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        for index, process in list(running.items()):
            if process.poll() is not None:
                codes[index] = process.returncode
                del running[index]
        time.sleep(0.2)
    return [int(code) for code in codes]


def last_line(log: Path) -> str:
    """The last non-empty line a run printed (its error, where it failed)."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
    return lines[-1].strip() if lines else f"no output in {log}"


def summarize(curves: dict[str, dict[int, list[dict[str, Curve]]]], reference: str, after: int) -> dict[str, Any]:
    """The per-setting, per-seed summary (the module's docstring) of curves[setting][seed] = [run, ...], each run
    {"loss": Curve, "val_loss": Curve}, against the `reference` setting's runs of the same seed."""
    summary: dict[str, Any] = {}
    for setting, seeds in curves.items():
        summary[setting] = {}
        for seed, runs in seeds.items():
            references = curves[reference][seed]
            steps = sorted(s for s in set.intersection(*(set(r["loss"]) for r in references)) if s > after)
            band = {s: [r["loss"][s] for r in references] for s in steps}
            rows = []
            for run in runs:
                gaps = {s: run["loss"][s] / statistics.mean(band[s]) - 1 for s in steps if s in run["loss"]}
                outside = [max(run["loss"][s] / max(band[s]) - 1, 1 - run["loss"][s] / min(band[s]), 0.0) for s in gaps]
                worst = max(gaps, key=lambda s: abs(gaps[s])) if gaps else None
                validation = run.get("val_loss") or {}
                rows.append(
                    {
                        "first_line_loss": run["loss"][min(run["loss"])] if run["loss"] else None,
                        "final_val_loss": validation[max(validation)] if validation else None,
                        "worst_gap_to_reference_mean": None if worst is None else round(gaps[worst], 5),
                        "at_step": worst,
                        "most_outside_reference_range": round(max(outside), 5) if outside else None,
                    }
                )
            finals = [r["final_val_loss"] for r in rows if r["final_val_loss"] is not None]
            summary[setting][str(seed)] = {
                "runs": rows,
                "final_val_loss_range": [min(finals), max(finals)] if finals else None,
            }
    return summary


def figure(curves: dict[str, dict[str, list[dict[str, Curve]]]], reference: str) -> Any:
    """The study's training loss as a matplotlib Figure: a panel per seed, each setting's runs relative to the
    reference's mean at each step (the reference's own range shaded), so that a gap of a percent shows."""
    from matplotlib.figure import Figure

    seeds = sorted(curves[reference], key=int)
    fig = Figure(figsize=(5 * len(seeds), 4), layout="constrained")
    for ax, seed in zip(fig.subplots(1, len(seeds), squeeze=False)[0], seeds):
        references = curves[reference][seed]
        steps = sorted(set.intersection(*(set(map(int, r["loss"])) for r in references)))
        mean = {s: statistics.mean([r["loss"][_key(r["loss"], s)] for r in references]) for s in steps}
        low = [min(r["loss"][_key(r["loss"], s)] for r in references) / mean[s] - 1 for s in steps]
        high = [max(r["loss"][_key(r["loss"], s)] for r in references) / mean[s] - 1 for s in steps]
        ax.fill_between(
            steps,
            low,
            high,
            color="C0",
            alpha=0.25,
            label=f"{reference} ({len(references)} run{'s' if len(references) > 1 else ''})",
        )
        for index, (setting, by_seed) in enumerate(item for item in curves.items() if item[0] != reference):
            for number, run in enumerate(by_seed.get(seed, [])):
                shown = [s for s in steps if _key(run["loss"], s) in run["loss"]]
                relative = [run["loss"][_key(run["loss"], s)] / mean[s] - 1 for s in shown]
                ax.plot(shown, relative, color=f"C{index + 1}", lw=1, label=setting if number == 0 else None)
        ax.axhline(0, color="k", lw=0.5)
        ax.set(title=f"seed {seed}", xlabel="step", ylabel=f"training loss / {reference}'s mean - 1")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return fig


def _key(curve: dict, step: int) -> Any:
    """A curve's key for `step` (an int in memory, a string in a record read back)."""
    return step if step in curve else str(step)


def read_curves(directory: Path) -> dict[str, Curve]:
    from mlra_jax.plot import read_records, series

    records = read_records(directory)
    return {key: dict(zip(*series(records, key))) for key in ("loss", "val_loss")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mlra bench loss_parity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experiment", required=True)
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        help="NAME=OVERRIDES (repeatable; the first is the reference), e.g. fp8=--model.matmul_dtype=float8",
    )
    parser.add_argument("--override", action="append", default=[], help="train overrides of every run (repeatable)")
    parser.add_argument("--seeds", default="1,2", help="comma-separated training seeds")
    parser.add_argument("--repeats", type=int, default=2, help="runs of the reference per seed (its own spread)")
    parser.add_argument("--setting_repeats", type=int, default=1, help="runs of each other setting per seed")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once on the device")
    parser.add_argument("--after", type=int, default=100, help="gaps are measured after this step")
    parser.add_argument("--workdir", type=Path, required=True, help="the runs' directories go under it")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/loss_parity.json"))
    parser.add_argument("--figure", type=Path, help="also draw the training curves (a PNG; needs matplotlib)")
    args = parser.parse_args(argv)
    try:
        settings = dict(parse_setting(text) for text in args.setting)
        seeds = [int(seed) for seed in args.seeds.split(",")]
    except ValueError as err:
        parser.error(str(err))
    if len(args.setting) < 2 or len(settings) != len(args.setting):
        parser.error("give at least two --setting=NAME=OVERRIDES with different names (the first is the reference)")
    if min(args.repeats, args.setting_repeats, args.parallel) < 1 or args.after < 0:
        parser.error("--repeats, --setting_repeats and --parallel must be at least 1 and --after at least 0")
    if args.figure is not None:
        if importlib.util.find_spec("matplotlib") is None:
            parser.error("--figure needs matplotlib: pip install 'mlra-jax[plot]'")
        if not args.figure.parent.is_dir():
            parser.error(f"--figure {args.figure}: the folder {args.figure.parent} does not exist")

    from mlra_jax.benchmarks.common import experiment_list, save
    from mlra_jax.cli import apply_overrides
    from mlra_jax.config import ConfigError
    from mlra_jax.experiments import get_experiment

    experiment = experiment_list(parser, args.experiment)
    if len(experiment) != 1:
        parser.error(f"--experiment takes one experiment; got {args.experiment}")
    for name, overrides in settings.items():  # every run's overrides checked before the first starts
        try:
            apply_overrides(get_experiment(experiment[0]), [*args.override, *overrides])
        except ConfigError as err:
            parser.error(f"setting {name!r}: {err}")
    reference = next(iter(settings))
    runs = [
        (setting, seed, repeat)
        for seed in seeds
        for setting in settings
        for repeat in range(args.repeats if setting == reference else args.setting_repeats)
    ]
    commands = [
        (
            train_command(experiment[0], args.override, settings[s], seed, run_directory(args.workdir, s, seed, r)),
            run_directory(args.workdir, s, seed, r),
        )
        for s, seed, r in runs
    ]
    codes = run_all(commands, args.parallel)
    failed = [(directory, code) for (_, directory), code in zip(commands, codes) if code != 0]
    if failed:
        lines = [f"{directory} (exit {code}): {last_line(directory / 'train.log')}" for directory, code in failed]
        print("these runs failed; the record is not written:\n  " + "\n  ".join(lines), file=sys.stderr)
        return 2 if any(code == 2 for _, code in failed) else 1  # 2: a run refused its input
    curves: dict[str, dict[int, list[dict[str, Curve]]]] = {s: {seed: [] for seed in seeds} for s in settings}
    for (setting, seed, repeat), (_, directory) in zip(runs, commands):
        curves[setting][seed].append(read_curves(directory))
    summary = summarize(curves, reference, args.after)
    save(  # its record of the device starts JAX's backend here: after the runs, which hold the device
        args.out,
        "loss parity",
        [{"setting": s, "seed": int(seed), **row} for s, by_seed in summary.items() for seed, row in by_seed.items()],
        experiment=experiment[0],
        overrides=args.override,
        settings=settings,
        reference=reference,
        after_step=args.after,
        curves={s: {str(seed): runs for seed, runs in by_seed.items()} for s, by_seed in curves.items()},
    )
    if args.figure is not None:
        from mlra_jax.guards import atomic_write_bytes

        png = io.BytesIO()
        figure({s: {str(k): v for k, v in by_seed.items()} for s, by_seed in curves.items()}, reference).savefig(
            png, format="png", dpi=100
        )
        atomic_write_bytes(args.figure, png.getvalue())
    for setting, by_seed in summary.items():
        for seed, row in by_seed.items():
            runs = row["runs"]
            finals = ", ".join(f"{r['final_val_loss']:.4f}" for r in runs if r["final_val_loss"] is not None)
            gaps = ", ".join(f"{gap:+.2%}" for r in runs if (gap := r["worst_gap_to_reference_mean"]) is not None)
            print(f"{setting:>12} seed {seed}: final validation {finals or '-'}; gap to {reference}: {gaps or '-'}")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
