"""One entry point (`mlra COMMAND`, `python -m mlra_jax COMMAND`) and the commands' shared rules: no abbreviated
or swallowed options, did-you-mean hints, help with the chosen experiment's values, experiments from files,
one run-directory option, one spelling of dtypes, data checked before the model is built."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import MICRO, ROOT, subprocess_env
from mlra_jax.experiments import get_experiment, resolve_experiment

from mlra_jax.__main__ import COMMANDS
from mlra_jax.__main__ import main as mlra
from mlra_jax.cli import apply_overrides, dtype_argument
from mlra_jax.config import ConfigError
from mlra_jax.train import main as train_main


def test_mlra_lists_every_command_and_runs_them(capsys):
    assert mlra(["--help"]) == 0
    listing = capsys.readouterr().out
    assert all(f"  {name}" in listing for name in COMMANDS)
    assert mlra(["info", "--list"]) == 0 and "mlra4_2p9b" in capsys.readouterr().out
    assert mlra(["trian"]) == 2 and "unknown command 'trian' (did you mean train?)" in capsys.readouterr().err
    assert mlra(["bench", "--help"]) == 0 and "tpu_compile" in capsys.readouterr().out
    assert mlra(["bench", "trian"]) == 2 and "did you mean train?" in capsys.readouterr().err
    assert mlra([]) == 2


@pytest.mark.slow
def test_python_m_mlra_jax_and_the_console_script_are_the_same_entry():
    script = Path(sys.executable).with_name("mlra")  # installed by pip install -e . (pyproject's scripts)
    for command in ([sys.executable, "-m", "mlra_jax", "info", "--list"], [str(script), "info", "--list"]):
        result = subprocess.run(command, env=subprocess_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and "mlra4_tiny" in result.stdout, result.stderr


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--dry-run"], "unknown option --dry-run (did you mean --dry_run?)"),
        (["--dryrun", "--model.n_layer=2"], "unknown option --dryrun (did you mean --dry_run?)"),
        (["--model.n_layr=2"], "unknown option --model.n_layr=2 (did you mean --model.n_layer?)"),
        (["--modle.n_layer=2"], "unknown option --modle.n_layer=2 (did you mean --model.n_layer?)"),
        (["--model.n_layer"], "Missing value for argument '--model.n_layer'"),
        (["--model.scan_layers=maybe"], "--model.scan_layers='maybe' is not a valid bool"),
    ],
)
def test_unknown_or_misspelled_options_are_named_with_the_closest_one(argv, message, capsys):
    assert train_main(["--experiment=mlra4_tiny", *argv]) == 2
    assert message in capsys.readouterr().err


def test_an_abbreviated_option_is_not_taken_for_another(capsys):
    with pytest.raises(SystemExit) as exit_info:  # argparse: --exp is not --experiment, --dry not --dry_run
        train_main(["--exp=mlra4_tiny", "--dry"])
    assert exit_info.value.code == 2


def test_help_shows_the_experiments_values_and_what_each_field_means(capsys):
    def described(out: str, option: str) -> str:
        """The option's line in --help and the lines of its description after it."""
        lines = [line.strip() for line in out.splitlines()]
        at = next(i for i, line in enumerate(lines) if line == option or line.startswith(option + " "))
        end = next((i for i in range(at + 1, len(lines)) if lines[i].startswith("--") or not lines[i]), len(lines))
        return " ".join(lines[at:end])

    with pytest.raises(SystemExit):
        train_main(["--experiment=mlra4_2p9b", "--help"])
    out = capsys.readouterr().out
    assert "(default: 24)" in described(out, "--model.n_layer int")
    remat_choices = "{none,full,dots,dots_attn,dots_attn_kv,dots_attn_qkv,auto}"
    assert "(default: auto)" in described(out, f"--model.remat {remat_choices}")
    assert "a fraction of total_steps below 1" in described(out, "--train.warmup_steps")  # its comment in config.py
    with pytest.raises(SystemExit):
        train_main(["--help"])
    assert "(required)" in described(capsys.readouterr().out, "--model.n_layer int")


def test_switching_the_variant_drops_the_fields_it_does_not_use():
    gqa = apply_overrides(
        get_experiment("mlra4_tiny"), ["--model.variant=gqa", "--model.head_dim=32", "--model.group_size=2"]
    )
    assert gqa.model.variant == "gqa" and gqa.model.kv_lora_rank is None and gqa.model.q_lora_rank is None
    with pytest.raises(ConfigError, match="variant 'gqa' needs head_dim, group_size"):
        apply_overrides(get_experiment("mlra4_tiny"), ["--model.variant=gqa"])
    mla = apply_overrides(get_experiment("mlra4_tiny"), ["--model.variant=mla"])  # same fields: all kept
    assert mla.model.kv_lora_rank == get_experiment("mlra4_tiny").model.kv_lora_rank


