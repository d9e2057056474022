"""The paper's zero-shot suite and its table; which task names a task index knows.

The paper's downstream table (seven common-sense reasoning benchmarks) reports lm-evaluation-harness
accuracy, zero-shot: normalized accuracy (acc_norm) for ARC-E, ARC-C, OpenBookQA, HellaSwag and PIQA, accuracy (acc)
for BoolQ and Winogrande, in percent, and their average.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, Iterable, NamedTuple

from mlra_jax.config import ConfigError


class PaperTask(NamedTuple):
    task: str  # lm-eval's name
    column: str  # the paper's
    metric: str


PAPER_SUITE = "paper"
PAPER_TASKS = (
    PaperTask("arc_easy", "ARC-E", "acc_norm"),
    PaperTask("arc_challenge", "ARC-C", "acc_norm"),
    PaperTask("openbookqa", "OpenBookQA", "acc_norm"),
    PaperTask("boolq", "BoolQ", "acc"),
    PaperTask("hellaswag", "HellaSwag", "acc_norm"),
    PaperTask("winogrande", "Winogrande", "acc"),
    PaperTask("piqa", "PIQA", "acc_norm"),
)


def task_names(spec: str) -> list[str]:
    """Comma-separated task names, `paper` standing for the paper's seven; duplicates dropped."""
    names: list[str] = []
    for name in (part.strip() for part in spec.split(",")):
        for task in [t.task for t in PAPER_TASKS] if name == PAPER_SUITE else [name] if name else []:
            if task not in names:
                names.append(task)
    if not names:
        raise ConfigError(f"--tasks {spec!r} names no task; give lm-eval task names (arc_easy,piqa) or {PAPER_SUITE!r}")
    return names


def check_known(names: Iterable[str], known: list[str], matches: Callable[[str], list[str]]) -> None:
    """ConfigError naming every task that `matches` (lm-eval's name and glob lookup) finds nothing for,
    with the closest known names."""
    unknown = [name for name in names if not matches(name)]
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
            hints.append(f"{name!r}" + (f" (close: {', '.join(close)})" if close else ""))
        raise ConfigError(
            f"lm-eval does not know the task{'s' if len(unknown) > 1 else ''} {'; '.join(hints)}. "
            f"List its tasks with `python -m lm_eval ls tasks`; a task of your own goes in a folder "
            f"given with --include_path"
        )


def metric_value(results: dict[str, Any], task: str, metric: str) -> float | None:
    """A metric from lm-eval's results dict (the "none" filter), or None when absent."""
    value = results.get("results", {}).get(task, {}).get(f"{metric},none")
    return None if value is None or isinstance(value, str) else float(value)


def paper_table(results: dict[str, Any], method: str) -> str | None:
    """The paper's zero-shot table (percent, two decimals, average of the seven) for one model, as
    markdown; None unless every paper task is in the results."""
    values = [metric_value(results, t.task, t.metric) for t in PAPER_TASKS]
    if any(v is None for v in values):
        return None
    cells = [f"{100 * v:.2f}" for v in values] + [f"{100 * sum(values) / len(values):.2f}"]
    header = ["Method", *(t.column for t in PAPER_TASKS), "Avg"]
    rows = [header, ["---"] * len(header), [method, *cells]]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)
