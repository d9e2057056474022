"""The docs page on experiments of your own: its example file resolves in each --experiment form, and its first
command runs as printed."""

import dataclasses
import json
import re
import shlex
from pathlib import Path

from mlra_jax.experiments import resolve_experiment

from mlra_jax.train import main as train_main

PAGE = Path(__file__).parent.parent / "docs" / "custom-experiments.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", PAGE.read_text(), flags=re.MULTILINE | re.DOTALL)


def test_the_example_file_works_in_every_form(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_experiments.py").write_text(blocks("python")[0])
    monkeypatch.chdir(tmp_path)
    deep = resolve_experiment("my_experiments.py:DEEP")
    assert (deep.name, deep.model.variant, deep.model.n_layer, deep.train.total_steps) == (
        "mlra4_deep",
        "mlra4",
        6,
        400,
    )
    gqa = resolve_experiment("my_experiments.py:deep_gqa")
    assert (gqa.model.variant, gqa.model.group_size, gqa.model.kv_lora_rank) == ("gqa", 2, None)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_experiment("my_experiments:DEEP") == deep  # package.module:NAME
    run = tmp_path / "runs" / "mlra4_deep"
    run.mkdir(parents=True)
    (run / "experiment.json").write_text(json.dumps(dataclasses.asdict(deep)))  # what a run records
    assert resolve_experiment("runs/mlra4_deep/experiment.json") == deep

    first = blocks("bash")[0].splitlines()[0].split("#")[0]  # mlra train --experiment=my_experiments.py:DEEP --dry_run
    assert train_main(shlex.split(first)[2:]) == 0
    out = capsys.readouterr().out
    assert '"name": "mlra4_deep"' in out and "parameters: " in out
