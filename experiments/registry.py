"""The table of named experiments."""

from __future__ import annotations

from pathlib import Path

from mlra_jax.config import ConfigError, Experiment, did_you_mean
from mlra_jax.run_config import experiment_from_dict, read_run_config

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


def resolve_experiment(spec: str) -> Experiment:
    """--experiment: a registered name (mlra4_2p9b), `path/to/file.py:NAME` or `package.module:NAME` (an
    Experiment, or a function of no arguments that returns one: experiments kept outside this package), or a
    run's experiment.json (or the run directory holding one) to start a new run like it."""
    path = Path(spec)
    if spec.endswith(".json") or (path.is_dir() and (path / "experiment.json").is_file()):
        config = path if spec.endswith(".json") else path / "experiment.json"
        if not config.is_file():
            raise ConfigError(f"--experiment={spec}: no such file; give a run's experiment.json")
        try:
            return experiment_from_dict(read_run_config(config))
        except TypeError as err:
            raise ConfigError(f"--experiment={spec} does not describe an experiment of this version ({err})") from None
    if ":" in spec:
        return _experiment_attribute(spec)
    if spec not in experiment_names():
        raise ConfigError(
            f"unknown experiment {spec!r}{did_you_mean(spec, experiment_names())}; "
            f"mlra info --list lists them, or give FILE.py:NAME, package.module:NAME or "
            f"a run's experiment.json"
        )
    return get_experiment(spec)


def _experiment_attribute(spec: str) -> Experiment:
    """`file.py:NAME` or `package.module:NAME` -> the Experiment it names (or makes)."""
    import importlib
    import importlib.util

    where, _, name = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            if not Path(where).is_file():
                raise ConfigError(f"--experiment={spec}: {where} is not a file")
            module_spec = importlib.util.spec_from_file_location(Path(where).stem, where)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ImportError as err:
        raise ConfigError(f"--experiment={spec}: cannot import {where} ({err})") from None
    if not hasattr(module, name):
        names = [n for n in dir(module) if not n.startswith("_")]
        raise ConfigError(f"--experiment={spec}: {where} has no {name!r}{did_you_mean(name, names)}")
    value = getattr(module, name)
    experiment = value() if callable(value) and not isinstance(value, Experiment) else value
    if not isinstance(experiment, Experiment):
        raise ConfigError(
            f"--experiment={spec} is a {type(experiment).__name__}, not an Experiment "
            f"(mlra_jax.config.Experiment, or a function returning one)"
        )
    return experiment
