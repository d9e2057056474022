"""Run paths: local folders and object-store URLs (gs://, s3://, ...) alike, through etils.epath.

Every path a run reads or writes (workdir, checkpoints, metrics, TensorBoard, experiment.json,
data folders, prepare's output) is made with `as_path`: a URL stays a URL (never `./gs:/bucket`),
a local path becomes absolute, as messages show it. `gs://` needs gcsfs (`pip install -e '.[gcs]'`).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

from etils import epath

from mlra_jax.config import ConfigError

SCHEMES = ("gs", "s3", "az", "hf")  # the URLs etils.epath reads and writes (through fsspec)
_FILESYSTEMS = {"gs": "gcsfs", "s3": "s3fs", "az": "adlfs", "hf": "huggingface_hub"}  # fsspec's package per scheme


def filesystem_missing(scheme: str) -> str | None:
    """The package a scheme needs when it is not installed (epath reads gs:// through TensorFlow too)."""
    package = _FILESYSTEMS[scheme]
    if importlib.util.find_spec(package) or (scheme == "gs" and importlib.util.find_spec("tensorflow")):
        return None
    return package


def is_remote(path: str | os.PathLike) -> bool:
    """True for a URL (gs://bucket/x, s3://...): an object store without append, rename or flock."""
    return "://" in os.fspath(path)


def as_path(path: str | os.PathLike) -> epath.Path:
    """`path` as an epath.Path: URLs as given, local paths absolute (`absolute()` of a URL would
    make it the local folder `./gs:/bucket/...`)."""
    if is_remote(path):
        scheme = os.fspath(path).split("://", 1)[0]
        if scheme not in SCHEMES:
            raise ConfigError(
                f"{path}: {scheme}:// is not supported; use a local path or one of "
                f"{', '.join(s + '://' for s in SCHEMES)}"
            )
        if missing := filesystem_missing(scheme):
            extra = "pip install -e '.[gcs]'" if scheme == "gs" else f"pip install {missing}"
            raise ConfigError(f"{path}: {scheme}:// needs the {missing} package: {extra}")
        return epath.Path(os.fspath(path))
    local = pathlib.Path(path)
    if local.parts and local.parts[0].removesuffix(":") in SCHEMES and local.parts[0].endswith(":"):
        raise ValueError(
            f"{path} looks like a URL whose '//' pathlib.Path collapsed to '/'; pass the URL as a string or epath.Path"
        )
    return epath.Path(local.absolute())


def local_path(path: str | os.PathLike) -> pathlib.Path:
    """The local file system path of a non-URL path (for memmap, flock)."""
    if is_remote(path):
        raise ValueError(f"{path} is not a local path")
    return pathlib.Path(os.fspath(path))
