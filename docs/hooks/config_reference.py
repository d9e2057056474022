"""The configuration page's field tables, generated from the dataclasses of mlra_jax/config.py.

A mkdocs hook (`hooks:` in mkdocs.yml): `on_page_markdown` replaces the marker line of docs/configuration.md
with `config_reference()`, one table per dataclass: every field with its command-line flag, type, default
and help. The help is the field's comments in config.py (the lines right above it, then the one beside it)
and, for a field with a fixed set of values, those values.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing

MARKER = "<!-- config-reference -->"


def config_classes() -> list[type]:
    """Every dataclass defined in mlra_jax.config, in source order."""
    from mlra_jax import config

    classes = [
        obj
        for _, obj in inspect.getmembers(config, inspect.isclass)
        if dataclasses.is_dataclass(obj) and obj.__module__ == config.__name__
    ]
    return sorted(classes, key=lambda cls: inspect.getsourcelines(cls)[1])


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> its comments in config.py (mlra_jax.config_docs, which `--help` shows too)."""
    from mlra_jax.config_docs import field_docs

    return field_docs(cls)


def _sections(classes: list[type]) -> dict[type, str]:
    """Config class -> the command-line section that sets its fields (`model` for Experiment.model, ...)."""
    by_name = {cls.__name__: cls for cls in classes}
    top = [cls for cls in classes if cls.__name__ == "Experiment"]
    sections: dict[type, str] = {}
    for owner in top:
        for f in dataclasses.fields(owner):
            cls = by_name.get(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""))
            if cls is not None:
                sections[cls] = f.name
    return sections


def _type_text(annotation: typing.Any) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
    return text.replace("typing.", "")


def _default_text(f: dataclasses.Field, sections: dict[type, str]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        section = sections.get(type(value))
        return f"[`{type(value).__name__}()`](#{section})" if section else f"`{type(value).__name__}()`"
    return f"`{value!r}`"


def _choices(f: dataclasses.Field) -> tuple | None:
    if "choices" in f.metadata:
        return tuple(f.metadata["choices"])
    if isinstance(f.type, str) and f.type.startswith("Literal["):
        return tuple(re.findall(r"['\"]([^'\"]*)['\"]", f.type))
    return None


def _cell(text: str) -> str:
    """Markdown table cell text: pipes, asterisks and angle brackets escaped outside code spans."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even parts lie outside code spans
        parts[i] = (
            parts[i]
            .replace("\\", "\\\\")
            .replace("|", "\\|")
            .replace("*", "\\*")
            .replace("<", "&lt;")
            .replace("_", "\\_")
        )
    return "`".join(parts) if len(parts) % 2 else text.replace("|", "\\|")


def config_reference() -> str:
    """The field tables of every configuration dataclass, as Markdown."""
    classes = config_classes()
    sections = _sections(classes)
    out: list[str] = []
    for cls in classes:
        section = sections.get(cls)
        if section:
            out.append(f"## `{section}`: {cls.__name__} {{#{section}}}")
        else:
            out.append(f"## {cls.__name__} {{#{cls.__name__.lower()}}}")
        doc = inspect.getdoc(cls) or ""
        if doc and not doc.startswith(f"{cls.__name__}("):  # dataclasses make a signature the docstring
            out.append("")
            out.append(doc.replace("(REFERENCE.md)", "([conventions](conventions.md))"))
        out.append("")
        if section:
            out.append(f"Set on the command line as `--{section}.FIELD=VALUE`.")
        else:
            out.append("Set by the experiment's definition (`mlra_jax.experiments`), not on the command line.")
        out.append("")
        out.append("| field | type | default | help |")
        out.append("| --- | --- | --- | --- |")
        helps = field_comments(cls)
        for f in dataclasses.fields(cls):
            name = f"`--{section}.{f.name}`" if section else f"`{f.name}`"
            help_text = _cell(helps.get(f.name, ""))
            choices = _choices(f)
            if choices:
                values = ", ".join(f"`{c}`" for c in choices)
                sentence = help_text if not help_text or help_text.endswith(".") else help_text + "."
                help_text = f"{sentence} One of: {values}.".strip()
            out.append(f"| {name} | {_cell(_type_text(f.type))} | {_default_text(f, sections)} | {help_text.strip()} |")
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, page: typing.Any, **kwargs: typing.Any) -> str:
    """mkdocs hook: fill the configuration page's marker with the generated tables."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, config_reference())
