"""One exit-code map for every command (`@command` on each `main`):

  0  done
  2  bad input, or a run that cannot continue as asked: one line `error: ...` that names the file, field or
     value and the fix (the library's errors: ConfigError and its kind, DataError, CheckpointError, ...;
     a full disk; a path that is missing, unreadable or in the way)
  3  training diverged (a NaN or inf loss): nothing after the last good checkpoint was saved
  1  an unexpected failure: one line, and the traceback only with --debug or MLRA_JAX_DEBUG=1
130  interrupted (Ctrl-C)
"""

from __future__ import annotations

import errno
import functools
import os
import re
import shutil
import sys
from typing import Callable

DEBUG_VARIABLE = "MLRA_JAX_DEBUG"
# The library's errors that mean bad input or a run that cannot continue (by class name: their modules
# import JAX and Orbax, which a command need not load to report one)
BAD_INPUT = frozenset(
    {
        "ConfigError",
        "InputError",
        "DataError",
        "CheckpointError",
        "GenerationError",
        "StateDictError",
        "ReferenceFileError",
        "MetricsFileError",
        "KernelUnavailable",
        "AnchorFileError",
        "CompilationCacheError",
    }
)
PATH_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


# How TensorStore (Orbax's writer) reports a full disk: a status text, not an OSError
_STORE_FULL = re.compile(r"RESOURCE_EXHAUSTED: Error writing|OS error 28\b|No space left on device")
_QUOTED_PATH = re.compile(r'"(/[^"]+)"')


def disk_full(err: BaseException) -> OSError | None:
    """The out-of-space OSError behind `err` (libraries such as Orbax wrap their writer threads' errors; TensorStore's
    RESOURCE_EXHAUSTED write errors become one, with the first path their text names)."""
    for e in _chain(err):
        if isinstance(e, OSError) and (e.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(e)):
            return e
    for e in _chain(err):
        if _STORE_FULL.search(str(e)):
            path = _QUOTED_PATH.search(str(e))
            return OSError(errno.ENOSPC, "No space left on device", path.group(1) if path else None)
    return None


def free_space(path: str | None) -> str:
    """' (N MiB free there)' for the nearest existing folder of `path`; '' when it cannot be told."""
    folder = os.path.abspath(path or ".")
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        return f"; {shutil.disk_usage(folder).free / 2**20:,.0f} MiB free in {folder}"
    except OSError:
        return ""


def _chain(err: BaseException):
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]


def exit_code(err: BaseException) -> tuple[int, str]:
    """(exit code, one-line message) for an error that ended a command."""
    names = {cls.__name__ for cls in type(err).__mro__}
    if "TrainingDiverged" in names:
        return 3, str(err)
    if names & BAD_INPUT:
        return 2, str(err)
    full = disk_full(err)
    if full is not None:
        return 2, (
            f"no space left on the device while writing {full.filename or 'the output'} ({full.strerror}"
            f"{free_space(full.filename)}); free space there and run the same command again (a run resumes from "
            f"its newest complete checkpoint)"
        )
    path_error = next((e for e in _chain(err) if isinstance(e, PATH_ERRORS)), None)
    if path_error is not None:
        where = path_error.filename or "a path"
        return 2, f"{where}: {path_error.strerror or path_error}; check the path and its permissions"
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return 1, (
        f"unexpected {type(err).__name__}{': ' + first[:300] if first else ''} (run with --debug or "
        f"{DEBUG_VARIABLE}=1 for the traceback)"
    )


def command(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """`main(argv) -> exit code` with the exit-code map above; `--debug` (anywhere in argv) or MLRA_JAX_DEBUG=1
    lets an error raise with its traceback instead."""

    @functools.wraps(main)
    def wrapped(argv: list[str] | None = None) -> int:
        argv = list(sys.argv[1:] if argv is None else argv)
        debug = "--debug" in argv or os.environ.get(DEBUG_VARIABLE, "") not in ("", "0")
        argv = [a for a in argv if a != "--debug"]
        try:
            return main(argv)
        except KeyboardInterrupt:
            if debug:
                raise
            print("interrupted", file=sys.stderr)
            return 130
        except Exception as err:  # noqa: BLE001 - the point: one line and a code, not a traceback
            if debug:
                raise
            code, message = exit_code(err)
            print(f"error: {message}", file=sys.stderr)
            return code

    return wrapped
