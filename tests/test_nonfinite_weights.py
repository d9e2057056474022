"""A checkpoint whose weights hold NaN is never used: every command that loads weights for use (generate, eval,
convert, --init_from) refuses it naming the tensors and the step (exit 2, nothing written), and a resumed run
sets it aside like a damaged one and continues from the checkpoint before."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import GPT2, MICRO, micro_experiment
from test_run_safety import listing

from mlra_jax.checkpoint import Checkpointer
from mlra_jax.config import CheckpointConfig
from mlra_jax.convert import main as convert_main
from mlra_jax.eval import main as eval_main
from mlra_jax.generate import main as generate_main
from mlra_jax.train import main as train_main
from mlra_jax.training.loop import train
from mlra_jax.training.state import build_setup

pytestmark = pytest.mark.slow  # trains, launches or compiles: not in the fast subset (pytest -m 'not slow')


@pytest.fixture(scope="module")
def poisoned_run(tmp_path_factory):
    """A run of 8 steps whose newest checkpoint (8) has NaN in one weight."""
    workdir = tmp_path_factory.mktemp("run")
    experiment = micro_experiment("mlra4_tiny", *GPT2, "--train.total_steps=8", "--train.eval_every=0")
    train(experiment, workdir, devices=jax.devices()[:1])
    setup = build_setup(experiment, jax.devices()[:1])
    checkpointer = Checkpointer(workdir / "checkpoints", CheckpointConfig())
    step, state, metadata = checkpointer.restore_step(8, setup.abstract_state)
    up = state["params"]["blocks"]["attn"]["kv_up"]
    state["params"]["blocks"]["attn"]["kv_up"] = up.at[(0,) * up.ndim].set(jnp.nan)
    checkpointer.manager.delete(8)
    checkpointer.save(8, state, metadata)
    checkpointer.close()
    return workdir


def test_read_only_commands_refuse_nan_weights_naming_tensor_and_step(poisoned_run, tmp_path, capsys):
    before = listing(poisoned_run)
    data = tmp_path / "val.bin"
    header = np.zeros(256, np.int32)
    header[:3] = (20240520, 1, 5000)
    data.write_bytes(header.tobytes() + np.arange(5000, dtype=np.uint16).tobytes())
    commands = [
        (generate_main, ["--checkpoint", str(poisoned_run), "--prompt", "x", "--max_new_tokens", "2"]),
        (convert_main, ["to-hf", "--checkpoint", str(poisoned_run), "--out", str(tmp_path / "hf")]),
        (convert_main, ["to-reference", "--checkpoint", str(poisoned_run), "--out", str(tmp_path / "ref")]),
        (
            eval_main,
            [
                "ppl",
                "--checkpoint",
                str(poisoned_run),
                f"--data=val={data}",
                "--tokens=512",
                "--seq_len=32",
                "--batch_size=2",
            ],
        ),
    ]
    for main, argv in commands:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "step 8) are not finite: blocks.attn.kv_up (1 NaN, 0 inf of" in err, err
        assert "pass --step with an earlier checkpoint (4)" in err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "ref").exists()
    assert listing(poisoned_run) == before
    assert (
        generate_main(["--checkpoint", str(poisoned_run), "--step", "4", "--prompt", "x", "--max_new_tokens", "2"]) == 0
    )  # the earlier step serves


def test_init_from_nan_weights_is_refused(poisoned_run, tmp_path, capsys):
    code = train_main(
        ["--experiment=mlra4_tiny", f"--workdir={tmp_path / 'new'}", *MICRO, *GPT2, f"--init_from={poisoned_run}"]
    )
    err = capsys.readouterr().err
    assert code == 2 and f"--init_from={poisoned_run}, step 8 are not finite: blocks.attn.kv_up" in err
    assert not (tmp_path / "new" / "experiment.json").exists()


def test_a_resumed_run_sets_a_nan_checkpoint_aside_and_continues_from_the_one_before(poisoned_run, tmp_path, caplog):
    import shutil

    workdir = tmp_path / "copy"
    shutil.copytree(poisoned_run, workdir)
    experiment = micro_experiment("mlra4_tiny", *GPT2, "--train.total_steps=8", "--train.eval_every=0")
    with caplog.at_level("WARNING"):
        assert train(experiment, workdir, devices=jax.devices()[:1]).step == 8
    assert "the weights of checkpoint 8 are not finite: blocks.attn.kv_up" in caplog.text
    assert "restored step 4" in caplog.text and (workdir / "checkpoints" / "8.damaged").is_dir()