def test_a_short_run_needs_one_flag_with_warmup_as_a_fraction():
    short = apply_overrides(get_experiment("mlra4_tiny"), ["--train.total_steps=20"])
    assert short.train.warmup_steps == 0.1 and short.train.warmup == 2
    assert get_experiment("mlra4_tiny").train.warmup == 20  # the tiny recipe's 20 of 200 steps, as before
    assert apply_overrides(short, ["--train.warmup_steps=5"]).train.warmup == 5
    with pytest.raises(ConfigError, match="whole number of steps or a fraction"):
        apply_overrides(short, ["--train.warmup_steps=2.5"])


def test_experiments_from_a_file_a_module_or_a_run(tmp_path, monkeypatch):
    import dataclasses

    (tmp_path / "mine.py").write_text(
        "import dataclasses\nfrom mlra_jax.experiments import get_experiment\n"
        "base = get_experiment('gqa_tiny')\n"
        "WIDE = dataclasses.replace(base, name='wide', model=dataclasses.replace(base.model, n_embd=256))\n"
        "def small():\n    return dataclasses.replace(base, name='small')\n"
    )
    assert resolve_experiment(f"{tmp_path / 'mine.py'}:WIDE").model.n_embd == 256
    assert resolve_experiment(f"{tmp_path / 'mine.py'}:small").name == "small"
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_experiment("mine:WIDE").name == "wide"  # package.module:NAME
    run = tmp_path / "run"
    run.mkdir()
    (run / "experiment.json").write_text(json.dumps(dataclasses.asdict(get_experiment("mla_tiny"))))
    assert resolve_experiment(str(run)).model.variant == "mla"
    assert resolve_experiment(str(run / "experiment.json")).name == "mla_tiny"
    for spec, message in (
        (f"{tmp_path / 'mine.py'}:WIED", "has no 'WIED' (did you mean WIDE?)"),
        ("mlra4_tiyn", "unknown experiment 'mlra4_tiyn' (did you mean mlra4_tiny?)"),
        ("no_such_module_x:NAME", "cannot import no_such_module_x"),
        ("mlra_jax.config:MeshConfig", "is a MeshConfig, not an Experiment"),
    ):
        with pytest.raises(ConfigError) as error:
            resolve_experiment(spec)
        assert message in str(error.value)


def test_one_dtype_spelling_and_one_run_option_everywhere():
    assert [dtype_argument(d) for d in ("bf16", "BFloat16", "fp32", "float32")] == [
        "bfloat16",
        "bfloat16",
        "float32",
        "float32",
    ]
    from mlra_jax import convert
    from mlra_jax import eval as eval_module

    for parser, argv in (
        (convert._parser(), ["to-hf", "--workdir", "r", "--out", "o", "--dtype", "bf16"]),
        (convert._parser(), ["to-hf", "--checkpoint", "r", "--out", "o"]),
        (eval_module._parser(), ["ppl", "--workdir", "r", "--data", "a=b", "--dtype", "fp32"]),
    ):
        args = parser.parse_args(argv)
        assert args.workdir == "r" and args.dtype in ("bfloat16", "float32")


def test_a_missing_data_folder_is_named_before_the_model_is_built(tmp_path, capsys):
    start = time.perf_counter()
    code = train_main(
        ["--experiment=mlra4_2p9b", f"--workdir={tmp_path / 'run'}", f"--data.dataset={tmp_path / 'nowhere'}"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "nowhere" in err and time.perf_counter() - start < 30  # no 2.9B state built first
    assert train_main(["--experiment=mlra4_tiny", *MICRO, "--dry_run", f"--data.dataset={tmp_path / 'nowhere'}"]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_help_examples_keep_their_line_continuations():
    """A backslash at a line's end in a docstring example must reach --help (a plain string would join the lines)."""
    from mlra_jax.benchmarks import train as bench_train
    from mlra_jax.data import prepare

    for module in (prepare, bench_train):
        assert " \\\n" in module.__doc__, module.__name__


def test_a_spurious_ast_error_of_cpython_before_3_11_8_is_parsed_past(monkeypatch):
    """CPython gh-106905: ast.parse (tyro reads the fields' help from source) may raise a SystemError while another
    thread runs; the overrides are parsed once more. Any other SystemError is raised."""
    import tyro

    from mlra_jax.cli import apply_overrides

    real, calls = tyro.cli, []

    def flaky(*args, message="AST constructor recursion depth mismatch (before=192, after=241)", **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise SystemError(message)
        return real(*args, **kwargs)

    monkeypatch.setattr(tyro, "cli", flaky)
    assert apply_overrides(get_experiment("mlra4_tiny"), ["--train.total_steps=7"]).train.total_steps == 7
    assert len(calls) == 2
    calls.clear()
    monkeypatch.setattr(tyro, "cli", lambda *a, **k: flaky(*a, message="something else", **k))
    with pytest.raises(SystemError, match="something else"):
        apply_overrides(get_experiment("mlra4_tiny"), ["--train.total_steps=7"])
