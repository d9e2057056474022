"""prepare from Hugging Face and TFDS corpora (offline: local `datasets` folders, TFDS mock data), with
--split, --skip_documents / --every and --max_tokens, which stops reading the input at the limit."""

import json
import sys

import pytest

from mlra_jax.data import prepare as prepare_module
from mlra_jax.data.prepare import main as prepare_main
from mlra_jax.data.shards import find_shards, open_shard
from mlra_jax.data.tokenizer import EOT, gpt2_tokenizer


def stream(texts: list[str]) -> list[int]:
    """The tokens prepare writes for these documents, in order."""
    tokenizer = gpt2_tokenizer()
    return [token for text in texts for token in (EOT, *tokenizer.encode_ordinary(text))]


def shards(folder, kind: str = "train") -> list[int]:
    return [int(t) for path in find_shards(folder, f"*_{kind}_*.bin") for t in open_shard(path)]


def marker(folder) -> dict:
    return json.loads((folder / "prepare.json").read_text())


def run(source, out, *options) -> int:
    return prepare_main(["--input", str(source), "--output", str(out), "--val_documents", "0", *options])


@pytest.fixture
def limited_input(monkeypatch):
    """Documents of 5 tokens each ("one two three four" after <|endoftext|>) that fail the test when
    prepare reads more of them than `allowed`."""
    read = []

    def install(allowed: int, total: int = 10_000):
        def documents(source, text_field, split, skip, every):
            for number in range(total):
                if number >= allowed:
                    raise AssertionError(f"prepare read document {number + 1}; it needs only {allowed}")
                read.append(number)
                yield "one two three four"

        monkeypatch.setattr(prepare_module, "iter_documents", documents)
        return read

    return install


def test_max_tokens_cuts_the_last_document_and_reads_no_further(tmp_path, limited_input):
    read = limited_input(allowed=5)
    assert run("hf:unused", tmp_path / "out", "--max_tokens", "23", "--shard_tokens", "10") == 0
    assert shards(tmp_path / "out") == (stream(["one two three four"]) * 5)[:23]  # 4 whole documents and 3 tokens
    record = marker(tmp_path / "out")
    assert record["max_tokens"] == 23 and record["tokens"]["train"] == 23 and record["documents"]["train"] == 5
    assert len(read) == 5


def test_max_tokens_reads_in_batches_far_from_the_limit(tmp_path, limited_input, monkeypatch):
    read = limited_input(allowed=2400)
    calls = []
    real = prepare_module.encode_documents

    def counted(tokenizer, texts):
        calls.append(len(texts))
        return real(tokenizer, texts)

    monkeypatch.setattr(prepare_module, "encode_documents", counted)
    assert (
        prepare_main(
            [
                "--input",
                "hf:unused",
                "--output",
                str(tmp_path / "out"),
                "--val_documents",
                "100",
                "--max_tokens",
                "12e3",
            ]
        )
        == 0
    )
    assert len(read) == 2400 and len(calls) < 25 and max(calls) == 1024  # not one document at a time
    record = marker(tmp_path / "out")
    assert record["documents"] == {"val": 100, "train": 2300} and record["tokens"] == {"val": 500, "train": 11_500}


