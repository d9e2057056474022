"""mlra convert: runs <-> the official code's files, and train --init_from."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from helpers import GPT2, first_batch_loss, losses, micro_experiment  # noqa: E402

from mlra_jax import convert, generate  # noqa: E402
from mlra_jax.generate import load_model  # noqa: E402
from mlra_jax.interop import reference_shapes  # noqa: E402
from mlra_jax.model import abstract_model  # noqa: E402
from mlra_jax.params import flat_params  # noqa: E402
from mlra_jax.training.loop import train  # noqa: E402

pytestmark = pytest.mark.slow  # trains, launches or compiles: not in the fast subset (pytest -m 'not slow')

SMALL = (
    *GPT2,
    "--model.n_layer=2",
    "--train.total_steps=2",
    "--train.warmup_steps=1",
    "--train.eval_every=0",
    "--checkpoint.every=2",
)


def random_run(run_dir: Path, variant: str, *overrides: str):
    """A run directory whose weights are random everywhere (no zero-initialized projection hides a transpose)."""
    experiment = micro_experiment(f"{variant}_tiny", *SMALL, *overrides)
    rng = np.random.default_rng(0)
    flat = {
        k: rng.normal(0, 0.05, v.shape).astype(np.float32)
        for k, v in flat_params(abstract_model(experiment.model)).items()
    }
    convert.write_run(run_dir, experiment, flat, "test")
    return experiment


def params_of(run_dir: Path, step: int | None = None) -> dict[str, np.ndarray]:
    model, _ = load_model(run_dir, step)
    return {k: np.asarray(v) for k, v in flat_params(model).items()}


def assert_same_params(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)  # bitwise in float32
        assert a[k].dtype == b[k].dtype


def no_output(out: Path) -> bool:
    return not out.exists() and not list(out.parent.glob(f".{out.name}.partial-*"))


CASES = [
    ("mha", ()),
    ("gqa", ()),
    ("mqa", ()),
    ("mla", ()),
    ("mlra4", ()),
    ("tpa", ()),
    ("mfa", ()),
    ("gta", ()),
    ("gla2", ()),
    ("mlra2", ("--model.gated=true",)),
    ("mla", ("--model.latent_scale=false",)),
]


@pytest.mark.parametrize("variant,options", CASES, ids=[v + "".join(o).replace("--model.", "-") for v, o in CASES])
def test_round_trip_is_bitwise(tmp_path, variant, options):
    experiment = random_run(tmp_path / "run", variant, *options)
    assert convert.main(["to-reference", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "ref")]) == 0
    assert sorted(os.listdir(tmp_path / "ref")) == ["config.json", "pytorch_model.bin"]
    state_dict = torch.load(tmp_path / "ref" / "pytorch_model.bin", weights_only=True)
    assert {k: tuple(v.shape) for k, v in state_dict.items()} == reference_shapes(experiment.model)
    assert state_dict["lm_head.weight"].data_ptr() == state_dict["transformer.wte.weight"].data_ptr()  # tied
    config = json.loads((tmp_path / "ref" / "config.json").read_text())
    assert config["n_layer"] == 2 and config["block_size"] == experiment.model.max_seq_len

    assert convert.main(["from-reference", "--src", str(tmp_path / "ref"), "--out", str(tmp_path / "back")]) == 0
    assert_same_params(params_of(tmp_path / "run"), params_of(tmp_path / "back"))
    back = json.loads((tmp_path / "back" / "experiment.json").read_text())["model"]
    assert back == dataclasses.asdict(experiment.model)


def test_an_export_goes_into_the_run_by_default(tmp_path):
    random_run(tmp_path / "run", "mha")
    assert convert.main(["to-reference", "--workdir", str(tmp_path / "run")]) == 0
    assert sorted(os.listdir(tmp_path / "run" / "reference")) == ["config.json", "pytorch_model.bin"]


def test_file_sources_and_detection_by_tensor_names(tmp_path):
    """A lone .bin with config.json beside it, safetensors, and a config.json that names no model file."""
    from safetensors.torch import save_file

    random_run(tmp_path / "run", "mlra2")
    convert.main(["to-reference", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "ref")])
    expected = params_of(tmp_path / "run")
    config = json.loads((tmp_path / "ref" / "config.json").read_text())
    plain = {k: v for k, v in config.items() if k not in ("reference_model", "mlra_jax")}  # as the released files
    (tmp_path / "ref" / "config.json").write_text(json.dumps(plain))
    assert (
        convert.main(
            [
                "from-reference",
                "--src",
                str(tmp_path / "ref" / "pytorch_model.bin"),
                "--out",
                str(tmp_path / "from_bin"),
            ]
        )
        == 0
    )
    assert_same_params(expected, params_of(tmp_path / "from_bin"))

    (tmp_path / "st").mkdir()
    state_dict = torch.load(tmp_path / "ref" / "pytorch_model.bin", weights_only=True)
    save_file(
        {k: v.to(torch.bfloat16) for k, v in state_dict.items() if k != "lm_head.weight"},
        tmp_path / "st" / "model.safetensors",
    )
    (tmp_path / "st" / "config.json").write_text(json.dumps(plain))
    assert convert.main(["from-reference", "--src", str(tmp_path / "st"), "--out", str(tmp_path / "from_st")]) == 0
    widened = params_of(tmp_path / "from_st")
    assert json.loads((tmp_path / "from_st" / "experiment.json").read_text())["model"]["variant"] == "mlra2"
    for k, v in expected.items():  # bfloat16 on disk: exact up to bf16 rounding
        np.testing.assert_allclose(widened[k], v, rtol=2**-8, atol=0, err_msg=k)


def test_variant_asked_only_when_the_names_cannot_tell(tmp_path, capsys):
    random_run(tmp_path / "run", "mha")
    convert.main(["to-reference", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "ref")])
    config = json.loads((tmp_path / "ref" / "config.json").read_text())
    del config["reference_model"]
    (tmp_path / "ref" / "config.json").write_text(json.dumps(dict(config, group_size=1)))  # MHA or GQA of groups of 1
    assert convert.main(["from-reference", "--src", str(tmp_path / "ref"), "--out", str(tmp_path / "a")]) == 2
    assert "pass --variant" in capsys.readouterr().err and no_output(tmp_path / "a")
    assert (
        convert.main(
            ["from-reference", "--src", str(tmp_path / "ref"), "--variant", "mha", "--out", str(tmp_path / "b")]
        )
        == 0
    )
    assert_same_params(params_of(tmp_path / "run"), params_of(tmp_path / "b"))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A run exported in shards of at most 300 kB, and imported back."""
    root = tmp_path_factory.mktemp("exported")
    experiment = random_run(root / "run", "mlra4")
    assert (
        convert.main(
            ["to-reference", "--checkpoint", str(root / "run"), "--out", str(root / "ref"), "--shard_size", "300KB"]
        )
        == 0
    )
    assert convert.main(["from-reference", "--src", str(root / "ref"), "--out", str(root / "back")]) == 0
    return experiment, root


