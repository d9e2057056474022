"""A local stand-in for a gs:// bucket: every `gs://NAME/...` path maps to `ROOT/NAME/...`.

- etils.epath (the run's workdir, metrics, TensorBoard files, experiment.json, data, prepare's output,
  and orbax's folders and metadata): `epath.testing.mock_epath` swaps every epath backend for the os
  backend, each call mapped here.
- orbax writes array data through TensorStore, whose gcs driver talks to GCS itself, not through
  epath: `gcs_utils.get_kvstore_for_gcs` (where orbax builds the gcs kvstore spec) gives the local
  `file` driver instead, and `is_hierarchical_namespace_enabled` (a google-cloud-storage bucket
  lookup) says no.
- gcsfs, which a real bucket needs, is not required.
Nothing else is patched: the code under test sees gs:// URLs everywhere.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator
from unittest import mock

from etils.epath.testing import mock_epath
from orbax.checkpoint._src.path import gcs_utils

from mlra_jax import paths

PREFIX = "gs://"


@contextlib.contextmanager
def fake_gcs(root: Path, open_file=None) -> Iterator[None]:
    """Map gs:// to `root` for epath and orbax. `open_file(original_open, local_path, mode)`, when given,
    opens the mapped gs:// files (to count or wrap reads)."""
    root = Path(root)

    def local(path) -> str:
        path = os.fspath(path)
        return str(root / path[len(PREFIX) :]) if path.startswith(PREFIX) else path

    def url(path: str, was_url: bool) -> str:
        return PREFIX + str(Path(path).relative_to(root)) if was_url else path

    def mapped(fn, path, *args, **kwargs):
        return fn(local(path), *args, **kwargs)

    def mapped2(fn, path, dst, *args, **kwargs):
        return fn(local(path), local(dst), *args, **kwargs)

    def glob(fn, pattern):
        return [url(p, os.fspath(pattern).startswith(PREFIX)) for p in fn(local(pattern))]

    def walk(fn, top, **kwargs):
        for where, dirs, files in fn(local(top), **kwargs):
            yield url(where, os.fspath(top).startswith(PREFIX)), dirs, files

    def open_(fn, path, mode):
        if open_file is not None and os.fspath(path).startswith(PREFIX):
            return open_file(fn, local(path), mode)
        return fn(local(path), mode)

    def kvstore(path: str) -> dict:
        return {"driver": "file", "path": local(path)}

    with (
        mock_epath(
            open=open_,
            exists=mapped,
            isdir=mapped,
            listdir=mapped,
            makedirs=mapped,
            mkdir=mapped,
            remove=mapped,
            rmtree=mapped,
            stat=mapped,
            glob=glob,
            walk=walk,
            rename=mapped2,
            replace=mapped2,
            copy=mapped2,
        ),
        mock.patch.object(gcs_utils, "get_kvstore_for_gcs", kvstore),
        mock.patch.object(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False),
        mock.patch.object(paths, "filesystem_missing", lambda scheme: None),
    ):  # gcsfs is not needed here
        yield
