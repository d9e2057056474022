"""JAX's persistent compilation cache for training runs.

With it a restarted or resumed run loads its compiled steps instead of compiling them again (on GPUs
XLA's autotuning results too), and the step that `remat=auto` compiles to confirm its choice is the one
the trainer then runs. Entries are keyed by the program, the compiler options and the JAX version, so a
changed model or flag compiles anew. Only compilations of at least a second are kept (JAX's
`jax_persistent_cache_min_compile_time_secs`).

The directory is `$XDG_CACHE_HOME/mlra_jax/xla` (`~/.cache/mlra_jax/xla`);
`MLRA_JAX_COMPILATION_CACHE=DIR` chooses another and `MLRA_JAX_COMPILATION_CACHE=0` turns it off. A
cache directory set for JAX itself (`JAX_COMPILATION_CACHE_DIR`) is kept.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

VARIABLE = "MLRA_JAX_COMPILATION_CACHE"
JAX_VARIABLE = "JAX_COMPILATION_CACHE_DIR"


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
