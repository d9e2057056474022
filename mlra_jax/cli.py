"""What the commands share: overrides of experiment fields (`--model.n_layer=4 --train.peak_lr=3e-4`), the
experiment to start from (a name, a module's attribute or a run's experiment.json), and their parsers' rules.

The overrides are parsed by tyro over a mirror of the config dataclasses whose defaults are the chosen
experiment's values and whose help is config.py's field comments; each value is read by the field's type
(true/false, none, an int or a float) and validated by the config's own checks, so an error names the field
and the values it accepts, and an unknown option or field gets the closest known one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import types
import typing
from typing import Annotated, Any

import tyro
from tyro.constructors import PrimitiveConstructorSpec

from mlra_jax.config import OPTIONAL_FIELDS, ConfigError, Experiment, did_you_mean  # noqa: F401 (re-exported)
from mlra_jax.config_docs import field_docs
from mlra_jax.run_config import SECTIONS, experiment_from_dict, read_run_config  # noqa: F401 (re-exported)
from mlra_jax.variants import SPECS

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


def _check_options(args: list[str], options: tuple[str, ...]) -> None:
    """Only --SECTION.FIELD is an override: any other --flag is an unknown option of the command (`options`: its
    own, named in a did-you-mean), never a key that would swallow the next argument."""
    for arg in args:
        name = arg.split("=", 1)[0]
        if arg.startswith("--") and "." not in name and name not in ("--help", "-h"):
            raise ConfigError(
                f"unknown option {name}{did_you_mean(name, options)}; overrides are --SECTION.FIELD=VALUE "
                f"(SECTION one of {', '.join(SECTIONS)})"
            )


def _value_spec(key: str, annotation: Any, field: dataclasses.Field) -> PrimitiveConstructorSpec:
    """How tyro reads one field: a single value, parsed by `_parse` (our spellings of booleans and none)."""
    return PrimitiveConstructorSpec(
        nargs=1,
        metavar=_allowed(annotation, field),
        instance_from_str=lambda texts: _parse(key, texts[0], annotation),
        is_instance=lambda value: True,
        str_from_instance=lambda value: [str(value)],
    )


@functools.cache
def _section_mirror(section: str) -> type:
    """A dataclass with the fields of a config section, each read by `_value_spec` and documented by its comment
    in config.py; without the section's checks, which run when the real section is built."""
    cls = SECTIONS[section]
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    fields = [
        (
            f.name,
            Annotated[Any, _value_spec(f"{section}.{f.name}", hints[f.name], f), tyro.conf.arg(help=docs.get(f.name))],
            dataclasses.field(default=f.default) if f.default is not dataclasses.MISSING else dataclasses.field(),
        )
        for f in dataclasses.fields(cls)
    ]
    return dataclasses.make_dataclass(section, fields, frozen=True, kw_only=True)


def _overrides_type(experiment: Experiment | None) -> type:
    """The parser's root: one mirror per section, defaulting to `experiment`'s values."""
    sections = []
    for section in SECTIONS:
        mirror = _section_mirror(section)
        if experiment is None:
            sections.append((section, mirror))
        else:
            values = {f.name: getattr(getattr(experiment, section), f.name) for f in dataclasses.fields(mirror)}
            sections.append((section, mirror, dataclasses.field(default=mirror(**values))))
    return dataclasses.make_dataclass("overrides", sections, frozen=True, kw_only=True)


def _tyro_message(text: str) -> str:
    """tyro's boxed error as one line: its title, what went wrong and the closest option."""
    lines = [line.strip(" \u2502\u256d\u256e\u2570\u256f\u2500") for line in text.splitlines()]
    lines = [line for line in lines if line.strip("-\u2500 ") and not line.startswith("For full helptext")]
    if "Argument helptext:" in lines:
        lines = lines[: lines.index("Argument helptext:")]
    if "Perhaps you meant:" in lines:
        at = lines.index("Perhaps you meant:")
        lines = lines[:at] + [f"(did you mean {lines[at + 1].split()[0]}?)"] if at + 1 < len(lines) else lines[:at]
    message = " ".join(lines[1:]) if len(lines) > 1 else (lines[0] if lines else "invalid overrides")
    return message.replace("Unrecognized options:", "unknown option")


def _run_tyro(experiment: Experiment | None, args: list[str], prog: str) -> tuple[Any, str]:
    """(the parsed overrides or None, what tyro printed) for `args`; tyro's exit becomes the printed text."""
    try:
        return _tyro_once(experiment, args, prog)
    except SystemError as err:  # tyro reads help from config.py's source with ast.parse, which CPython before
        # 3.11.8 can fail spuriously while another thread runs (CPython gh-106905): parse once more
        if "AST constructor recursion depth mismatch" not in str(err):
            raise
        return _tyro_once(experiment, args, prog)


def _tyro_once(experiment: Experiment | None, args: list[str], prog: str) -> tuple[Any, str]:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        try:
            parsed = tyro.cli(
                _overrides_type(experiment),
                args=args,
                prog=prog,
                config=(tyro.conf.FlagConversionOff,),
                use_underscores=True,
            )
        except SystemExit:
            parsed = None
    return parsed, printed.getvalue()


def apply_overrides(experiment: Experiment, args: list[str], options: tuple[str, ...] = ()) -> Experiment:
    """The experiment with `--section.field=value` overrides applied (validated). `options`: the command's own
    flags, named in the did-you-mean of an unknown one. A new --model.variant drops the base experiment's fields
    that the new variant does not use (the latent ranks of an MLRA experiment made GQA, say); fields given here
    are kept, and the new variant's own fields must be given."""
    _check_options(args, options)
    if not args:
        return experiment
    parsed, printed = _run_tyro(experiment, args, "overrides")
    if parsed is None:
        raise ConfigError(_tyro_message(printed))
    changes: dict[str, dict[str, Any]] = {}
    for key in dict.fromkeys(arg[2:].split("=", 1)[0] for arg in args if arg.startswith("--")):
        section, _, field = key.partition(".")
        changes.setdefault(section, {})[field] = getattr(getattr(parsed, section), field)
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
    dataclass, or "required") and what it means (the comments in config.py), as tyro writes it."""
    _, printed = _run_tyro(experiment, ["--help"], "overrides")
    lines = printed.splitlines()
    first = next((i for i, line in enumerate(lines) if line.strip() == "model options"), 0)
    return "\n".join(line.rstrip() for line in lines[first:])  # from the first section on, without tyro's -h


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
