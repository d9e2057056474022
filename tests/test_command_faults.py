"""Faults of the read-mostly commands (eval, generate, plot, convert, info) found by a "never lose a run" user test:
each bad input exits 2 with one line naming the file or option and the fix, an output never replaces an input or
a run's own files (and says when it replaces an earlier result), partial or altered inputs are refused, and the
run directory is left byte for byte as it was."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import threading
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import GPT2, micro_experiment

from mlra_jax import convert, guards
from mlra_jax.data.builtin import builtin_shards
from mlra_jax.data.shards import find_shards, write_shard
from mlra_jax.eval import main as eval_main
from mlra_jax.generate import main as generate_main
from mlra_jax.info import main as info_main
from mlra_jax.plot import main as plot_main
from mlra_jax.training.loop import train

pytestmark = pytest.mark.slow  # trains, launches or compiles: not in the fast subset (pytest -m 'not slow')

SEQ = 32


def refuse_writes_as_root(monkeypatch, folder: Path) -> None:
    """Root writes into a read-only folder anyway: for root, make `folder` refuse what the kernel refuses anyone
    else (access checks, new folders and files under it), so that the test runs the same checks."""
    if os.geteuid() != 0:
        return
    inside = lambda path: Path(os.path.abspath(path)).is_relative_to(folder)
    denied = lambda path: PermissionError(13, "Permission denied", os.fspath(path))
    access, makedirs, temporary = os.access, os.makedirs, guards.tempfile.NamedTemporaryFile

    def fake_access(path, mode, *args, **kwargs):
        return False if inside(path) and mode & os.W_OK else access(path, mode, *args, **kwargs)

    def fake_makedirs(path, *args, **kwargs):
        if inside(path) and not os.path.isdir(path):
            raise denied(path)
        return makedirs(path, *args, **kwargs)

    def fake_temporary(*args, dir=None, **kwargs):
        if dir is not None and inside(dir):
            raise denied(dir)
        return temporary(*args, dir=dir, **kwargs)

    monkeypatch.setattr(os, "access", fake_access)
    monkeypatch.setattr(os, "makedirs", fake_makedirs)
    monkeypatch.setattr(guards.tempfile, "NamedTemporaryFile", fake_temporary)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run of the micro experiment: experiment.json, metrics.jsonl, a checkpoint at step 2."""
    workdir = tmp_path_factory.mktemp("faults") / "run"
    train(
        micro_experiment(
            "mlra4_tiny",
            *GPT2,
            "--train.total_steps=2",
            "--train.warmup_steps=1",
            "--train.eval_every=0",
            "--checkpoint.every=2",
        ),
        workdir,
        devices=jax.devices()[:1],
    )
    return workdir


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (the run's own; eval/ results of other tests aside) and its bytes."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.relative_to(folder).parts[0] != "eval"
    }


