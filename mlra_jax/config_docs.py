"""What each configuration field means, from the comments beside and above it in config.py: one source for
`--help` (cli.fields_help) and the documentation's configuration page."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import re
import tokenize

_FIELD = re.compile(r"^\s+(\w+)\s*:")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """field name -> its help: the comment on its line, after the comment lines right above it."""
    source = inspect.getsource(cls)
    comments: dict[int, str] = {}  # line number -> comment text
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    names = {f.name for f in dataclasses.fields(cls)}
    docs: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        match = _FIELD.match(line)
        if not match or match.group(1) not in names or match.group(1) in docs:
            continue
        above, previous = [], number - 1
        while previous in comments and lines[previous - 1].lstrip().startswith("#"):
            above.insert(0, comments[previous])
            previous -= 1
        parts = above + ([comments[number]] if number in comments else [])
        docs[match.group(1)] = " ".join(parts)
    return docs
