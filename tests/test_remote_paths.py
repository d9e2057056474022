"""Runs and data on a bucket (gs://), against a local stand-in (fake_bucket.py): training, resuming,
metrics, prepare, and shards read by byte range."""

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np
import pytest
from etils import epath
from fake_bucket import fake_gcs
from fsspec.implementations.local import LocalFileSystem
from helpers import GPT2, MICRO, losses, micro_experiment

from mlra_jax import paths
from mlra_jax.data.builtin import read_corpus
from mlra_jax.data.pipeline import TokenWindows
from mlra_jax.data.prepare import prepare
from mlra_jax.data.shards import HEADER_BYTES, write_shard
from mlra_jax.generate import load_model
from mlra_jax.metrics import MetricWriter
from mlra_jax.paths import as_path
from mlra_jax.train import main as train_main
from mlra_jax.training import loop
from mlra_jax.training.loop import TrainResult, train

pytestmark = pytest.mark.slow  # trains, launches or compiles: not in the fast subset (pytest -m 'not slow')

ONE_DEVICE = jax.devices()[:1]


def _corpus_files(folder, documents=400):
    """Text files of the built-in corpus (one document each), as prepare's input."""
    folder.mkdir()
    for i, text in enumerate(read_corpus()[:documents]):
        (folder / f"doc{i:04d}.txt").write_text(text)
    return folder


def test_a_run_on_a_bucket_trains_resumes_and_writes_nothing_locally(tmp_path, monkeypatch, caplog):
    cwd, bucket = tmp_path / "cwd", tmp_path / "bucket_root" / "bucket"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # a gs:// URL taken for a local path would appear here as ./gs:/bucket/...
    source = _corpus_files(tmp_path / "text")
    data = [*GPT2, "--data.dataset=gs://bucket/data"]  # GPT-2 tokens
    with fake_gcs(tmp_path / "bucket_root"), caplog.at_level(logging.INFO, logger="mlra_jax"):
        prepare(str(source), "gs://bucket/data", "corpus", val_documents=40, shard_tokens=20_000)
        first = train(
            micro_experiment("mlra4_tiny", "--train.total_steps=8", *data), "gs://bucket/run", devices=ONE_DEVICE
        )
        assert first.step == 8
        assert "one job per workdir is your responsibility" in caplog.text  # no flock on an object store
        resumed = train(
            micro_experiment("mlra4_tiny", *data),
            "gs://bucket/run",
            devices=ONE_DEVICE,
            allow_changed=("train.total_steps",),
        )
        assert resumed.step == 12
        assert load_model("gs://bucket/run")[1] == 12  # generate reads it back
    assert "resumed from gs://bucket/run/checkpoints/8 at step 8" in caplog.text
    assert list(cwd.iterdir()) == []
    run = bucket / "run"
    assert sorted(losses(run)) == list(range(1, 13))  # each step once, the resumed ones included
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["12", "4", "8"]
    assert json.loads((run / "experiment.json").read_text())["data"]["dataset"] == "gs://bucket/data"
    events = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 2 and all(e.stat().st_size > 100 for e in events)  # one per run, written whole
    assert json.loads((bucket / "data" / "prepare.json").read_text())["tokens"]["train"] > 8 * 33 * 12

    # the same steps on the local copy of the data: the byte-range reads fed the same batches
    local = train(
        micro_experiment("mlra4_tiny", *GPT2, "--train.total_steps=8", f"--data.dataset={bucket / 'data'}"),
        tmp_path / "local_run",
        devices=ONE_DEVICE,
    )
    assert local.step == 8
    remote = {step: loss for step, loss in losses(run).items() if step <= 8}
    assert losses(tmp_path / "local_run") == remote