def one_error(capsys) -> str:
    """The single `error: ...` line of a command that failed, with no traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def shard(path: Path, tokens) -> Path:
    write_shard(path, np.asarray(tokens))
    return path


# -- eval ppl


def test_ppl_refuses_token_ids_beyond_the_vocabulary(run, tmp_path, capsys):
    tokens = np.arange(4 * SEQ + 1) % 1000
    tokens[SEQ + 5] = 60000  # fits a uint16 shard, beyond GPT-2's 50304 (padded) ids
    data, before = shard(tmp_path / "other_tokenizer.bin", tokens), snapshot(run)
    code = eval_main(
        [
            "ppl",
            "--checkpoint",
            str(run),
            "--data",
            f"x={data}",
            "--seq_len",
            str(SEQ),
            "--batch_size",
            "1",
            "--tokens",
            str(4 * SEQ),
        ]
    )
    message = one_error(capsys)
    assert code == 2 and str(data) in message and f"token id 60000 at position {SEQ + 5}" in message
    assert "vocabulary size 50304" in message
    assert snapshot(run) == before and not (run / "eval").exists()


def test_ppl_results_hold_no_bare_nan_and_a_non_finite_loss_is_an_error(run, tmp_path, capsys, monkeypatch):
    import mlra_jax.eval as eval_module

    val = find_shards(builtin_shards(), "*_val_*.bin")[0]
    arguments = [
        "ppl",
        "--checkpoint",
        str(run),
        "--data",
        f"v={val}",
        "--seq_len",
        str(SEQ),
        "--batch_size",
        "1",
        "--tokens",
        str(SEQ),
    ]
    monkeypatch.setattr(eval_module, "batch_losses", lambda model, mesh: lambda windows: 800.0)  # e**800: no float
    assert eval_main([*arguments, "--out", str(tmp_path / "huge.json")]) == 0
    text = (tmp_path / "huge.json").read_text()
    result = json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name} in the JSON"))
    assert result["sets"][0]["loss"] == 800.0 and result["sets"][0]["perplexity"] is None
    capsys.readouterr()
    monkeypatch.setattr(eval_module, "batch_losses", lambda model, mesh: lambda windows: float("nan"))
    assert eval_main([*arguments, "--out", str(tmp_path / "nan.json")]) == 2
    assert "the loss on v" in one_error(capsys) and not (tmp_path / "nan.json").exists()


@pytest.mark.parametrize("target", ["metrics.jsonl", "experiment.json", "checkpoints", "checkpoints/r.json", "data"])
def test_ppl_never_writes_over_a_run_file_or_its_input(run, tmp_path, capsys, target):
    data = shard(tmp_path / "d.bin", np.arange(2 * SEQ + 1))
    out, before = (data if target == "data" else run / target), snapshot(run)
    data_before = data.read_bytes()
    code = eval_main(
        [
            "ppl",
            "--checkpoint",
            str(run),
            "--data",
            f"d={data}",
            "--seq_len",
            str(SEQ),
            "--batch_size",
            "1",
            "--tokens",
            str(SEQ),
            "--out",
            str(out),
        ]
    )
    message = one_error(capsys)
    assert code == 2 and ("this command's input" if target == "data" else "the run's own") in message
    assert snapshot(run) == before and data.read_bytes() == data_before


def test_repeated_ppl_says_it_replaced_the_earlier_result(run, capsys):
    val = find_shards(builtin_shards(), "*_val_*.bin")[0]
    arguments = [
        "ppl",
        "--checkpoint",
        str(run),
        "--data",
        f"v={val}",
        "--seq_len",
        str(SEQ),
        "--batch_size",
        "1",
        "--tokens",
        str(SEQ),
    ]
    result = run / "eval" / "ppl_step2.json"
    result.unlink(missing_ok=True)
    assert eval_main(arguments) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"results: {result}"
    assert result.stat().st_mode & 0o777 == 0o666 & ~guards.current_umask()  # not mkstemp's 0600
    assert eval_main(arguments) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"results: {result} (replaced the earlier result)"


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--seq_len", "4096"], "--seq_len 4096 exceeds the model's max_seq_len 512; give --seq_len from 1 to 512"),
        (["--tokens", "10"], "--tokens 10 is fewer than one batch"),
        ("empty", "holds 0 tokens, fewer than one batch of 1 windows"),
    ],
)
def test_ppl_bad_values_are_named(run, tmp_path, capsys, arguments, message):
    data = shard(
        tmp_path / "empty.bin" if arguments == "empty" else tmp_path / "d.bin",
        [] if arguments == "empty" else np.arange(2 * SEQ + 1),
    )
    code = eval_main(
        [
            "ppl",
            "--checkpoint",
            str(run),
            "--data",
            f"d={data}",
            "--seq_len",
            str(SEQ),
            "--batch_size",
            "1",
            *([] if arguments == "empty" else arguments),
        ]
    )
    error = one_error(capsys)
    assert code == 2 and message in error
    assert arguments != "empty" or str(data) in error


@pytest.mark.parametrize("value", ["inf", "nan", "-1e8", "1.5"])
def test_ppl_tokens_that_are_no_count_are_refused_by_the_parser(run, capsys, value):
    with pytest.raises(SystemExit) as exit_:
        eval_main(["ppl", "--checkpoint", str(run), "--data", "d=x.bin", f"--tokens={value}"])
    assert exit_.value.code == 2 and "is not a whole number of tokens >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "option, value, low",
    [("--max_length", "0", 1), ("--num_fewshot", "-1", 0), ("--max_gen_toks", "0", 1), ("--batch_size", "0", 1)],
)
def test_lm_eval_numbers_out_of_range_exit_2_naming_the_option(run, tmp_path, capsys, option, value, low):
    code = eval_main(
        ["lm-eval", "--checkpoint", str(run), "--tasks", "arc_easy", option, value, "--out", str(tmp_path / "r.json")]
    )
    assert code == 2 and f"{option} {value} is out of range: give an integer >= {low}" in one_error(capsys)
    assert not (tmp_path / "r.json").exists()


# -- generate


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--max_len", "0"], "--max_len 0 is out of range: give 1 to the model's max_seq_len"),
        (["--max_len", "513"], "--max_len 513 exceeds the model's max_seq_len 512"),
        (["--max_new_tokens", "0"], "max_new_tokens=0 must be at least 1"),
        (["--seed", str(2**64)], f"seed={2**64} is out of range: give a 64-bit integer"),
        (["--steps_per_call", "0"], "--steps_per_call 0 is out of range: give 1 or more"),
    ],
)
def test_generate_values_out_of_range_exit_2(run, capsys, arguments, message):
    before = snapshot(run)
    assert generate_main(["--checkpoint", str(run), "--prompt", "x", *arguments]) == 2
    assert message in one_error(capsys) and snapshot(run) == before


def test_an_unexpected_error_is_one_line_with_exit_1_and_a_traceback_with_debug(run, capsys, monkeypatch):
    import mlra_jax.generate as generate_module

    def broken(*args, **kwargs):
        raise RuntimeError("out of device memory\nsecond line")

    monkeypatch.setattr(generate_module, "load_model", broken)
    assert generate_main(["--checkpoint", str(run), "--prompt", "x"]) == 1
    assert "unexpected RuntimeError: out of device memory (run with --debug" in one_error(capsys)
    with pytest.raises(RuntimeError):
        generate_main(["--checkpoint", str(run), "--prompt", "x", "--debug"])


def test_info_names_an_unknown_experiment_in_one_line(capsys):
    assert info_main(["--experiment", "mlra9_tiny"]) == 2
    assert "unknown experiment 'mlra9_tiny'" in one_error(capsys)


# -- plot


@pytest.mark.parametrize("target", ["metrics.jsonl", "experiment.json", "checkpoints/2/curves.png"])
def test_plot_never_writes_over_a_run_file(run, capsys, target):
    before = snapshot(run)
    assert plot_main([str(run), "--out", str(run / target)]) == 2
    assert "write the result somewhere else" in one_error(capsys) and snapshot(run) == before


def test_no_output_replaces_the_files_of_another_run_either(run, tmp_path, capsys):
    other = tmp_path / "other_run"
    shutil.copytree(run, other, ignore=shutil.ignore_patterns("checkpoints", "eval"))
    before = snapshot(other)
    assert plot_main([str(run), "--out", str(other / "metrics.jsonl")]) == 2
    assert f"would replace the run's own metrics.jsonl in {other}" in one_error(capsys)
    out = other / "experiment.json"
    assert eval_main(["ppl", "--checkpoint", str(run), "--data", "d=x.bin", "--out", str(out)]) == 2
    assert f"would replace the run's own experiment.json in {other}" in one_error(capsys)
    assert snapshot(other) == before


def test_plot_says_when_it_replaces_an_image_and_writes_it_whole(run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "curves.png"
    assert plot_main([str(run), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out} (1 run)"
    assert plot_main([str(run), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out} (1 run; replaced the earlier image)"
    assert out.read_bytes().startswith(b"\x89PNG") and os.listdir(tmp_path) == ["curves.png"]  # no temporary left


def test_an_out_onto_a_device_or_a_fifo_is_written_through_and_never_replaced(run, tmp_path, capsys):
    """As root (containers, Colab) a rename over /dev/null would replace it: here nodes made under tmp_path."""
    pytest.importorskip("matplotlib")
    null, block, fifo = tmp_path / "null", tmp_path / "block", tmp_path / "fifo"
    os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # the same device as /dev/null
    os.mknod(block, stat.S_IFBLK | 0o600, os.makedev(7, 0))
    os.mkfifo(fifo)
    val = find_shards(builtin_shards(), "*_val_*.bin")[0]
    ppl = ["ppl", "--checkpoint", str(run), "--data", f"v={val}", "--seq_len", str(SEQ), "--batch_size", "1"]
    assert eval_main([*ppl, "--tokens", str(SEQ), "--out", str(null)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"results: {null}"  # nothing "replaced"
    assert plot_main([str(run), "--out", str(null)]) == 0 and null.is_char_device()
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    assert plot_main([str(run), "--out", str(fifo)]) == 0
    reader.join(timeout=30)
    assert fifo.is_fifo() and received[0].startswith(b"\x89PNG")
    capsys.readouterr()
    assert plot_main([str(run), "--out", str(block)]) == 2
    assert f"{block} is a block device, not a regular file" in one_error(capsys) and block.is_block_device()
    assert sorted(os.listdir(tmp_path)) == ["block", "fifo", "null"]  # no temporary left


def test_plot_skips_binary_lines_and_names_a_file_without_records(run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "metrics.jsonl").write_bytes((run / "metrics.jsonl").read_bytes() + b"\xff\xfe\x00garbage\n")
    assert plot_main([str(damaged), "--out", str(tmp_path / "a.png")]) == 0
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "metrics.jsonl").write_bytes(bytes(range(256)) * 4)
    assert plot_main([str(binary), "--out", str(tmp_path / "b.png")]) == 2
    assert f"{binary / 'metrics.jsonl'} holds no metrics records" in one_error(capsys)


def test_an_out_under_a_file_is_named(run, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    before = snapshot(run)
    assert plot_main([str(run), "--out", str(blocker / "x.png")]) == 2
    assert f"{blocker} is a file" in one_error(capsys)
    assert eval_main(["ppl", "--checkpoint", str(run), "--data", "d=x.bin", "--out", str(blocker / "r.json")]) == 2
    assert f"{blocker} is a file" in one_error(capsys)
    assert convert.main(["to-reference", "--checkpoint", str(run), "--out", str(blocker / "ref")]) == 2
    assert f"{blocker} is a file" in one_error(capsys)
    assert snapshot(run) == before and blocker.read_text() == ""


def test_an_out_in_a_read_only_folder_is_named(run, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    refuse_writes_as_root(monkeypatch, locked)
    try:
        for command in (
            [plot_main, str(run), "--out", str(locked / "x.png")],
            [eval_main, "ppl", "--checkpoint", str(run), "--data", "d=x.bin", "--out", str(locked / "r")],
            [convert.main, "to-hf", "--checkpoint", str(run), "--out", str(locked / "hf")],
        ):
            assert command[0](command[1:]) == 2
            assert f"{locked} is not writable" in one_error(capsys)
        assert os.listdir(locked) == []
    finally:
        locked.chmod(0o755)


# -- convert


@pytest.fixture(scope="module")
def reference(run, tmp_path_factory) -> Path:
    """The run in the official code's files."""
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("reference") / "ref"
    assert convert.main(["to-reference", "--checkpoint", str(run), "--out", str(out)]) == 0
    return out


