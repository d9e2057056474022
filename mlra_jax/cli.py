"""Command-line overrides of experiment fields: `--model.n_layer=4 --train.peak_lr=3e-4`.

Values are parsed by the field's type and validated by the config's own checks, so
an error names the field and the values it accepts.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

from mlra_jax.config import (CheckpointConfig, ConfigError, DataConfig, Experiment, MeshConfig, MetricsConfig,
                             ModelConfig, ProfileConfig, TrainConfig)

SECTIONS: dict[str, type] = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig, "mesh": MeshConfig,
                             "checkpoint": CheckpointConfig, "metrics": MetricsConfig, "profile": ProfileConfig}
_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def _parse(name: str, text: str, annotation: Any) -> Any:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if text.lower() in ("none", "null"):
            return None
        return _parse(name, text, next(a for a in args if a is not type(None)))
    if origin is typing.Literal:
        return text
    try:
        if annotation is bool:
            if text.lower() not in _TRUE | _FALSE:
                raise ValueError
            return text.lower() in _TRUE
        return annotation(text)
    except ValueError:
        raise ConfigError(f"--{name}={text!r} is not a valid {getattr(annotation, '__name__', annotation)}") from None


def _split(args: list[str]) -> list[tuple[str, str]]:
    """['--a.b=1', '--c.d', '2'] -> [('a.b', '1'), ('c.d', '2')]."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.field=value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif i + 1 < len(args):
            key, value = arg[2:], args[i + 1]
            i += 1
        else:
            raise ConfigError(f"{arg} needs a value")
        pairs.append((key, value))
        i += 1
    return pairs


def apply_overrides(experiment: Experiment, args: list[str]) -> Experiment:
    """The experiment with `--section.field=value` overrides applied (validated)."""
    changes: dict[str, dict[str, Any]] = {}
    for key, text in _split(args):
        section, _, field = key.partition(".")
        if section not in SECTIONS or not field:
            raise ConfigError(f"unknown option --{key}; overrides are --SECTION.FIELD=VALUE with SECTION one of "
                              f"{', '.join(SECTIONS)}")
        hints = typing.get_type_hints(SECTIONS[section])
        if field not in hints:
            raise ConfigError(f"{section} has no field {field!r}; its fields are: {', '.join(hints)}")
        changes.setdefault(section, {})[field] = _parse(key, text, hints[field])
    replaced = {section: dataclasses.replace(getattr(experiment, section), **fields)
                for section, fields in changes.items()}
    return dataclasses.replace(experiment, **replaced)


def experiment_from_dict(data: dict[str, Any]) -> Experiment:
    """An Experiment from its dataclasses.asdict form (a run's experiment.json)."""
    sections = {name: cls(**data[name]) for name, cls in SECTIONS.items() if name in data}
    rest = {k: v for k, v in data.items() if k not in SECTIONS}
    return Experiment(**rest, **sections)


def read_run_config(path: Path) -> dict[str, Any]:
    """A run's experiment.json as a dict, or a ConfigError that names the file when it is not one."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
            raise ValueError("no 'model' section")
        return data
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{path} is not a run's experiment.json ({type(err).__name__}: {err}); it records the "
                          f"configuration the run was trained with: restore it, or use another --workdir") from None


def _allowed(annotation: Any, field: dataclasses.Field) -> str:
    """How a field's value is written: its choices ({a,b}), true|false, or its type's name."""
    choices = field.metadata.get("choices")
    if choices is None and typing.get_origin(annotation) is typing.Literal:
        choices = typing.get_args(annotation)
    if choices is not None:
        return "{" + ",".join(map(str, choices)) + "}"
    if annotation is bool:
        return "{true,false}"
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return f"{_allowed(args[0], field)}|none"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def fields_help() -> str:
    """Every overridable field with the values it takes and its default in the base config."""
    lines = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = "(required)" if f.default is dataclasses.MISSING else repr(f.default)
            lines.append(f"  --{section}.{f.name}={_allowed(hints[f.name], f)}  default {default}")
    return "\n".join(lines)
