"""The table of named experiments."""

from __future__ import annotations

from mlra_jax.config import ConfigError, Experiment

_EXPERIMENTS: dict[str, Experiment] = {}


def register(experiment: Experiment) -> Experiment:
    if experiment.name in _EXPERIMENTS:
        raise ValueError(f"experiment {experiment.name!r} is registered twice")
    _EXPERIMENTS[experiment.name] = experiment
    return experiment


def get_experiment(name: str) -> Experiment:
    if name not in _EXPERIMENTS:
        raise ConfigError(f"unknown experiment {name!r}; valid experiments: {', '.join(experiment_names())}")
    return _EXPERIMENTS[name]


def experiment_names() -> list[str]:
    return sorted(_EXPERIMENTS)


def all_experiments() -> list[Experiment]:
    return [_EXPERIMENTS[name] for name in experiment_names()]
