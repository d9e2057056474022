"""JAX's persistent compilation cache for training runs.

With it a restarted or resumed run loads its compiled steps instead of compiling them again (on GPUs
XLA's autotuning results too), and the step that `remat=auto` compiles to confirm its choice is the one
the trainer then runs. Entries are keyed by the program, the compiler options and the JAX version, so a
changed model or flag compiles anew. Only compilations of at least a second are kept (JAX's
`jax_persistent_cache_min_compile_time_secs`).

The directory is `$XDG_CACHE_HOME/mlra_jax/xla` (`~/.cache/mlra_jax/xla`);
`MLRA_JAX_COMPILATION_CACHE=DIR` chooses another and `MLRA_JAX_COMPILATION_CACHE=0` turns it off. A
cache directory set for JAX itself (`JAX_COMPILATION_CACHE_DIR`) is kept. Within `repairing` (the train command),
damaged entries are replaced and an error a loaded entry causes names the cache.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

VARIABLE = "MLRA_JAX_COMPILATION_CACHE"
JAX_VARIABLE = "JAX_COMPILATION_CACHE_DIR"
log = logging.getLogger(__name__)


def default_directory(environ: Mapping[str, str]) -> Path:
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlra_jax" / "xla"


def chosen_directory(environ: Mapping[str, str], configured: str | None) -> str | None:
    """The cache directory to set for JAX: None when JAX already has one (`configured`, or JAX_VARIABLE in
    `environ`) or VARIABLE is "0"; else VARIABLE's directory or default_directory."""
    if configured or environ.get(JAX_VARIABLE):
        return None
    chosen = environ.get(VARIABLE, "")
    if chosen == "0":
        return None
    return os.path.expanduser(chosen) if chosen else str(default_directory(environ))


def enable_compilation_cache() -> str | None:
    """Point JAX's persistent compilation cache at chosen_directory (before the first compilation); the
    directory JAX then uses, None when the cache is off."""
    import jax

    configured = jax.config.jax_compilation_cache_dir
    directory = chosen_directory(os.environ, configured)
    if directory is not None:
        jax.config.update("jax_compilation_cache_dir", directory)
        return directory
    return configured or os.environ.get(JAX_VARIABLE) or None


class CompilationCacheError(RuntimeError):
    """A program loaded from the compilation cache failed its checks (a damaged or swapped entry); the entry is
    removed, so the same command compiles it anew."""


OFF = f"{VARIABLE}=0 turns the cache off"
_HIT = re.compile(r"Persistent compilation cache hit for '([^']+)'(?: with key '([^']+)')?")
_MISS = re.compile(r"PERSISTENT COMPILATION CACHE MISS for '([^']+)' with key '([^']+)'")
# JAX's warning when an entry cannot be read (it then compiles, but keeps the entry) or written (a full disk
# leaves it truncated); the name is a module ("jit_step") or a key ("jit_step-<hash>")
_ENTRY_ERROR = re.compile(r"Error (reading|writing) persistent compilation cache entry for '([^']+)': (.*)", re.S)
_JAX_FRAMES = "JAX has removed its internal frames"


def _entries(directory: Path, name: str) -> list[Path]:
    """The files of the entries of `name` (a module: all of its keys; a key; "": all) in `directory`."""
    try:
        return [
            p
            for p in directory.iterdir()
            if p.name.startswith(f"{name}-" if name else "") and p.name.endswith(("-cache", "-atime"))
        ]
    except OSError:
        return []


def _remove(paths: list[Path]) -> str | None:
    """Remove `paths`; the first error as text, None when all are gone."""
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError as err:
            return f"{type(err).__name__}: {err}"
    return None


def _raised_in_jax(err: BaseException) -> bool:
    """Whether `err` was raised inside JAX (whose tracebacks hide its own frames behind a note or a cause)."""
    if any(_JAX_FRAMES in note for note in getattr(err, "__notes__", ())):
        return True
    tb = (err.__cause__ if type(err.__cause__).__name__ == "UnfilteredStackTrace" else err).__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and f"{os.sep}jax{os.sep}" in tb.tb_frame.f_code.co_filename


