"""What the commands share: overrides of experiment fields (`--model.n_layer=4 --train.peak_lr=3e-4`), the
experiment to start from (a name, a module's attribute or a run's experiment.json), and their parsers' rules.

Values are parsed by the field's type and validated by the config's own checks, so an error names the field
and the values it accepts; an unknown option or field gets the closest known one.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Iterable

from mlra_jax.config import (
    OPTIONAL_FIELDS,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    Experiment,
    MeshConfig,
    MetricsConfig,
    ModelConfig,
    ProfileConfig,
    TrainConfig,
)
from mlra_jax.config_docs import field_docs
from mlra_jax.variants import SPECS

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "mesh": MeshConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
    "profile": ProfileConfig,
}
_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def _parse(name: str, text: str, annotation: Any) -> Any:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if text.lower() in ("none", "null") and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options[:-1]:  # int | float: an int where the text is one, else a float
            try:
                return _parse(name, text, option)
            except ConfigError:
                continue
        return _parse(name, text, options[-1])
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


def _split(args: list[str], options: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """['--a.b=1', '--c.d', '2'] -> [('a.b', '1'), ('c.d', '2')]. Only --SECTION.FIELD takes a value: any other
    --flag is an unknown option of the command (`options`: its own, for a did-you-mean), never a key that
    would swallow the next argument."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.field=value")
        key = arg[2:].split("=", 1)[0]
        if "." not in key:
            raise ConfigError(
                f"unknown option {arg.split('=', 1)[0]}{did_you_mean(arg.split('=', 1)[0], options)}; "
                f"overrides are --SECTION.FIELD=VALUE (SECTION one of {', '.join(SECTIONS)})"
            )
        if "=" in arg:
            value = arg[2:].split("=", 1)[1]
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
            i += 1
        else:
            raise ConfigError(f"{arg} needs a value: {arg}=VALUE")
        pairs.append((key, value))
        i += 1
    return pairs


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """'; did you mean X?' for the closest of `candidates` (hyphens and underscores alike), or ''."""
    normal = {c.replace("-", "_"): c for c in candidates}
    close = difflib.get_close_matches(word.replace("-", "_"), list(normal), n=1, cutoff=0.6)
    return f" (did you mean {normal[close[0]]}?)" if close else ""


def apply_overrides(experiment: Experiment, args: list[str], options: tuple[str, ...] = ()) -> Experiment:
    """The experiment with `--section.field=value` overrides applied (validated). `options`: the command's own
    flags, named in the did-you-mean of an unknown one. A new --model.variant drops the base experiment's fields
    that the new variant does not use (the latent ranks of an MLRA experiment made GQA, say); fields given here
    are kept, and the new variant's own fields must be given."""
    changes: dict[str, dict[str, Any]] = {}
    for key, text in _split(args, options):
        section, _, field = key.partition(".")
        if section not in SECTIONS or not field:
            raise ConfigError(
                f"unknown option --{key}{did_you_mean(section, SECTIONS)}; overrides are "
                f"--SECTION.FIELD=VALUE with SECTION one of {', '.join(SECTIONS)}"
            )
        hints = typing.get_type_hints(SECTIONS[section])
        if field not in hints:
            raise ConfigError(
                f"{section} has no field {field!r}{did_you_mean(field, hints)}; its fields are: {', '.join(hints)}"
            )
        changes.setdefault(section, {})[field] = _parse(key, text, hints[field])
    model = changes.get("model", {})
    if "variant" in model and model["variant"] != experiment.model.variant:
        unused = [
            name
            for name in OPTIONAL_FIELDS
            if name not in model
            and getattr(experiment.model, name) is not None
            and (model["variant"] not in SPECS or name not in SPECS[model["variant"]].required_fields)
        ]
        changes["model"] = {**{name: None for name in unused}, **model}
    replaced = {
        section: dataclasses.replace(getattr(experiment, section), **fields) for section, fields in changes.items()
    }
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
        raise ConfigError(
            f"{path} is not a run's experiment.json ({type(err).__name__}: {err}); it records the "
            f"configuration the run was trained with: restore it, or use another --workdir"
        ) from None


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


def fields_help(experiment: Experiment | None = None) -> str:
    """Every overridable field with the values it takes, its value in `experiment` (else the default of its
    dataclass) and what it means (the comments in config.py)."""
    lines = []
    for section, cls in SECTIONS.items():
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for f in dataclasses.fields(cls):
            if experiment is not None:
                value = f"value {getattr(getattr(experiment, section), f.name)!r}"
            else:
                value = "default " + ("(required)" if f.default is dataclasses.MISSING else repr(f.default))
            lines.append(f"  --{section}.{f.name}={_allowed(hints[f.name], f)}  {value}")
            if docs.get(f.name):
                lines.append(textwrap.fill(docs[f.name], 110, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


# -- what every command's parser shares ------------------------------------------------------------------------
DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}


def dtype_argument(text: str) -> str:
    """--dtype: bfloat16 (bf16) or float32 (fp32), the same spellings in every command."""
    if text.lower() not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a dtype: use bfloat16 (or bf16) or float32 (or fp32)")
    return DTYPE_NAMES[text.lower()]


def command_parser(prog: str, description: str | None = None, **kwargs: Any) -> argparse.ArgumentParser:
    """A command's parser: no abbreviated options (--dry would be --dry_run), the module docstring kept as
    written, and --debug (handled by command.command) listed."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kwargs,
    )
    parser.add_argument("--debug", action="store_true", help="show an error's traceback (or MLRA_JAX_DEBUG=1)")
    return parser


def add_subcommand(subparsers: Any, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand's parser with the same rules as command_parser's."""
    return subparsers.add_parser(
        name, help=help, description=help, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_run_argument(
    parser: argparse.ArgumentParser, help: str = "a training run directory (local or gs://...)", required: bool = True
) -> None:
    """The run directory, --workdir in every command (--checkpoint: the same, the name these commands had)."""
    parser.add_argument(
        "--workdir",
        "--checkpoint",
        dest="workdir",
        metavar="RUN",
        required=required,
        help=f"{help}; --checkpoint is the same option",
    )