def _damage(kind: str, reference: Path, src: Path) -> None:
    import torch

    src.mkdir()
    config = json.loads((reference / "config.json").read_text())
    if kind == "reference_model":
        config["reference_model"] = 4
    (src / "config.json").write_text(json.dumps(config))
    weights = src / "pytorch_model.bin"
    if kind == "empty":
        weights.write_bytes(b"")
    elif kind == "garbage":
        weights.write_bytes(b"\x13\x37garbage" * 100)
    elif kind == "weight_map":
        (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": ["pytorch_model.bin"]}))
    elif kind == "integer":
        state_dict = torch.load(reference / "pytorch_model.bin", weights_only=True)
        state_dict["transformer.h.0.mlp.c_fc1.weight"] = (state_dict["transformer.h.0.mlp.c_fc1.weight"] * 1e3).int()
        torch.save(state_dict, weights)
    if not weights.exists():
        shutil.copy(reference / "pytorch_model.bin", weights)


@pytest.mark.parametrize(
    "kind, message",
    [
        ("empty", "pytorch_model.bin is empty (0 bytes)"),
        ("garbage", "pytorch_model.bin is not a PyTorch checkpoint"),
        ("reference_model", "config.json's reference_model is 4, not the name of an official model file"),
        ("weight_map", "pytorch_model.bin.index.json: its weight_map is a list"),
        ("integer", "1 tensors are not floating point: transformer.h.0.mlp.c_fc1.weight (int32)"),
    ],
)
def test_from_reference_refuses_damaged_or_altered_files_in_one_line(reference, tmp_path, capsys, kind, message):
    src, out = tmp_path / "src", tmp_path / "out"
    _damage(kind, reference, src)
    assert convert.main(["from-reference", "--src", str(src), "--out", str(out)]) == 2
    error = one_error(capsys)
    assert message in error and str(src) in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no partial folder


def test_convert_never_writes_into_a_run_file_or_its_input(run, reference, capsys):
    before = snapshot(run)
    assert convert.main(["to-reference", "--checkpoint", str(run), "--out", str(run / "checkpoints" / "ref")]) == 2
    assert "would replace the run's own checkpoints" in one_error(capsys)
    assert convert.main(["from-reference", "--src", str(reference), "--out", str(reference / "run")]) == 2
    assert "would write into this command's input" in one_error(capsys)
    assert snapshot(run) == before and sorted(os.listdir(reference)) == ["config.json", "pytorch_model.bin"]


@pytest.fixture(scope="module")
def hf_export(run, tmp_path_factory) -> Path:
    """The run exported to a Hugging Face folder under umask 027 (group-readable, not world-readable)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("hf") / "hf"
    mask = os.umask(0o027)
    try:
        assert convert.main(["to-hf", "--checkpoint", str(run), "--out", str(out)]) == 0
    finally:
        os.umask(mask)
    return out


def test_an_export_follows_the_umask(hf_export):
    assert hf_export.stat().st_mode & 0o777 == 0o750  # not mkdtemp's 0700
    assert {p.name: p.stat().st_mode & 0o777 for p in hf_export.iterdir()} == {
        p.name: 0o640 for p in hf_export.iterdir()
    }  # model.safetensors too (safetensors writes 0600)


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_killed_export_is_refused_by_init_from_and_removed_by_the_next_convert(run, hf_export, tmp_path, capsys):
    from mlra_jax.config import ConfigError

    # what a convert killed after the weights and before the tokenizer leaves
    partial = tmp_path / f".hf.partial-{socket.gethostname()}-{_dead_pid()}-0123abcd"
    shutil.copytree(hf_export, partial, ignore=shutil.ignore_patterns("tokenizer*"))
    experiment = micro_experiment(
        "mlra4_tiny", *GPT2, "--train.total_steps=1", "--train.warmup_steps=0", "--train.eval_every=0"
    )
    with pytest.raises(
        ConfigError,
        match=r"is not a complete Hugging Face folder of convert to-hf: it lacks "
        r"tokenizer.json, tokenizer_config.json",
    ):
        train(experiment, tmp_path / "new", devices=jax.devices()[:1], init_from=partial)
    assert not (tmp_path / "new" / "checkpoints").exists()
    legacy = tmp_path / ".hf.partial-k3j5x9q1"  # of an earlier version: no writer recorded
    legacy.mkdir()
    assert convert.main(["to-hf", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert f"removed {partial}: the unfinished output of a convert" in out and not partial.exists()
    assert f"note: {legacy} (no writer recorded)" in out and legacy.exists()
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def test_an_export_is_renamed_into_place_only_when_complete(run, tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    from mlra_jax.interop import hf_folder

    class NoTokenizer:  # a writer that skips the tokenizer: the export is refused before its rename
        def save_pretrained(self, folder):
            pass

    monkeypatch.setattr(hf_folder, "gpt2_hf_tokenizer", lambda max_len: NoTokenizer())
    assert convert.main(["to-hf", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]) == 2
    assert "the export is not a complete Hugging Face folder" in one_error(capsys)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("n_head", "4", "n_head='4' (not int)"),
        ("gated", "false", "gated='false' (not bool)"),
        ("rope_theta", None, "rope_theta=None (not float)"),
        ("mlra_jax", {"step": "two"}, "mlra_jax.step is 'two', not a step number"),
    ],
)
def test_init_from_names_hf_config_fields_of_the_wrong_type(hf_export, tmp_path, field, value, message):
    from mlra_jax.config import ConfigError
    from mlra_jax.model import abstract_model
    from mlra_jax.params import flat_params
    from mlra_jax.training.init_from import source_params

    folder = tmp_path / "hf"
    shutil.copytree(hf_export, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, **{field: value})))
    experiment = micro_experiment("mlra4_tiny", *GPT2)
    with pytest.raises(ConfigError, match=f"{folder}/config.json.*{message}".replace("(", r"\(").replace(")", r"\)")):
        source_params(folder, flat_params(abstract_model(experiment.model)))
