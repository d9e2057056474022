"""prepare under "never lose a run": one prepare at a time per --output (two real processes), options and inputs
that would loop forever or write an empty corpus are refused with nothing written, bad parquet texts are named, and
a shard replaced after prepare is refused by training (size always, sha256 on request)."""

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mlra_jax.config import DataConfig
from mlra_jax.data import prepare as prepare_module
from mlra_jax.data.pipeline import eval_windows, train_dataset, validation_batches
from mlra_jax.data.prepare import main as prepare_main
from mlra_jax.data.prepare import prepare
from mlra_jax.data.shards import HEADER_BYTES, VERIFY_VARIABLE, DataError, find_shards, open_shard, write_shard
from mlra_jax.data.tokenizer import gpt2_tokenizer

ROOT = Path(__file__).parent.parent


def listing(folder: Path) -> dict[str, bytes | None]:
    """Every file and folder under `folder` (hidden ones too), with the files' contents."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def run(source, out, *options) -> int:
    return prepare_main(["--input", str(source), "--output", str(out), "--val_documents", "0", *options])


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def text_of(folder: Path, kind: str = "train") -> str:
    return gpt2_tokenizer().decode([int(t) for p in find_shards(folder, f"*_{kind}_*.bin") for t in open_shard(p)])


# 1. Two prepares into one --output


def test_a_second_prepare_into_the_same_output_is_refused_while_the_first_runs(tmp_path):
    """Process A holds the output's lock while it waits for its input (a FIFO); process B, started then, is refused
    with exit 2 and writes nothing; A's folder holds A's shards only."""
    fifo, other, out = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "out"
    os.mkfifo(fifo)
    other.write_text("the second input")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    command = [sys.executable, "-m", "mlra_jax.data.prepare", "--val_documents", "0", "--output", str(out)]
    first = subprocess.Popen([*command, "--input", str(fifo)], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60

    def wait_for(done) -> None:
        while not done():
            if first.poll() is not None or time.monotonic() > deadline:
                first.kill()
                pytest.fail(f"the first prepare ended or hung: {first.communicate()[1]}")
            time.sleep(0.05)

    try:
        lock = tmp_path / ".out.lock"
        wait_for(lambda: lock.exists() and f"pid {first.pid}" in lock.read_text())
        second = subprocess.run(
            [*command, "--input", str(other), "--overwrite"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
        holder = f"host {os.uname().nodename} pid {first.pid}"
        assert f"another prepare ({holder}) is writing --output {out}" in second.stderr
        assert "Nothing was written" in second.stderr
        writer = []

        def reading() -> bool:  # A opened its input: feed it
            try:
                writer.append(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                return False
            return True

        wait_for(reading)
        os.write(writer[0], b"the first input")
        os.close(writer[0])
        assert first.wait(timeout=60) == 0, first.communicate()[1]
    finally:
        if first.poll() is None:
            first.kill()
        first.communicate()
    assert text_of(out) == "<|endoftext|>the first input"
    marker = json.loads((out / "prepare.json").read_text())
    assert marker["inputs"] == [str(fifo)] and sorted(p.name for p in out.iterdir()) == [
        *marker["shards"],
        "prepare.json",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "out"]  # no staging or lock left

    assert run(other, out, "--overwrite") == 0  # afterwards it replaces the folder whole
    assert text_of(out) == "<|endoftext|>the second input"


def test_a_killed_prepare_leaves_no_lock_and_its_staging_is_removed(tmp_path):
    """After a kill: the lock file stays but no process holds its lock (the kernel released it), and the staging
    folder of the killed run stays; the next prepare runs, removes both, and never mixes the old shards in."""
    (tmp_path / "in.txt").write_text("new text")
    (tmp_path / ".out.lock").write_text("host gone pid 1\n")
    for staging in (".out.partial", ".out.partial-123-0a1b2c3d", ".outer.partial-5-0a1b2c3d"):
        (tmp_path / staging).mkdir()
        write_shard(tmp_path / staging / "data_train_000007.bin", np.arange(50))
    assert run(tmp_path / "in.txt", tmp_path / "out") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [".outer.partial-5-0a1b2c3d", "in.txt", "out"]  # outer's
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["data_train_000000.bin", "prepare.json"]


def test_prepares_on_a_bucket_stage_under_names_of_their_own(tmp_path, monkeypatch):
    """An object store has no lock: another run's staging is left alone and never mixed in, and a folder another run
    finished meanwhile is kept, not merged with this run's shards."""
    from fake_bucket import fake_gcs

    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.txt").write_text("bucket text")
    bucket = tmp_path / "root" / "bucket"
    other = bucket / ".data.partial-99-0000"  # a run on another host, still writing
    other.mkdir(parents=True)
    write_shard(other / "data_train_000005.bin", np.arange(50))
    with fake_gcs(tmp_path / "root"):
        record = prepare(str(tmp_path / "in.txt"), "gs://bucket/data", "data", 0, 1000)
    assert sorted(p.name for p in (bucket / "data").iterdir()) == [*record["shards"], "prepare.json"]
    assert sorted(p.name for p in bucket.iterdir()) == [".data.partial-99-0000", "data"]

    real = prepare_module.iter_documents

    def another_run_finishes_first(*args):
        (bucket / "late").mkdir()
        write_shard(bucket / "late" / "data_train_000000.bin", np.arange(20))
        yield from real(*args)

    monkeypatch.setattr(prepare_module, "iter_documents", another_run_finishes_first)
    before = listing(bucket)
    with fake_gcs(tmp_path / "root"), pytest.raises(DataError, match="another prepare wrote --output gs://bucket/late"):
        prepare(str(tmp_path / "in.txt"), "gs://bucket/late", "data", 0, 1000)
    after = listing(bucket)
    assert sorted(p.name for p in bucket.iterdir()) == [".data.partial-99-0000", "data", "late"]  # no staging left
    assert sorted(p.name for p in (bucket / "late").iterdir()) == ["data_train_000000.bin"]  # the other run's only
    assert {k: v for k, v in after.items() if not k.startswith("late")} == before


