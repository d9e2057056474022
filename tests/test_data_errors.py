"""prepare never leaves a mixed or partial shard folder, and bad inputs, unreadable shards and a full disk are
named with the fix (exit 2) instead of a traceback."""

import errno
import gzip
import json
import re

import numpy as np
import pytest
from helpers import MICRO

from mlra_jax.data import prepare as prepare_module
from mlra_jax.data.prepare import main as prepare_main
from mlra_jax.data.shards import DataError, find_shards, open_shard, write_shard
from mlra_jax.train import main as train_main


def prepared(tmp_path, text="one two three", *extra):
    (tmp_path / "in.txt").write_text(text)
    return prepare_main(
        ["--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out"), "--val_documents", "0", *extra]
    )


def test_prepare_records_a_marker_and_refuses_a_used_folder_without_overwrite(tmp_path, capsys):
    assert prepared(tmp_path, "word " * 300, "--shard_tokens", "100") == 0
    marker = json.loads((tmp_path / "out" / "prepare.json").read_text())
    assert marker["inputs"] == [str(tmp_path / "in.txt")] and marker["documents"] == {"val": 0, "train": 1}
    assert sum(marker["shards"].values()) == marker["tokens"]["train"] == 302 and len(marker["shards"]) == 4
    before = sorted(p.name for p in (tmp_path / "out").iterdir())

    assert prepared(tmp_path, "short") == 2  # would leave three old shards beside the new one
    err = capsys.readouterr().err
    assert "is not empty (it holds data_train_000000.bin" in err and "pass --overwrite" in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == before

    assert prepared(tmp_path, "short", "--overwrite") == 0  # the old shards are gone, not mixed in
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["data_train_000000.bin", "prepare.json"]
    (tmp_path / "out" / "notes.md").write_text("mine")
    assert prepared(tmp_path, "short", "--overwrite") == 2
    assert "also holds notes.md" in capsys.readouterr().err
    assert (tmp_path / "out" / "notes.md").read_text() == "mine"


def test_an_interrupted_prepare_leaves_the_output_as_it_was(tmp_path, monkeypatch):
    assert prepared(tmp_path, "first version") == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    real = prepare_module.write_shard
    calls = []

    def dies_on_the_second_shard(path, tokens):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a kill between shards
        real(path, tokens)

    monkeypatch.setattr(prepare_module, "write_shard", dies_on_the_second_shard)
    assert prepared(tmp_path, "word " * 300, "--shard_tokens", "100", "--overwrite") == 130  # "interrupted"
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out"]  # no partial folder left behind


def test_shards_not_listed_in_the_marker_are_not_mixed_in(tmp_path):
    assert prepared(tmp_path) == 0
    write_shard(tmp_path / "out" / "data_train_000007.bin", np.arange(10))  # left by someone else
    with pytest.raises(DataError, match="data_train_000007.bin match .* were not written by the prepare"):
        find_shards(tmp_path / "out", "*_train_*.bin")


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.txt", b"caf\xe9 au lait", r"bad.txt: not UTF-8 text \(byte 3: invalid continuation byte\); convert it"),
        ("blob.txt", b"\x7fELF\x00\x01\x02", "blob.txt: holds NUL bytes, so it is binary"),
        (
            "docs.jsonl",
            b'{"text": "ok"}\n{"text": "broken\n',
            r"docs.jsonl:2: not valid JSON \(Invalid control character at, column 17\)",
        ),
        ("docs.jsonl", b'{"text": "ok"}\n\n["a list"]\n', r"docs.jsonl:3: a JSON list, not an object"),
        ("docs.jsonl", b'{"text": 7}\n', r"docs.jsonl:1: field 'text' is a int, not text"),
        ("docs.jsonl", b'{"text": "ok"}\n{"text": "\xff"}\n', r"docs.jsonl:2: not UTF-8"),
        ("docs.jsonl.gz", b"not gzip at all", "docs.jsonl.gz: not a complete gzip file"),
        (
            "cut.jsonl.gz",
            gzip.compress(b'{"text": "a long enough document"}\n' * 50, mtime=0)[:40],
            "not a complete gzip file",
        ),
    ],
)
def test_prepare_names_the_file_and_line_of_bad_input(tmp_path, capsys, name, content, message):
    (tmp_path / name).write_bytes(content)
    assert prepare_main(["--input", str(tmp_path / name), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_a_full_disk_during_prepare_is_named_and_leaves_no_partial_output(tmp_path, monkeypatch, capsys):
    def full(path, tokens):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(prepare_module, "write_shard", full)
    assert prepared(tmp_path) == 2
    assert "no space left on the disk of" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_a_folder_named_like_a_shard_and_an_unreadable_shard_are_named(tmp_path, monkeypatch):
    (tmp_path / "data_train_000001.bin").mkdir()
    with pytest.raises(DataError, match="data_train_000001.bin match the shard pattern .* but are folders"):
        find_shards(tmp_path, "*_train_*.bin")
    with pytest.raises(DataError, match="is a folder, not a token shard"):
        open_shard(tmp_path / "data_train_000001.bin")
    write_shard(tmp_path / "data_val_000000.bin", np.arange(10))

    def unreadable(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(np, "fromfile", unreadable)  # the tests run as root, where chmod 000 still reads
    with pytest.raises(DataError, match=r"data_val_000000.bin: cannot be read \(Permission denied\)"):
        open_shard(tmp_path / "data_val_000000.bin")


@pytest.mark.slow  # a short training run
def test_a_full_disk_during_training_is_one_clear_line(tmp_path, monkeypatch, capsys):
    from mlra_jax import checkpoint

    def full(self, step, state, metadata):
        try:
            raise OSError(errno.ENOSPC, "No space left on device", f"{self.directory}/{step}")
        except OSError as err:
            raise RuntimeError("the async writer failed") from err  # as libraries wrap it

    monkeypatch.setattr(checkpoint.Checkpointer, "save", full)
    code = train_main(
        ["--experiment=mlra4_tiny", f"--workdir={tmp_path}", *MICRO, "--train.total_steps=4", "--train.eval_every=0"]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "no space left on the device while writing" in err and "checkpoints/4" in err
    assert "run the same command again" in err


def test_an_empty_eval_file_is_named_not_a_traceback(tmp_path):
    """A held-out file of no tokens (training's --train.eval_sets and eval ppl read it the same way)."""
    from mlra_jax.data.pipeline import eval_windows

    write_shard(tmp_path / "empty.bin", np.zeros(0, np.int32))
    with pytest.raises(DataError, match="empty.bin holds 0 tokens, fewer than one batch"):
        eval_windows(tmp_path / "empty.bin", 16, 100, 2)


def test_a_full_disk_under_orbax_is_one_line_naming_the_folder_and_its_free_space(tmp_path):
    """TensorStore (Orbax's writer) reports a full disk as a RESOURCE_EXHAUSTED status in a ValueError, no OSError."""
    from mlra_jax.command import exit_code

    folder = tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp"
    store = ValueError(
        f'RESOURCE_EXHAUSTED: Error writing "d/8f2c" in OCDBT database at local file "{folder}/state/": '
        "[OS error 28: No space left on device]"
    )
    assert exit_code(RuntimeError("the async writer failed"))[0] == 1  # alone: no disk named
    try:
        raise RuntimeError("the async writer failed") from store
    except RuntimeError as err:
        code, message = exit_code(err)
    assert code == 2 and "\n" not in message and f"no space left on the device while writing {folder}/state/" in message
    assert f"MiB free in {tmp_path}" in message and "run the same command again" in message