class _Repair(logging.Filter):
    """Watches JAX's compiler log (which entry each compile loaded or missed) and its warnings about entries that
    cannot be read or written, and removes those entries (see `repairing`)."""

    def __init__(self, directory: Path, threshold: int):
        super().__init__()
        self.directory, self.threshold = directory, threshold
        self.loaded: str | None = None  # the key the latest compile loaded (None: it compiled)
        self.unreadable: dict[str, str] = {}  # module -> the read error, until its key is known
        self.missed: dict[str, str] = {}  # module -> the key of its latest compile that missed

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if hit := _HIT.match(message):
            self.loaded = hit.group(2) or hit.group(1)
        elif miss := _MISS.match(message):
            self.loaded, self.missed[miss.group(1)] = None, miss.group(2)
            if miss.group(1) in self.unreadable:  # before JAX compiles and writes the entry anew
                self._replace(miss.group(2), "read", self.unreadable.pop(miss.group(1)))
        return record.levelno >= self.threshold  # the debug lines JAX would not have shown stay hidden

    def show(self, message: Warning | str) -> bool:
        """Handle JAX's warning about an entry (True), or leave `message` to be shown (False)."""
        error = _ENTRY_ERROR.match(str(message))
        if error is None:
            return False
        action, name, reason = error.groups()
        if action == "writing":  # a full disk leaves a truncated entry
            self._replace(self.missed.get(name, name), "written", reason)
        elif re.search(r"-[0-9a-f]{16,}$", name):  # a key
            self._replace(name, "read", reason)
        else:  # its key comes with JAX's miss line, before JAX compiles and writes the entry
            self.unreadable[name] = reason
        return True

    def _replace(self, name: str, action: str, reason: str) -> None:
        entries = _entries(self.directory, name)
        failed = _remove(entries)
        what = f"the compilation cache entry {name} in {self.directory} could not be {action} ({reason.strip()})"
        if failed:
            log.warning("%s nor removed (%s): remove it, or set %s=0", what, failed, VARIABLE)
        elif not entries:
            log.warning("%s (%s)", what, OFF)
        else:
            log.warning("%s; removed it, so it is compiled and written anew (%s)", what, OFF)

    def finish(self) -> None:
        """Entries that failed to load and whose key JAX did not log: all entries of their module go."""
        for module, reason in self.unreadable.items():
            self._replace(module, "read", reason)
        self.unreadable.clear()

    def blame(self, err: Exception) -> CompilationCacheError | None:
        """The error naming the cache when `err` came from the program the latest compile loaded from it (JAX's
        checks of a damaged or swapped entry: "AssertionError: (51, 48)"), after removing the cache's entries (an
        entry holding another key's program leaves none of them trusted); else None."""
        names = {cls.__name__ for cls in type(err).__mro__}
        if self.loaded is None or names & {"JaxRuntimeError", "XlaRuntimeError"} or not _raised_in_jax(err):
            return None
        entries = _entries(self.directory, "")
        failed = _remove(entries)
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        what = (
            f"the program {self.loaded} loaded from the compilation cache {self.directory} fails JAX's checks "
            f"({type(err).__name__}{': ' + first[:200] if first else ''}): its entries are damaged or swapped"
        )
        if failed:
            return CompilationCacheError(
                f"{what}, and could not be removed ({failed}): remove them, or set {VARIABLE}=0"
            )
        return CompilationCacheError(
            f"{what}; removed its {sum(p.name.endswith('-cache') for p in entries)} entries: run the same command "
            f"again to compile anew ({OFF})"
        )


@contextlib.contextmanager
def repairing(directory: str | None) -> Iterator[None]:
    """Within it, cache entries in `directory` that JAX cannot read are removed before JAX compiles them again (so
    its compile writes a good entry; JAX itself keeps the damaged one), entries it could not write whole (a full
    disk) are removed, and an error of a program loaded from the cache (a swapped entry) removes that entry and
    becomes a CompilationCacheError naming the cache and VARIABLE=0. Each is one warning line, instead of JAX's."""
    if not directory or "://" in directory:
        yield
        return
    logger = logging.getLogger("jax._src.compiler")
    repair, level = _Repair(Path(directory), logger.getEffectiveLevel()), logger.level
    with warnings.catch_warnings():
        warnings.filterwarnings("always", message="Error (reading|writing) persistent compilation cache")
        shown = warnings.showwarning
        warnings.showwarning = lambda message, *args, **kwargs: repair.show(message) or shown(message, *args, **kwargs)
        logger.addFilter(repair)
        logger.setLevel(logging.DEBUG)  # the filter sees the hit and miss lines; it drops what was hidden
        try:
            yield
        except Exception as err:
            blamed = repair.blame(err)
            if blamed is None:
                raise
            raise blamed from err
        finally:
            logger.removeFilter(repair)
            logger.setLevel(level)
            repair.finish()