# 2. and 5. Options that would loop forever or raise


@pytest.mark.parametrize(
    "options, message",
    [
        (["--shard_tokens", "0"], "argument --shard_tokens: '0' is not a whole number >= 1"),
        (["--shard_tokens", "-5"], "argument --shard_tokens: '-5' is not a whole number >= 1"),
        (["--val_documents", "-1"], "argument --val_documents: '-1' is not a whole number >= 0"),
        (["--max_tokens", "1e999"], "argument --max_tokens: '1e999' is not a whole number >= 1"),
    ],
)
def test_bad_counts_are_refused_before_anything_is_written(tmp_path, capsys, options, message):
    (tmp_path / "in.txt").write_text("some text")
    with pytest.raises(SystemExit) as exit_:
        run(tmp_path / "in.txt", tmp_path / "out", *options)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


@pytest.mark.parametrize("option, value", [("shard_tokens", 0), ("val_documents", -1), ("every", 0)])
def test_the_library_refuses_bad_counts_too(tmp_path, option, value):
    (tmp_path / "in.txt").write_text("some text")
    counts = {"val_documents": 0, "shard_tokens": 10, option: value}
    with pytest.raises(DataError, match=f"--{option} {value} is not allowed: give a whole number >= "):
        prepare(str(tmp_path / "in.txt"), tmp_path / "out", "data", **counts)
    with pytest.raises(DataError, match="--shard_tokens 0 is not allowed"):
        prepare_module.write_token_shards(gpt2_tokenizer(), ["text"], tmp_path / "direct", "d", shard_tokens=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


# 3. Inputs with no text


def _parquet(path: Path, texts: list) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"text": texts}), path)