def test_the_cli_keeps_a_gs_workdir_a_url(tmp_path, monkeypatch, capsys):
    """`--workdir=gs://...` reached the loop as the local folder ./gs:/... before (pathlib collapses //)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(paths, "filesystem_missing", lambda scheme: None)  # gcsfs is not needed here
    given = []

    def fake_train(experiment, workdir, **options):
        given.append(workdir)
        return TrainResult(step=3, last_loss=1.0, stopped_by_signal=False)

    monkeypatch.setattr(loop, "train", fake_train)
    assert train_main(["--experiment=mlra4_tiny", "--workdir=gs://bucket/run", *MICRO]) == 0
    assert [str(w) for w in given] == ["gs://bucket/run"]
    out = capsys.readouterr().out
    assert "Checkpoints: gs://bucket/run/checkpoints; metrics: gs://bucket/run/metrics.jsonl" in out
    assert "tensorboard --logdir gs://bucket/run/tensorboard" in out
    assert list(tmp_path.iterdir()) == []


def test_an_unsupported_url_or_a_collapsed_one_is_refused(capsys):
    assert train_main(["--experiment=mlra4_tiny", "--workdir=ftp://host/run"]) == 2
    assert "ftp:// is not supported; use a local path or one of gs://" in capsys.readouterr().err
    with pytest.raises(ValueError, match="looks like a URL whose '//' pathlib.Path collapsed"):
        as_path(Path("gs://bucket/run"))  # Path("gs://b") is "gs:/b"


def test_metrics_on_a_bucket_are_rewritten_whole_at_most_every_interval_and_at_flush(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "root" / "bucket" / "run" / "metrics.jsonl"
    steps = lambda: [json.loads(line)["step"] for line in path.read_text().splitlines()]  # noqa: E731
    with fake_gcs(tmp_path / "root"):
        writer = MetricWriter("gs://bucket/run", rewrite_every_s=3600)
        writer.write(1, {"loss": 5.0})
        assert steps() == [1]  # the first record at once
        writer.write(2, {"loss": 4.0})
        writer.write(3, {"loss": float("nan")})
        assert steps() == [1]  # then at most once an interval...
        writer.flush()
        assert steps() == [1, 2, 3]  # ...and at each checkpoint
        writer.write(4, {"loss": 3.0})
        writer.close()
        assert steps() == [1, 2, 3, 4]
        resumed = MetricWriter("gs://bucket/run", rewrite_every_s=3600)
        resumed.truncate_after(2)
        assert steps() == [1, 2]
        resumed.write(3, {"loss": 2.5})
        resumed.close()
    assert steps() == [1, 2, 3] and json.loads(path.read_text().splitlines()[-1])["loss"] == 2.5
    assert not (tmp_path / "gs:").exists()


def test_prepare_replaces_a_bucket_folder_only_with_overwrite(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = _corpus_files(tmp_path / "text", documents=30)
    with fake_gcs(tmp_path / "root"):
        first = prepare(str(source), "gs://bucket/data", "a", val_documents=10, shard_tokens=50_000)
        with pytest.raises(Exception, match="is not empty"):
            prepare(str(source), "gs://bucket/data", "b", val_documents=10, shard_tokens=50_000)
        second = prepare(str(source), "gs://bucket/data", "b", val_documents=10, shard_tokens=50_000, overwrite=True)
    folder = tmp_path / "root" / "bucket"
    assert sorted(p.name for p in (folder / "data").iterdir()) == sorted([*second["shards"], "prepare.json"])
    assert set(first["shards"]).isdisjoint(second["shards"])
    assert sorted(p.name for p in folder.iterdir()) == ["data"]  # no staging or replaced folder left
    assert not (tmp_path / "gs:").exists()


class _CountingFile:
    """A file object that counts the bytes read through it."""

    def __init__(self, handle, counter):
        self.handle, self.counter = handle, counter

    def seek(self, offset, whence=0):
        return self.handle.seek(offset, whence)

    def read(self, size=-1):
        data = self.handle.read(size)
        self.counter.append(len(data))
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.close()


class _CountingFS(LocalFileSystem):
    """fsspec's local file system counting `cat_file` ranges (the path taken for gcsfs files)."""

    counter: list[int] = []

    def cat_file(self, path, start=None, end=None, **kwargs):
        data = super().cat_file(path, start, end, **kwargs)
        self.counter.append(len(data))
        return data


@pytest.mark.parametrize("reader", ["file object", "fsspec cat_file"])
def test_ranged_windows_equal_memmap_windows_and_read_only_their_bytes(tmp_path, reader):
    seq_len, vocab = 64, 50304
    root = tmp_path / "root"
    folder = root / "bucket" / "data"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    paths = []
    for i, size in enumerate([1000, 3001, 70]):  # windows of 65 tokens at multiples of 64; the last shard has 1
        paths.append(folder / f"d_train_{i:06d}.bin")
        write_shard(paths[-1], rng.integers(0, vocab, size))
    memmapped = TokenWindows(paths, seq_len, vocab)
    read: list[int] = []
    if reader == "file object":
        open_file = lambda original, path, mode: _CountingFile(original(path, mode), read)  # noqa: E731
    else:
        _CountingFS.counter = read
        open_file = lambda original, path, mode: _CountingFS(skip_instance_cache=True).open(path, mode)  # noqa: E731
    with fake_gcs(root, open_file=open_file):
        ranged = TokenWindows([epath.Path(f"gs://bucket/data/{p.name}") for p in paths], seq_len, vocab)
        assert type(ranged.shards[0]).__name__ == "RangedShard" and len(ranged) == len(memmapped) == 15 + 46 + 1
        assert read == [HEADER_BYTES] * 3  # opening checks the headers only
        read.clear()
        mine = list(range(1, len(ranged), 3))  # one host's examples
        with ThreadPoolExecutor(4) as pool:  # grain reads with several threads
            windows = list(pool.map(ranged.__getitem__, mine * 3))
    for index, window in zip(mine * 3, windows):
        np.testing.assert_array_equal(window, memmapped[index])
        assert window.dtype == memmapped[index].dtype == np.int32
    assert sorted(read) == [(seq_len + 1) * 2] * len(mine) * 3  # exactly the windows' bytes, nothing more
    assert sum(read) / 3 < sum(p.stat().st_size for p in paths) / 2  # a third of the windows: under half the bytes


def test_a_bucket_without_its_filesystem_package_is_named(monkeypatch):
    from mlra_jax.config import ConfigError

    monkeypatch.setattr(paths.importlib.util, "find_spec", lambda name: None)  # neither gcsfs nor tensorflow
    with pytest.raises(ConfigError, match=r"gs://b/run: gs:// needs the gcsfs package: pip install -e '\.\[gcs\]'"):
        paths.as_path("gs://b/run")
