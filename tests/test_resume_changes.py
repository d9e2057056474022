"""Resuming with changed settings: data-order and schedule changes need --allow_changed, the data continues
at the next unseen example, and averaged log lines after a resume equal an uninterrupted run's."""

import functools
import json
import shutil

import jax
import numpy as np
import pytest
from helpers import MICRO, micro_experiment, records
from mlra_jax.experiments import get_experiment

from mlra_jax.cli import apply_overrides
from mlra_jax.config import DataConfig
from mlra_jax.data.pipeline import train_dataset
from mlra_jax.train import main as train_main
from mlra_jax.training import loop
from mlra_jax.training.loop import train
from mlra_jax.training.resume_check import record_experiment

pytestmark = pytest.mark.slow  # trains, launches or compiles: not in the fast subset (pytest -m 'not slow')

ONE_DEVICE = jax.devices()[:1]


def test_a_changed_batch_size_is_refused_then_resumes_at_the_next_example_when_allowed(tmp_path, capsys, monkeypatch):
    # the command's runs on one device (not the suite's 8): what they check is the data's order, not the mesh's
    monkeypatch.setattr(loop, "train", functools.partial(loop.train, devices=ONE_DEVICE))
    run = [f"--workdir={tmp_path}", "--experiment=mlra4_tiny", *MICRO, "--train.eval_every=0"]
    assert train_main([*run, "--train.total_steps=8"]) == 0
    saved = (tmp_path / "experiment.json").read_text()
    changed = [*run, "--train.total_steps=12", "--train.global_batch_size=16"]
    assert train_main(changed) == 2
    err = capsys.readouterr().err
    assert "train.global_batch_size was 8, now 16" in err and "train.total_steps was 8, now 12" in err
    assert "--allow_changed=train.global_batch_size,train.total_steps" in err
    assert (tmp_path / "experiment.json").read_text() == saved  # still describes the checkpoints
    assert train_main([*changed, "--allow_changed=train.global_batch_size"]) == 2  # total_steps not allowed
    assert train_main([*changed, "--allow_changed=train.log_every"]) == 2  # needs no permission
    assert "it takes a comma-separated list of" in capsys.readouterr().err

    assert train_main([*changed, "--allow_changed=train.global_batch_size,train.total_steps"]) == 0
    metadata = json.loads((tmp_path / "checkpoints" / "12" / "metadata" / "metadata").read_text())
    assert metadata["examples"] == 8 * 8 + 4 * 16
    assert json.loads((tmp_path / "experiment.json").read_text())["train"]["global_batch_size"] == 16


def test_the_stream_from_an_example_is_the_same_whatever_the_batch_size():
    data = DataConfig(dataset="builtin")
    small = train_dataset(data, 32, 50304, seed=1, local_batch=4, process_index=1, process_count=2)
    large = train_dataset(
        data, 32, 50304, seed=1, local_batch=8, process_index=1, process_count=2, start_example=3 * 8
    )  # after 3 global batches of 8
    np.testing.assert_array_equal(large[0], np.concatenate([small[3], small[4]]))


def test_settings_that_keep_the_trajectory_resume_freely(tmp_path, caplog):
    experiment = micro_experiment("mlra4_tiny", "--train.total_steps=4", "--train.eval_every=0")
    train(experiment, tmp_path, devices=ONE_DEVICE)
    more = micro_experiment(
        "mlra4_tiny",
        "--train.total_steps=6",
        "--train.eval_every=2",
        "--train.log_every=2",
        "--model.remat=full",
        "--model.compute_dtype=bfloat16",
        "--train.micro_batch_size=4",
        "--model.attention_impl=xla",
    )
    with caplog.at_level("WARNING"):
        assert train(more, tmp_path, devices=ONE_DEVICE, allow_changed=("train.total_steps",)).step == 6
    for field, old, new in [
        ("train.log_every", 1, 2),
        ("model.remat", "'none'", "'full'"),
        ("model.compute_dtype", "'float32'", "'bfloat16'"),
        ("train.micro_batch_size", None, 4),
        ("model.attention_impl", "'auto'", "'xla'"),
    ]:
        assert f"with {field} changed from {old} to {new}" in caplog.text
    assert sorted(records(tmp_path)) == list(range(1, 5)) + [6]  # log_every=2 after the resume


def test_a_changed_model_shape_is_refused_naming_the_field(tmp_path, capsys):
    run = [f"--workdir={tmp_path}", "--experiment=mlra4_tiny", *MICRO]
    record_experiment(tmp_path, apply_overrides(get_experiment("mlra4_tiny"), MICRO))
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)  # refused before it is read
    saved = (tmp_path / "experiment.json").read_text()
    assert train_main([*run, "--model.n_layer=2"]) == 2
    err = capsys.readouterr().err
    assert "holds a run of a different model (model.n_layer was 1, now 2); use another --workdir" in err
    assert (tmp_path / "experiment.json").read_text() == saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "experiment.json"]  # no metrics, no lock


def test_averaged_losses_after_a_resume_equal_the_uninterrupted_ones(tmp_path):
    """log_every=3, checkpoints every 4: resuming from step 4 must average steps 4-6 at step 6."""
    experiment = micro_experiment("mlra4_tiny", "--train.log_every=3", "--train.eval_every=0")
    train(experiment, tmp_path, devices=ONE_DEVICE)
    uninterrupted = records(tmp_path)
    assert sorted(uninterrupted) == [3, 6, 9, 12]
    for step in (8, 12):  # as if killed right after step 4's checkpoint
        shutil.rmtree(tmp_path / "checkpoints" / str(step))
    assert train(experiment, tmp_path, devices=ONE_DEVICE).step == 12
    assert records(tmp_path) == uninterrupted


def test_resumed_run_without_experiment_json_still_resumes(tmp_path):
    experiment = micro_experiment("mlra4_tiny", "--train.total_steps=4", "--train.eval_every=0")
    train(experiment, tmp_path, devices=ONE_DEVICE)
    (tmp_path / "experiment.json").unlink()
    longer = micro_experiment("mlra4_tiny", "--train.total_steps=8", "--train.eval_every=0")
    assert train(longer, tmp_path, devices=ONE_DEVICE).step == 8
    with pytest.raises(Exception, match="train.total_steps was 8, now 12"):
        train(micro_experiment("mlra4_tiny", "--train.eval_every=0"), tmp_path, devices=ONE_DEVICE)