@pytest.mark.parametrize(
    "name, content, options, message",
    [
        ("empty.txt", "", [], "empty.txt: its only document has no text"),
        ("blank.txt", " \n\t\n", [], "blank.txt: its only document has no text"),
        ("empty.jsonl", "", [], "holds no documents"),
        ("blank.jsonl", "\n  \n\n", [], "holds no documents"),
        ("fields.jsonl", '{"text": ""}\n{"text": "   "}\n{"text": null}\n', [], "all 3 documents read have no text"),
        ("nulls.parquet", [None, None], [], "all 2 documents read have no text"),
        (
            "two.jsonl",
            '{"text": "a"}\n{"text": "b"}\n',
            ["--skip_documents", "2"],
            "--skip_documents 2 is past the end",
        ),
    ],
)
def test_an_input_with_no_text_is_an_error_and_writes_nothing(tmp_path, capsys, name, content, options, message):
    source = tmp_path / "in" / name
    source.parent.mkdir()
    _parquet(source, content) if name.endswith(".parquet") else source.write_text(content)
    assert run(source, tmp_path / "out", *options) == 2
    err = one_error_line(capsys)
    assert message in err and "Nothing was written" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]

    (tmp_path / "good.txt").write_text("the old corpus")
    assert run(tmp_path / "good.txt", tmp_path / "out") == 0
    before = listing(tmp_path)
    assert run(source, tmp_path / "out", "--overwrite", *options) == 2  # a prepared folder is kept as it was
    assert listing(tmp_path) == before


def test_documents_with_no_text_are_skipped_and_counted(tmp_path, capsys):
    lines = ['{"text": "first"}', '{"text": ""}', '{"text": null}', '{"text": " \\n "}', '{"text": "second"}']
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    assert (
        prepare_main(["--input", str(tmp_path / "d.jsonl"), "--output", str(tmp_path / "out"), "--val_documents", "1"])
        == 0
    )
    assert "1 validation and 1 training documents (3 with no text skipped)" in capsys.readouterr().out
    assert text_of(tmp_path / "out", "val") == "<|endoftext|>first"
    assert text_of(tmp_path / "out") == "<|endoftext|>second"
    marker = json.loads((tmp_path / "out" / "prepare.json").read_text())
    assert marker["documents"] == {"val": 1, "train": 1} and marker["empty_documents_skipped"] == 3


def test_an_all_validation_folder_says_it_serves_evaluation_only(tmp_path, capsys):
    (tmp_path / "in.txt").write_text("only one document")
    assert prepare_main(["--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out")]) == 0
    assert "note: all documents went to the validation shards (--val_documents 1000)" in capsys.readouterr().out


# 5. Parquet texts


def test_parquet_null_texts_are_skipped_and_other_types_named(tmp_path, capsys):
    _parquet(tmp_path / "nulls.parquet", ["one", None, "two", None])
    assert run(tmp_path / "nulls.parquet", tmp_path / "out") == 0
    assert "(2 with no text skipped)" in capsys.readouterr().out
    assert text_of(tmp_path / "out") == "<|endoftext|>one<|endoftext|>two"

    _parquet(tmp_path / "numbers.parquet", [None, 7, 8])
    assert run(tmp_path / "numbers.parquet", tmp_path / "bad") == 2
    err = one_error_line(capsys)
    assert f"{tmp_path / 'numbers.parquet'}: row 1 (counting from 0) of column 'text' is a int, not text" in err
    assert "pass the text column as --text_field" in err
    assert not (tmp_path / "bad").exists()


# 4. Shards replaced after prepare


@pytest.fixture
def prepared(tmp_path) -> Path:
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"text": f"document number {i} " * 20}) + "\n" for i in range(12))
    )
    assert (
        prepare_main(
            [
                "--input",
                str(tmp_path / "in.jsonl"),
                "--output",
                str(tmp_path / "out"),
                "--val_documents",
                "4",
                "--shard_tokens",
                "200",
            ]
        )
        == 0
    )
    return tmp_path / "out"


def test_prepare_records_each_shards_bytes_and_sha256(prepared):
    marker = json.loads((prepared / "prepare.json").read_text())
    assert set(marker["files"]) == set(marker["shards"]) and len(marker["files"]) > 3
    for name, recorded in marker["files"].items():
        data = (prepared / name).read_bytes()
        assert recorded == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        assert len(data) == HEADER_BYTES + 2 * marker["shards"][name]


def test_a_shard_replaced_by_one_of_another_size_is_refused(prepared):
    write_shard(prepared / "data_train_000002.bin", np.arange(150))  # the same name, other tokens
    cfg = DataConfig(dataset=str(prepared))
    for load in (
        lambda: train_dataset(cfg, 16, 50304, seed=0, local_batch=2),
        lambda: find_shards(prepared, "*_train_*.bin"),
    ):
        with pytest.raises(
            DataError,
            match=r"data_train_000002.bin: 1,324 bytes, but prepare wrote 1,424 bytes under "
            r"this name .*prepare.json\); the shard was replaced or damaged since",
        ):
            load()
    write_shard(prepared / "data_val_000000.bin", np.arange(300))
    with pytest.raises(DataError, match="data_val_000000.bin: 1,624 bytes, but prepare wrote"):
        validation_batches(cfg, 16, 50304, local_batch=2, batches=1)
    with pytest.raises(DataError, match="data_val_000000.bin: 1,624 bytes, but prepare wrote"):
        eval_windows(prepared / "data_val_000000.bin", 16, 1000, 2)