def test_skip_every_and_max_tokens_on_local_files(tmp_path):
    texts = [f"document {i}" for i in range(10)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert run(tmp_path / "d.jsonl", tmp_path / "out", "--skip_documents", "1", "--every", "3") == 0
    assert shards(tmp_path / "out") == stream(texts[1::3])
    record = marker(tmp_path / "out")
    assert (record["skip_documents"], record["every"], record["split"]) == (1, 3, None)


@pytest.mark.parametrize(
    "options, message",
    [
        (["--every", "0"], "argument --every: '0' is not a whole number >= 1"),
        (["--max_tokens", "1.5"], "'1.5' is not a whole number"),
        (["--skip_documents", "-1"], "'-1' is not a whole number >= 0"),
    ],
)
def test_option_errors(tmp_path, capsys, options, message):
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(SystemExit) as exit_:
        run(tmp_path / "a.txt", tmp_path / "out", *options)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert run(tmp_path / "a.txt", tmp_path / "out", "--split", "validation") == 2
    assert "--split validation applies to hf: and tfds: inputs" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.fixture
def saved_dataset(tmp_path):
    """A DatasetDict saved with save_to_disk: the local form of an hf: dataset."""
    datasets = pytest.importorskip("datasets")  # in the test extra
    splits = {"train": [f"training text {i}" for i in range(8)], "validation": [f"held out {i}" for i in range(6)]}
    datasets.DatasetDict(
        {
            name: datasets.Dataset.from_dict({"text": texts, "id": list(range(len(texts)))})
            for name, texts in splits.items()
        }
    ).save_to_disk(str(tmp_path / "saved"))
    return tmp_path / "saved", splits


def test_hf_saved_folder_with_split_and_sample(tmp_path, saved_dataset):
    folder, splits = saved_dataset
    assert (
        prepare_main(
            [
                "--input",
                f"hf:{folder}",
                "--output",
                str(tmp_path / "out"),
                "--val_documents",
                "1",
                "--split",
                "validation",
                "--skip_documents",
                "1",
                "--every",
                "2",
            ]
        )
        == 0
    )
    assert shards(tmp_path / "out", "val") == stream(["held out 1"])
    assert shards(tmp_path / "out") == stream(["held out 3", "held out 5"])
    record = marker(tmp_path / "out")
    assert record["inputs"] == [f"hf:{folder}"] and record["split"] == "validation"
    assert record["documents"] == {"val": 1, "train": 2}

    assert run(f"hf:{folder}", tmp_path / "all", "--max_tokens", "7") == 0  # the train split by default
    assert shards(tmp_path / "all") == stream(splits["train"])[:7]


def test_hf_folder_of_data_files_is_streamed(tmp_path):
    pytest.importorskip("datasets")
    (tmp_path / "corpus").mkdir()
    texts = [f"line {i}" for i in range(6)]
    (tmp_path / "corpus" / "part.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    assert (
        run(f"hf:{tmp_path / 'corpus'}", tmp_path / "out", "--text_field", "body", "--every", "2", "--max_tokens", "5")
        == 0
    )
    assert shards(tmp_path / "out") == stream(texts[::2])[:5]


def test_hf_errors_name_the_fix(tmp_path, saved_dataset, capsys, monkeypatch):
    folder, _ = saved_dataset
    assert run(f"hf:{folder}", tmp_path / "out", "--text_field", "body") == 2
    assert "records have no field 'body' (fields: text, id); pass --text_field" in capsys.readouterr().err
    assert run(f"hf:{folder}", tmp_path / "out", "--text_field", "id") == 2
    assert "field 'id' is a int, not text" in capsys.readouterr().err
    assert run(f"hf:{folder}", tmp_path / "out", "--split", "test") == 2
    assert "has no split 'test' (splits: train, validation); pass --split" in capsys.readouterr().err
    assert run(f"hf:{tmp_path / 'nope'}", tmp_path / "out") == 2
    assert "cannot be loaded (FileNotFoundError" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    assert run(f"hf:{folder}", tmp_path / "out") == 2
    assert "needs the Hugging Face datasets package: pip install 'mlra-jax[data]'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_tfds_mock_data_with_config_split_and_sample(tmp_path, capsys):
    tfds = pytest.importorskip("tensorflow_datasets")  # the data extra; no TensorFlow needed (array record)
    with tfds.testing.mock_data(num_examples=7):
        texts = [record["text"] for record in tfds.data_source("imdb_reviews/plain_text", split="test")]
        assert (
            run(
                "tfds:imdb_reviews:plain_text",
                tmp_path / "out",
                "--split",
                "test",
                "--skip_documents",
                "2",
                "--every",
                "2",
            )
            == 0
        )
        assert run("tfds:imdb_reviews", tmp_path / "cut", "--split", "test", "--max_tokens", "9") == 0
        assert run("tfds:imdb_reviews", tmp_path / "bad", "--split", "test", "--text_field", "review") == 2
    assert len(texts) == 7 and all(isinstance(t, str) for t in texts)
    assert shards(tmp_path / "out") == stream(texts[2::2])
    assert marker(tmp_path / "out")["documents"]["train"] == 3
    assert shards(tmp_path / "cut") == stream(texts)[:9]
    assert "records have no field 'review' (fields: label, text); pass --text_field" in capsys.readouterr().err
