"""llm.c shards, the offline GPT-2 tokenizer, prepare, and the grain pipeline, with their errors."""

import gzip
import json

import numpy as np
import pytest
from helpers import micro_experiment

from mlra_jax.config import DataConfig
from mlra_jax.data.builtin import builtin_shards
from mlra_jax.data.pipeline import TokenWindows, train_dataset, train_iterator, validation_batches
from mlra_jax.data.prepare import main as prepare_main
from mlra_jax.data.shards import HEADER_BYTES, MAGIC, DataError, find_shards, open_shard, write_shard
from mlra_jax.data.tokenizer import EOT, gpt2_tokenizer
from mlra_jax.train import main as train_main


def test_tokenizer_is_gpt2_offline():
    tokenizer = gpt2_tokenizer()
    assert tokenizer.n_vocab == 50257
    assert tokenizer.encode_ordinary("Hello world") == [15496, 995]  # GPT-2's ids
    assert tokenizer.encode("<|endoftext|>", allowed_special="all") == [EOT]


def test_shard_round_trip_and_header(tmp_path):
    tokens = np.arange(5000, dtype=np.uint16)
    path = tmp_path / "a_train_000001.bin"
    write_shard(path, tokens)
    header = np.fromfile(path, dtype=np.int32, count=3)
    assert tuple(header) == (MAGIC, 1, 5000) and path.stat().st_size == HEADER_BYTES + 10000
    np.testing.assert_array_equal(open_shard(path), tokens)


def test_wrong_magic_is_named(tmp_path):
    path = tmp_path / "bad_train_000001.bin"
    write_shard(path, np.arange(100))
    raw = bytearray(path.read_bytes())
    raw[:4] = np.int32(12345).tobytes()
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="magic number 12345 is not llm.c's 20240520"):
        open_shard(path)


def test_truncated_body_is_named(tmp_path):
    path = tmp_path / "cut_train_000001.bin"
    write_shard(path, np.arange(100))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError, match=r"promises 100 tokens \(1224 bytes\) but the file has 1214 bytes"):
        open_shard(path)


def test_missing_directory_and_pattern(tmp_path):
    with pytest.raises(DataError, match="does not exist; create it with `mlra prepare"):
        find_shards(tmp_path / "nope", "*_train_*.bin")
    (tmp_path / "other.txt").write_text("x")
    with pytest.raises(DataError, match=r"no file in .* matches '\*_train_\*.bin' \(it holds: other.txt\)"):
        find_shards(tmp_path, "*_train_*.bin")


def test_token_ids_beyond_vocab_stop_training(tmp_path, capsys):
    tokens = np.arange(4000) % 1000
    tokens[1234::16] = 50400  # in every window: the first batch already fails
    write_shard(tmp_path / "d_train_000001.bin", tokens)
    write_shard(tmp_path / "d_val_000000.bin", np.arange(4000) % 1000)
    assert (
        train_main(
            [
                "--experiment=mlra4_tiny",
                f"--workdir={tmp_path / 'run'}",
                f"--data.dataset={tmp_path}",
                "--train.seq_len=32",
                "--train.global_batch_size=8",
                "--train.total_steps=20",
                "--train.warmup_steps=2",
                "--train.eval_every=0",
            ]
        )
        == 2
    )
    error = capsys.readouterr().err
    assert "d_train_000001.bin: token id 50400 at position" in error and "is >= the model's vocab_size 50304" in error
    position = int(error.split("at position ")[1].split()[0])
    assert tokens[position] == 50400  # the position named is the offending token


