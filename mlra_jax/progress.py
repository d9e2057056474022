"""What a person watching a run sees: the library's log lines on stdout, and a progress bar where one draws.

Python shows a library's INFO lines only once something configures logging; a run started from a notebook
or a script (`train()` called directly) would otherwise print nothing but warnings. `show_library_logs`
makes them visible exactly once, and `configure_cli_logging` is the entry points' setup.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from typing import Any, TextIO

LIBRARY_LOGGER = "mlra_jax"
LINE_FORMAT = "%(asctime)s %(levelname)s %(message)s"


class _CurrentStdoutHandler(logging.StreamHandler):
    """A stream handler that writes to whatever sys.stdout is at each record: a notebook kernel or a test
    replaces sys.stdout after the handler was made."""

    @property
    def stream(self) -> TextIO:  # type: ignore[override]
        return sys.stdout

    @stream.setter
    def stream(self, value: TextIO) -> None:  # StreamHandler.__init__ assigns it; sys.stdout is always used
        pass


def _unconfigured_root() -> bool:
    """Whether the root logger has only what a bare `logging.basicConfig()` leaves (or nothing): absl calls
    it the first time it logs (orbax does at import), so such a handler says nobody chose where lines go."""
    return all(
        type(h) is logging.StreamHandler
        and h.stream in (sys.stderr, sys.__stderr__)
        and h.formatter is not None
        and h.formatter._fmt == logging.BASIC_FORMAT
        for h in logging.getLogger().handlers
    )


def show_library_logs() -> None:
    """Make the library's INFO lines (a run's step lines among them) appear once, on stdout.

    The library's logger gets level INFO unless someone set its level. When logging was configured (an
    entry point's `configure_cli_logging`, an application, pytest), its handlers print the lines; when it
    was not (a plain script or a notebook), the library's logger gets a stdout handler of its own and stops
    passing records to the root logger's default stderr handler, so no line is printed twice. Calling it
    again changes nothing. Quiet a run with `logging.getLogger("mlra_jax").setLevel(logging.WARNING)`."""
    logger = logging.getLogger(LIBRARY_LOGGER)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if logger.handlers or not _unconfigured_root():  # ours from an earlier call, or someone's choice
        return
    handler = _CurrentStdoutHandler()
    handler.setFormatter(logging.Formatter(LINE_FORMAT))
    logger.addHandler(handler)
    logger.propagate = False


def configure_cli_logging(library_level: int = logging.INFO) -> None:
    """Every command's logging: one handler on stdout with timestamps, other libraries (orbax, grain) at WARNING,
    absl at ERROR, the library at `library_level`; where no bar draws (a log file, a pipe), no library's progress
    bar (TQDM_DISABLE, HF_HUB_DISABLE_PROGRESS_BARS, unless set)."""
    root = logging.getLogger()
    if _unconfigured_root():  # absl's implicit basicConfig (orbax logs at import) is nobody's choice: replace it
        for handler in list(root.handlers):
            root.removeHandler(handler)
    logging.basicConfig(level=logging.WARNING, format=LINE_FORMAT, stream=sys.stdout)
    if not bars_drawn():  # a log file or a pipe: no other library's progress bars either (tqdm, Hugging Face)
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.getLogger("absl").setLevel(logging.ERROR)
    logging.getLogger(LIBRARY_LOGGER).setLevel(library_level)


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (Jupyter, JupyterLab, Colab, VS Code)."""
    return "ipykernel.zmqshell" in sys.modules


def bars_drawn() -> bool:
    """Whether a progress bar draws here: on an interactive terminal or in a notebook that draws widgets, not into a
    log file, a pipe or a notebook without ipywidgets (where its redraws would be written as lines)."""
    return sys.stderr.isatty() or (in_notebook() and importlib.util.find_spec("ipywidgets") is not None)


def progress_bar(total: int, initial: int) -> Any:
    """A tqdm bar (steps done, the time left, and the loss and tokens/s of the last step line) on an interactive
    terminal, a tqdm.auto (widget) bar in a notebook that can draw widgets; None elsewhere (log files, pipes,
    notebooks without ipywidgets): the step lines show progress there."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, desc="training")
    if in_notebook() and importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, unit="step", desc="training")
    return None