def test_sharded_layout_imports_and_generates(exported, capsys):
    experiment, root = exported
    index = json.loads((root / "ref" / "pytorch_model.bin.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"pytorch_model-00001-of-{len(shards):05d}.bin"
    embedding = index["weight_map"]["transformer.wte.weight"]  # 12.9 MB alone: a shard of its own
    assert all((root / "ref" / s).stat().st_size < 330_000 for s in shards if s != embedding)
    assert set(index["weight_map"]) == set(reference_shapes(experiment.model))
    assert index["weight_map"]["lm_head.weight"] == index["weight_map"]["transformer.wte.weight"]
    assert_same_params(params_of(root / "run"), params_of(root / "back"))
    capsys.readouterr()
    assert (
        generate.main(["--checkpoint", str(root / "back"), "--prompt", "The", "--max_new_tokens", "3", "--json"]) == 0
    )
    record = json.loads(capsys.readouterr().out)
    assert record["step"] == 0 and len(record["tokens"]) >= 2


def test_train_init_from_starts_at_the_imported_weights(exported, tmp_path):
    """The first step's loss is the imported model's loss on the first batch: weights and data order from
    the start (not the source run's)."""
    experiment, root = exported
    experiment = micro_experiment("mlra4_tiny", *SMALL, "--train.total_steps=1", "--train.warmup_steps=0")
    result = train(experiment, tmp_path / "new", devices=jax.devices()[:1], init_from=root / "back")
    assert result.step == 1
    expected = first_batch_loss(root / "back", experiment)
    assert losses(tmp_path / "new")[1] == pytest.approx(expected, rel=1e-5)  # step 1 trains on the first batch


def test_train_init_from_refuses_another_model(exported, tmp_path):
    from mlra_jax.config import ConfigError

    experiment, root = exported
    other = micro_experiment("mlra4_tiny", *SMALL, "--model.intermediate_size=96")
    with pytest.raises(ConfigError, match="model.intermediate_size is 64 there, 96 here"):
        train(other, tmp_path / "new", devices=jax.devices()[:1], init_from=root / "back")
    assert not (tmp_path / "new").exists()


class Payload:
    def __reduce__(self):
        return os.getcwd, ()  # harmless if it ever ran; torch.load(weights_only=True) must refuse it


def _damaged(kind: str, root: Path, tmp: Path) -> list[str]:
    """The command line of a convert call that must fail with exit 2."""
    src = tmp / "src"
    if kind == "wrong_variant":
        return ["from-reference", "--src", str(root / "ref"), "--variant", "mha"]
    if kind in ("missing_shard", "truncated"):
        import shutil

        shutil.copytree(root / "ref", src)
        first = sorted(src.glob("pytorch_model-*.bin"))[0]
        if kind == "missing_shard":
            first.unlink()
        else:
            first.write_bytes(first.read_bytes()[: first.stat().st_size // 2])
        return ["from-reference", "--src", str(src)]
    if kind == "unsafe_pickle":
        src.mkdir()
        (src / "config.json").write_text((root / "ref" / "config.json").read_text())
        torch.save({"transformer.wte.weight": torch.zeros(2), "payload": Payload()}, src / "pytorch_model.bin")
        return ["from-reference", "--src", str(src)]
    if kind == "to_reference_no_run":
        return ["to-reference", "--checkpoint", str(root / "ref")]
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind", ["wrong_variant", "missing_shard", "truncated", "unsafe_pickle", "to_reference_no_run"]
)
def test_errors_exit_2_and_write_nothing(exported, tmp_path, kind, capsys):
    _, root = exported
    out = tmp_path / "out"
    assert convert.main([*_damaged(kind, root, tmp_path), "--out", str(out)]) == 2
    message = capsys.readouterr().err
    assert message.startswith("error: ") and no_output(out)
    words = {
        "wrong_variant": "--variant mha does not fit",
        "missing_shard": "lacks 1 of the",
        "truncated": "truncated or damaged",
        "unsafe_pickle": "weights_only=True",
        "to_reference_no_run": "not a run directory",
    }
    assert words[kind] in message


@pytest.mark.parametrize("command", ["to-reference", "from-reference"])
def test_existing_output_is_refused_and_kept(exported, tmp_path, command, capsys):
    _, root = exported
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    source = ["--checkpoint", str(root / "run")] if command == "to-reference" else ["--src", str(root / "ref")]
    assert convert.main([command, *source, "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err
    assert os.listdir(out) == ["mine.txt"] and (out / "mine.txt").read_text() == "keep"
