"""Named experiments: the paper's 30 runs (`paper.py`), small CPU runs (`tiny.py`),
and the settings of the paper's Tables 1-2 (`paper_tables.py`).

    mlra info --list        # every experiment with a one-line description

The folder installs as `mlra_jax.experiments` (pyproject's package-dir), a name no other package takes.
"""

from mlra_jax.experiments import paper, tiny  # noqa: F401  (registration)
from mlra_jax.experiments.registry import (
    all_experiments,
    experiment_names,
    get_experiment,
    register,
    resolve_experiment,
)

__all__ = ["all_experiments", "experiment_names", "get_experiment", "register", "resolve_experiment"]