def test_windows_shuffle_and_processes(tmp_path):
    write_shard(tmp_path / "d_train_000001.bin", np.arange(1000) % 50000)
    write_shard(tmp_path / "d_train_000002.bin", np.arange(1000, 1500))
    windows = TokenWindows(find_shards(tmp_path, "*_train_*.bin"), seq_len=10, vocab_size=50304)
    assert len(windows) == 99 + 49  # windows never cross shards
    np.testing.assert_array_equal(windows[99], np.arange(1000, 1011))
    cfg = DataConfig(dataset=str(tmp_path))
    first = train_dataset(cfg, 10, 50304, seed=1, local_batch=8)
    assert np.array_equal(first[3], train_dataset(cfg, 10, 50304, seed=1, local_batch=8)[3])
    assert not np.array_equal(first[3], train_dataset(cfg, 10, 50304, seed=2, local_batch=8)[3])
    halves = [train_dataset(cfg, 10, 50304, 1, 4, process_index=p, process_count=2)[3] for p in range(2)]
    as_set = lambda rows: sorted(map(tuple, rows.tolist()))
    assert as_set(np.concatenate(halves)) == as_set(first[3])  # the processes split global batch 3
    iterator = train_iterator(first, cfg)
    for _ in range(5):
        next(iterator)
    state = iterator.get_state()
    resumed = train_iterator(first, cfg)
    resumed.set_state(state)
    np.testing.assert_array_equal(next(resumed), next(iterator))
    np.testing.assert_array_equal(next(resumed), first[6])


def test_prepare_from_txt_jsonl_and_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")  # pyarrow is in the test extra
    import pyarrow as pa

    source = tmp_path / "in"
    source.mkdir()
    (source / "a.txt").write_text("Hello world")
    with gzip.open(source / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"body": "second doc"}) + "\n" + json.dumps({"body": "third"}) + "\n")
    pq.write_table(pa.table({"body": ["fourth", "fifth"]}), source / "c.parquet")
    # a .txt file is one document; the others read --text_field
    assert (
        prepare_main(
            [
                "--input",
                str(source),
                "--output",
                str(tmp_path / "out"),
                "--prefix",
                "t",
                "--val_documents",
                "1",
                "--text_field",
                "body",
            ]
        )
        == 0
    )
    val, train = open_shard(tmp_path / "out" / "t_val_000000.bin"), open_shard(tmp_path / "out" / "t_train_000001.bin")
    tokenizer = gpt2_tokenizer()
    assert val.tolist() == [EOT, 15496, 995]
    assert (
        tokenizer.decode(train.tolist()) == "<|endoftext|>second doc<|endoftext|>third<|endoftext|>fourth"
        "<|endoftext|>fifth"
    )


def test_prepare_errors(tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    assert prepare_main(["--input", str(tmp_path / "d.jsonl"), "--output", str(tmp_path / "o")]) == 2
    assert "has no field 'text' (fields: content); pass --text_field" in capsys.readouterr().err
    assert prepare_main(["--input", str(tmp_path / "missing"), "--output", str(tmp_path / "o")]) == 2


def test_prepare_splits_long_streams_into_shards(tmp_path):
    (tmp_path / "big.txt").write_text("word " * 3000)
    assert (
        prepare_main(
            [
                "--input",
                str(tmp_path / "big.txt"),
                "--output",
                str(tmp_path / "o"),
                "--val_documents",
                "0",
                "--shard_tokens",
                "1000",
            ]
        )
        == 0
    )
    shards = sorted((tmp_path / "o").glob("data_train_*.bin"))
    sizes = [open_shard(p).size for p in shards]
    expected = 1 + len(gpt2_tokenizer().encode_ordinary("word " * 3000))
    assert sizes[:-1] == [1000] * (len(sizes) - 1) and sum(sizes) == expected
    assert not list((tmp_path / "o").glob("data_val_*"))


def test_builtin_corpus():
    directory = builtin_shards()
    train = np.concatenate([open_shard(p) for p in find_shards(directory, "*_train_*.bin")])
    assert train.size > 400_000 and train.max() <= EOT and (train == EOT).sum() > 3000
    cfg = micro_experiment().data
    assert len(validation_batches(cfg, 128, 50304, 8, 4)) == 4
