"""Nothing destroys a run: a read-only command changes nothing; when no checkpoint restores for a reason
that is not damage (here a changed model), training stops with exit 2 and touches nothing; a non-finite
state never reaches a checkpoint."""

import json

import jax
import pytest
from helpers import MICRO, micro_experiment, run_training

from mlra_jax.generate import main as generate_main
from mlra_jax.train import main as train_main
from mlra_jax.training.loop import TrainingDiverged, train

pytestmark = pytest.mark.slow  # trains, launches or compiles: not in the fast subset (pytest -m 'not slow')


def listing(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def trained_run(tmp_path):
    train(
        micro_experiment("mlra4_tiny", "--train.total_steps=8", "--train.eval_every=0"),
        tmp_path,
        devices=jax.devices()[:1],
    )
    return listing(tmp_path / "checkpoints"), (tmp_path / "metrics.jsonl").read_text()


def test_generate_on_a_run_of_another_model_changes_nothing(tmp_path, capsys):
    checkpoints, _ = trained_run(tmp_path)
    config = json.loads((tmp_path / "experiment.json").read_text())
    config["model"]["n_embd"] = 32  # experiment.json now names another model than the checkpoints hold
    (tmp_path / "experiment.json").write_text(json.dumps(config))
    assert generate_main(["--checkpoint", str(tmp_path), "--prompt", "x", "--max_new_tokens", "2"]) == 2
    assert "none of the 2 checkpoints" in capsys.readouterr().err
    assert listing(tmp_path / "checkpoints") == checkpoints  # nothing renamed to .damaged


def test_training_a_changed_model_stops_without_touching_the_run(tmp_path, capsys):
    checkpoints, metrics = trained_run(tmp_path)
    (tmp_path / "experiment.json").unlink()  # without it, only the checkpoints can tell
    code = train_main(
        ["--experiment=mlra4_tiny", f"--workdir={tmp_path}", *MICRO, "--model.n_embd=32", "--train.eval_every=0"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "none of the 2 checkpoints" in err and "Nothing was changed" in err
    assert listing(tmp_path / "checkpoints") == checkpoints
    assert (tmp_path / "metrics.jsonl").read_text() == metrics  # not restarted from step 0


def test_non_finite_parameters_behind_a_finite_loss_never_reach_a_checkpoint(tmp_path):
    """peak_lr=1e6: step 4's loss is still finite but its gradient norm and updated weights are not."""
    experiment = micro_experiment("mlra4_tiny", "--train.peak_lr=1e6", "--train.eval_every=0", "--checkpoint.every=4")
    with pytest.raises(
        TrainingDiverged,
        match=r"at step 4 \(gradient norm nan, updated parameters NOT finite\).*"
        r"last finite step is 3; the last good checkpoint is none",
    ):
        train(experiment, tmp_path, devices=jax.devices()[:1])
    assert not list((tmp_path / "checkpoints").glob("[0-9]*"))  # step 4 was not saved
    assert all(json.loads(line)["step"] <= 3 for line in (tmp_path / "metrics.jsonl").read_text().splitlines())


def test_a_second_writer_is_refused_and_a_dead_holder_is_not_in_the_way(tmp_path):
    from mlra_jax.config import ConfigError
    from mlra_jax.training.run_lock import RunLock

    experiment = micro_experiment("mlra4_tiny", "--train.total_steps=4", "--train.eval_every=0")
    with RunLock(tmp_path):  # another training process holds the run
        with pytest.raises(ConfigError, match=r"in use by another training process \(host .* pid \d+\)"):
            train(experiment, tmp_path, devices=jax.devices()[:1])
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()
    (tmp_path / "lock").write_text("host gone pid 999999\n")  # left by a killed run: the OS lock is gone
    assert train(experiment, tmp_path, devices=jax.devices()[:1]).step == 4


def test_checkpoint_metadata_without_the_data_position_is_set_aside(tmp_path, caplog):
    experiment = micro_experiment("mlra4_tiny", "--train.total_steps=8", "--train.eval_every=0")
    train(experiment, tmp_path, devices=jax.devices()[:1])
    (tmp_path / "checkpoints" / "8" / "metadata" / "metadata").write_text("{}")  # valid JSON, wrong content
    with caplog.at_level("WARNING"):
        result = train(experiment, tmp_path, devices=jax.devices()[:1])
    assert result.step == 8 and "metadata lacks step, examples" in caplog.text
    assert (tmp_path / "checkpoints" / "8.damaged").is_dir()  # kept for inspection; step 8 recomputed from 4


def test_a_garbage_experiment_json_is_named_not_a_traceback(tmp_path, capsys):
    trained_run(tmp_path)
    (tmp_path / "experiment.json").write_text("{not json")
    assert generate_main(["--checkpoint", str(tmp_path), "--prompt", "x"]) == 2
    assert "experiment.json is not a run's experiment.json (JSONDecodeError" in capsys.readouterr().err
    assert train_main(["--experiment=mlra4_tiny", f"--workdir={tmp_path}", *MICRO]) == 2
    assert "restore it, or use another --workdir" in capsys.readouterr().err
    assert (tmp_path / "experiment.json").read_text() == "{not json"  # left as it was


def test_top_k_beyond_the_vocabulary_is_refused():
    from mlra_jax.experiments.tiny import tiny_model

    from mlra_jax.decode.generator import GenerationError, Generator, Sampling
    from mlra_jax.model import init_model

    generator = Generator(init_model(tiny_model("gqa", n_layer=1, vocab_size=64)), max_len=16)
    with pytest.raises(GenerationError, match="top_k=65 exceeds the vocabulary of 64 tokens"):
        generator.generate([[1, 2]], Sampling(max_new_tokens=2, temperature=1.0, top_k=65))


def test_a_stop_right_after_a_save_does_not_save_the_step_again(tmp_path, monkeypatch):
    """A preemption notice at a step that is already saved (here the resumed one) stops cleanly."""
    from mlra_jax.checkpoint import Checkpointer

    experiment = micro_experiment("mlra4_tiny", "--train.total_steps=4", "--train.eval_every=0")
    train(experiment, tmp_path, devices=jax.devices()[:1])
    longer = micro_experiment("mlra4_tiny", "--train.total_steps=8", "--train.eval_every=0")
    monkeypatch.setattr(Checkpointer, "reached_preemption", lambda self, step: True)
    result = train(longer, tmp_path, devices=jax.devices()[:1], allow_changed=("train.total_steps",))
    assert result.stopped_by_signal and result.step == 4


def test_a_deleted_lock_file_does_not_admit_a_second_writer(tmp_path):
    from mlra_jax.config import ConfigError
    from mlra_jax.training.run_lock import RunLock

    with RunLock(tmp_path):
        (tmp_path / "lock").unlink()  # the folder's own lock still holds
        with pytest.raises(ConfigError, match="in use by another training process"):
            RunLock(tmp_path).acquire()
    RunLock(tmp_path).acquire().release()  # free again once the holder ends


def test_a_folder_without_a_checkpoint_takes_new_settings_and_refused_starts_leave_nothing(tmp_path, capsys):
    """A run that died before its first checkpoint (its experiment.json names another model) takes the corrected
    command, and that start removes the temporaries killed rewrites left; a start refused in a new folder leaves no
    folder and no lock file."""
    from mlra_jax.training.resume_check import record_experiment

    run = tmp_path / "run"
    run.mkdir()
    record_experiment(run, micro_experiment("mlra4_tiny", "--model.n_layer=2"))
    stale = [".metrics.jsonl.k2j4x9qa.tmp", ".experiment.json.0a1b2c3d.tmp"]
    for name in [*stale, ".notes.tmp"]:
        (run / name).write_text("partial")
    experiment = micro_experiment("mlra4_tiny", "--train.total_steps=3", "--train.eval_every=0")
    assert train(experiment, run, devices=jax.devices()[:1]).step == 3
    recorded = json.loads((run / "experiment.json").read_text())
    assert recorded["model"]["n_layer"] == 1 and len(recorded["data_fingerprint"]) == 16
    assert not any((run / name).exists() for name in stale) and (run / ".notes.tmp").exists()  # not ours: kept

    new = tmp_path / "new"
    assert train_main(["--experiment=mlra4_tiny", f"--workdir={new}", *MICRO, "--mesh.data=3"]) == 2
    assert "error: " in capsys.readouterr().err and not new.exists()


def test_other_data_under_the_same_path_is_refused_on_resume(tmp_path, capsys):
    """prepare --overwrite put other text into the run's dataset folder: the fingerprint in experiment.json differs."""
    import numpy as np

    from mlra_jax.data.pipeline import data_fingerprint
    from mlra_jax.data.shards import write_shard
    from mlra_jax.training.resume_check import check_resume, record_experiment

    data, run = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    write_shard(data / "d_train_000000.bin", np.arange(200) % 100)
    overrides = [*MICRO, f"--data.dataset={data}", "--train.eval_every=0"]
    experiment = micro_experiment("mlra4_tiny", *overrides[len(MICRO) :])
    (run / "checkpoints" / "4").mkdir(parents=True)
    record_experiment(run, experiment, data_fingerprint(experiment.data))
    saved = (run / "experiment.json").read_text()
    write_shard(data / "d_train_000000.bin", np.arange(300) % 100)
    assert train_main(["--experiment=mlra4_tiny", f"--workdir={run}", *overrides]) == 2
    err = capsys.readouterr().err
    assert f"the training data in {data} changed since {run} was trained on it" in err
    assert "--allow_changed=data.dataset" in err and (run / "experiment.json").read_text() == saved
    check_resume(run, experiment, True, ("data.dataset",), data_fingerprint(experiment.data))  # allowed: no error


def test_a_first_ctrl_c_asks_for_a_save_and_a_second_aborts():
    """As SIGTERM: the loop saves a checkpoint at the next step and exits (run()'s stop path)."""
    import os
    import signal

    from mlra_jax.train import _parser
    from mlra_jax.training.loop import _StopSignal

    stop = _StopSignal()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert "Ctrl-C (SIGINT) saves a\ncheckpoint" in _parser().format_help()


def test_a_truncated_newest_checkpoint_is_one_warning_line_and_the_run_resumes_from_the_one_before(tmp_path):
    trained_run(tmp_path)
    data = max((tmp_path / "checkpoints" / "8" / "state").rglob("ocdbt.process_0/d/*"), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # a copy or a disk that stopped midway
    result = run_training(tmp_path, "--train.total_steps=8", "--train.eval_every=0")
    output = result.stdout + result.stderr
    (warning,) = [line for line in output.splitlines() if "WARNING" in line]
    assert "checkpoints/8 is incomplete or damaged" in warning and "restored step 4" in warning, output
    assert "Traceback" not in output and "Event loop is closed" not in output and "Exception ignored" not in output, (
        output
    )
    assert "TensorStore details" not in warning  # TensorStore's own error, not Orbax's repr of the store
    assert (tmp_path / "checkpoints" / "8.damaged").is_dir() and "finished at step 8" in result.stdout


def test_asyncio_records_of_abandoned_orbax_reads_are_dropped_only_while_a_restore_is_judged(caplog):
    """An abandoned read's task, collected after its restore failed, makes asyncio log "Task exception was never
    retrieved" (ERROR): inside the restore's window those records of Orbax's tasks are dropped; others, and any
    after the window, are shown."""
    import logging

    from mlra_jax.checkpoint import _quiet_abandoned_reads

    asyncio_log = logging.getLogger("asyncio")
    orbax_task = (
        "Task exception was never retrieved\nfuture: <Task finished coro=<_read_shard() defined at /x/orbax/s.py:1>>"
    )
    other_task = "Task exception was never retrieved\nfuture: <Task finished coro=<mine() defined at /x/app.py:1>>"
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with _quiet_abandoned_reads([]):
            asyncio_log.error(orbax_task)
            asyncio_log.error(other_task)
        asyncio_log.error(orbax_task)
    assert [r.getMessage() for r in caplog.records] == [other_task, orbax_task]