def test_a_same_size_replacement_is_found_by_the_checksum_on_request(prepared, monkeypatch, capsys):
    assert prepare_main(["--verify", str(prepared)]) == 0
    assert "the 5 shards match prepare.json (sizes and sha256)" in capsys.readouterr().out
    shard = prepared / "data_train_000002.bin"
    write_shard(shard, np.asarray(open_shard(shard)) + 1)  # the same size, other tokens
    assert len(find_shards(prepared, "*_train_*.bin")) == 3  # by default only sizes are checked at a start
    monkeypatch.setenv(VERIFY_VARIABLE, "1")
    with pytest.raises(DataError, match="data_train_000002.bin: its sha256 differs from the one prepare recorded"):
        train_dataset(DataConfig(dataset=str(prepared)), 16, 50304, seed=0, local_batch=2)
    monkeypatch.delenv(VERIFY_VARIABLE)
    assert prepare_main(["--verify", str(prepared)]) == 2
    assert "data_train_000002.bin: its sha256 differs" in one_error_line(capsys)


def test_a_deleted_shard_and_folders_without_checksums(prepared, tmp_path, capsys):
    (prepared / "data_train_000003.bin").unlink()
    with pytest.raises(
        DataError,
        match=r"data_train_000003.bin listed in prepare.json \(matching '\*_train_\*.bin'\) "
        r"are missing",
    ):
        find_shards(prepared, "*_train_*.bin")
    assert prepare_main(["--verify", str(prepared)]) == 2
    assert "data_train_000003.bin listed in prepare.json are missing" in one_error_line(capsys)

    old = tmp_path / "old"  # prepared before sizes and checksums were recorded: the token counts give the sizes
    old.mkdir()
    write_shard(old / "data_train_000001.bin", np.arange(100))
    (old / "prepare.json").write_text(json.dumps({"shards": {"data_train_000001.bin": 90}}))
    with pytest.raises(DataError, match="1,224 bytes, but prepare wrote 1,204 bytes"):
        find_shards(old, "*_train_*.bin")
    (old / "prepare.json").write_text(json.dumps({"shards": ["data_train_000001.bin"]}))
    with pytest.raises(DataError, match=r"prepare.json is damaged \(AttributeError\); re-create the folder"):
        find_shards(old, "*_train_*.bin")
    (old / "prepare.json").unlink()  # an llm.c download: no marker, read as it is
    assert len(find_shards(old, "*_train_*.bin")) == 1
    assert prepare_main(["--verify", str(old)]) == 2
    assert "has no prepare.json, so there is nothing to verify" in one_error_line(capsys)


# 6. One exit-code map, and outputs that would replace the input


def test_an_output_over_the_input_is_refused(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("text")
    before = listing(tmp_path)
    for output in (corpus / "shards", corpus, corpus / "a.txt", tmp_path):
        assert prepare_main(["--input", str(corpus), "--output", str(output)]) == 2
        assert "this command's input" in one_error_line(capsys)
    assert listing(tmp_path) == before


def test_an_unexpected_error_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    def broken():
        raise RuntimeError("the tokenizer broke")

    monkeypatch.setattr(prepare_module, "gpt2_tokenizer", broken)
    (tmp_path / "in.txt").write_text("text")
    assert run(tmp_path / "in.txt", tmp_path / "out") == 1
    assert "unexpected RuntimeError: the tokenizer broke (run with --debug" in one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]
    with pytest.raises(RuntimeError, match="the tokenizer broke"):
        run(tmp_path / "in.txt", tmp_path / "out", "--debug")


def test_input_and_output_are_required_without_verify(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        prepare_main(["--output", str(tmp_path / "out")])
    assert exit_.value.code == 2 and "the following arguments are required: --input" in capsys.readouterr().err
