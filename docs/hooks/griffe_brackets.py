"""A Griffe extension for the API pages: shapes in docstrings stay text.

Docstrings write array shapes and indexing in brackets (`layers[l][name]`, `[B, T] [n, H]`), which Markdown
would read as reference links and mkdocs-autorefs as cross-references to resolve. The extension escapes the
`][` of such pairs outside code spans, so they render as written.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_PAIR = re.compile(r"\](\s*)\[")


def escape_bracket_pairs(text: str) -> str:
    """`a[b][c]` -> `a[b]\\[c]` outside backtick code spans."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even parts lie outside code spans
        parts[i] = _PAIR.sub(lambda m: "]" + m.group(1) + "\\[", parts[i])
    return "`".join(parts)


class EscapeBracketPairs(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = escape_bracket_pairs(obj.docstring.value)
