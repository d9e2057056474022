"""Evaluate a run: perplexity on held-out token files, or lm-evaluation-harness tasks.

    mlra eval ppl --workdir runs/mlra4_tiny          # the validation split of the run's data, at its seq_len
    mlra eval ppl --workdir runs/mlra4 --data fineweb=data/eval/fineweb_val.bin \\
        --data c4=data/eval/c4_val.bin --tokens 1e8 --seq_len 2048 --dtype bfloat16
    mlra eval lm-eval --workdir runs/mlra4 --tasks paper --batch_size 32

ppl: loss and perplexity per set (by default the validation shards of the run's data; `--data builtin`: the
built-in corpus's held-out split) and their average, as the official eval_ppl.py computes them (see
mlra_jax/perplexity.py for the windows): a table on stdout and JSON in RUN/eval/ppl_step{N}.json
(--out to write elsewhere; a number that is not finite is written as null). Token ids are checked
against the model's vocabulary, as training checks its shards. Data-parallel over the local devices, and
over several hosts with --distributed (launch/local.sh rehearses it: each process reads its rows of every
batch); any run directory works, including one made from imported weights.

lm-eval: the tasks through lm-evaluation-harness (mlra_jax/lm_eval_model.py; the `eval` extra), its
table on stdout and its results JSON in RUN/eval/lm_eval_step{N}.json (or --out). `--tasks paper`
runs the paper's seven zero-shot tasks and prints them in the paper's table layout. Datasets come
through lm-eval's usual download (the Hugging Face Hub and its cache).

An --out never replaces an input or a run's own files (experiment.json, metrics.jsonl, checkpoints/, ...);
a result that replaces an earlier one says so. Bad input exits 2 with one line (mlra_jax/command.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
from pathlib import Path

import jax

from mlra_jax.cli import add_run_argument, add_subcommand, command_parser, dtype_argument
from mlra_jax.command import command
from mlra_jax.config import ConfigError, DataConfig, Experiment, MeshConfig
from mlra_jax.data.pipeline import data_directory
from mlra_jax.data.shards import DataError, find_shards
from mlra_jax.distributed import add_arguments as add_distributed_arguments
from mlra_jax.distributed import data_parallel_devices, initialize
from mlra_jax.generate import load_model
from mlra_jax.guards import atomic_write_text, check_output_path, without_non_finite
from mlra_jax.paths import as_path
from mlra_jax.perplexity import batch_losses, evaluate_set
from mlra_jax.progress import configure_cli_logging
from mlra_jax.run_config import run_experiment
from mlra_jax.sharding import make_mesh
from mlra_jax.zero_shot import PAPER_SUITE, PAPER_TASKS, check_known, paper_table, task_names

BUILTIN = "builtin"


def _named_set(text: str) -> tuple[str, str]:
    if text == BUILTIN:
        return BUILTIN, BUILTIN  # the built-in corpus's validation shards, found in ppl()
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAME=PATH (for example fineweb=data/fineweb_val.bin) or {BUILTIN} (the built-in "
            f"corpus's held-out split)"
        )
    return name, path


def _limit(text: str) -> int | float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of examples (5) or a fraction (0.1)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value if value < 1 else int(value)


def _tokens(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of tokens (for example 1e8)") from None
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens >= 1 (for example 1e8)")
    return int(value)


def _parser() -> argparse.ArgumentParser:
    parser = command_parser("mlra eval", __doc__)
    add_distributed_arguments(parser)  # before the command: mlra eval --distributed ... ppl ...
    commands = parser.add_subparsers(dest="command", required=True)
    ppl = add_subcommand(commands, "ppl", "loss and perplexity on held-out llm.c token files")
    add_run_argument(ppl)
    ppl.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    ppl.add_argument(
        "--data",
        type=_named_set,
        action="append",
        metavar="NAME=PATH",
        help="an llm.c .bin file to evaluate (repeat for several sets), or builtin: the built-in corpus's held-out "
        "split (default: the validation shards of the run's data, its data.dataset and data.val_pattern)",
    )
    ppl.add_argument("--tokens", type=_tokens, default=int(1e8), help="tokens per set (default 1e8, the paper's)")
    ppl.add_argument(
        "--seq_len", type=int, help="context per window (default: the run's train.seq_len; the paper's is 2048)"
    )
    ppl.add_argument(
        "--batch_size",
        type=int,
        default=6,
        help="windows per batch (the official default 6; it sets the number of windows evaluated)",
    )
    ppl.add_argument("--dtype", type=dtype_argument, help="compute dtype: bfloat16 or float32 (default: the run's)")
    ppl.add_argument("--out", help="JSON file for the results (default RUN/eval/ppl_step{N}.json)")

    harness = add_subcommand(commands, "lm-eval", "lm-evaluation-harness tasks (zero-shot accuracy, ...)")
    add_run_argument(harness)
    harness.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    harness.add_argument(
        "--tasks",
        required=True,
        help=f"comma-separated lm-eval task names or globs; {PAPER_SUITE!r} for the paper's seven "
        f"({','.join(t.task for t in PAPER_TASKS)})",
    )
    harness.add_argument("--limit", type=_limit, help="examples per task (N) or a fraction of them (0.1); for tests")
    harness.add_argument("--batch_size", type=int, default=32, help="sequences per batch (default 32)")
    harness.add_argument("--num_fewshot", type=int, help="few-shot examples (default: the task's, else 0)")
    harness.add_argument("--dtype", type=dtype_argument, help="compute dtype: bfloat16 or float32 (default: the run's)")
    harness.add_argument("--max_length", type=int, help="context length (default: the model's max_seq_len)")
    harness.add_argument("--max_gen_toks", type=int, default=256, help="generated tokens at most (generative tasks)")
    harness.add_argument("--include_path", help="a folder of task YAML files of your own")
    harness.add_argument("--out", help="JSON file for the results (default RUN/eval/lm_eval_step{N}.json)")
    return parser


def _output(args: argparse.Namespace, default: str) -> tuple[Path, bool]:
    """(--out, else RUN/eval/`default`; whether it replaces an earlier result), checked before any evaluation: never
    an input (the --data files) nor one of the run's own files, in a folder that takes it."""
    out = as_path(args.out) if args.out else as_path(args.workdir) / "eval" / default
    inputs = [path for _, path in getattr(args, "data", None) or []]
    return out, check_output_path(out, inputs=inputs, run_dirs=[args.workdir], make_folder=False)


def _write_results(out: Path, results: dict, replaced: bool, **dumps) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)  # (RUN/eval): made once there is a result to keep
    atomic_write_text(out, json.dumps(without_non_finite(results), allow_nan=False, **dumps))
    print(f"results: {out}{' (replaced the earlier result)' if replaced else ''}")


def _validation_sets(data: DataConfig, where: str) -> list[tuple[str, str]]:
    """(name, path) of each validation shard of `data`: `val` for one shard, else each file's name."""
    try:
        paths = find_shards(data_directory(data), data.val_pattern)
    except DataError as err:
        raise ConfigError(f"{where}: {err}; or give the files to evaluate with --data NAME=PATH") from None
    if len(paths) == 1:
        return [("val", str(paths[0]))]
    return [(Path(str(path)).stem, str(path)) for path in paths]


def _sets(args: argparse.Namespace, experiment: Experiment) -> list[tuple[str, str]]:
    """--data's sets with builtin resolved; without --data, the validation shards of the run's data."""
    if not args.data:
        return _validation_sets(experiment.data, f"the validation split of the run's data ({experiment.data.dataset})")
    sets = []
    for name, path in args.data:
        if (name, path) == (BUILTIN, BUILTIN):
            builtin = DataConfig(dataset=BUILTIN)
            sets += [(BUILTIN if n == "val" else n, p) for n, p in _validation_sets(builtin, "--data builtin")]
        else:
            sets.append((name, path))
    return sets


def ppl(args: argparse.Namespace) -> int:
    experiment = run_experiment(as_path(args.workdir))
    if args.seq_len is None:
        args.seq_len = experiment.train.seq_len
    args.data = _sets(args, experiment)
    if args.seq_len < 1 or args.batch_size < 1:
        raise ConfigError("--seq_len and --batch_size must be at least 1")
    if args.tokens < args.seq_len * args.batch_size:
        raise ConfigError(
            f"--tokens {args.tokens} is fewer than one batch of --batch_size {args.batch_size} windows "
            f"of --seq_len {args.seq_len} tokens ({args.seq_len * args.batch_size}); raise --tokens"
        )
    try:
        devices = data_parallel_devices(args.batch_size)
    except ValueError as err:
        raise ConfigError(f"--batch_size: {err}") from None
    if args.out:
        _output(args, "")  # an explicit --out is checked before the model loads
    model, step = load_model(args.workdir, args.step, args.dtype)
    if args.seq_len > model.config.max_seq_len:
        raise ConfigError(
            f"--seq_len {args.seq_len} exceeds the model's max_seq_len {model.config.max_seq_len}; give "
            f"--seq_len from 1 to {model.config.max_seq_len} (training refuses the same)"
        )
    out, replaced = _output(args, f"ppl_step{step}.json")
    mesh = make_mesh(MeshConfig(data=len(devices)), devices)
    evaluate = batch_losses(model, mesh)
    results = [
        evaluate_set(name, path, evaluate, args.seq_len, args.tokens, args.batch_size, model.config.vocab_size)
        for name, path in args.data
    ]
    if jax.process_index() > 0:  # process 0 reports
        return 0
    average = sum(r.loss for r in results) / len(results)
    width = max(len(r.name) for r in results + [dataclasses.replace(results[0], name="average")])
    print(f"{'set':{width}}  {'loss':>8}  {'perplexity':>10}  {'tokens':>14}")
    for r in results:
        print(f"{r.name:{width}}  {r.loss:8.4f}  {r.perplexity:10.3f}  {r.tokens:14,}")
    print(f"{'average':{width}}  {average:8.4f}")
    _write_results(
        out,
        {
            "checkpoint": str(as_path(args.workdir)),
            "step": step,
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "dtype": args.dtype or model.config.compute_dtype,
            "average_loss": average,
            "sets": [dataclasses.asdict(r) for r in results],
        },
        replaced,
        indent=1,
    )
    return 0


@functools.cache
def task_manager(include_path: str | None):
    """lm-eval's task index (built once per process: it reads every task YAML it ships)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def _check_lm_eval_arguments(args: argparse.Namespace) -> None:
    """The ranges of lm-eval's numbers, before anything loads (max_length's upper end, the model's max_seq_len, is
    checked by MlraLM)."""
    for option, value, low in (
        ("--batch_size", args.batch_size, 1),
        ("--num_fewshot", args.num_fewshot, 0),
        ("--max_length", args.max_length, 1),
        ("--max_gen_toks", args.max_gen_toks, 1),
    ):
        if value is not None and value < low:
            raise ConfigError(
                f"{option} {value} is out of range: give an integer >= {low}"
                f"{' (and at most the model max_seq_len)' if option == '--max_length' else ''}"
            )


def lm_eval_command(args: argparse.Namespace) -> int:
    _check_lm_eval_arguments(args)
    try:
        import lm_eval
        from lm_eval.utils import handle_non_serializable, make_table
    except ImportError:
        raise ConfigError("lm-eval is not installed; install the eval extra: pip install -e '.[eval]'") from None
    from mlra_jax.lm_eval_model import MlraLM

    if jax.process_count() > 1:
        raise ConfigError("lm-eval runs in one process (on all its local devices); run it without --distributed")
    if args.include_path and not Path(args.include_path).is_dir():
        raise ConfigError(f"--include_path {args.include_path} is not a folder of task YAML files")
    if args.out:
        _output(args, "")  # an explicit --out is checked before the tasks and the model load
    names = task_names(args.tasks)
    manager = task_manager(args.include_path)
    check_known(names, manager.all_tasks, lambda name: manager.match_tasks([name]))
    model, step = load_model(args.workdir, args.step, args.dtype)
    lm = MlraLM(
        model,
        batch_size=args.batch_size,
        max_length=args.max_length,
        max_gen_toks=args.max_gen_toks,
        checkpoint=str(as_path(args.workdir)),
        step=step,
    )
    out, replaced = _output(args, f"lm_eval_step{step}.json")
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=names,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        batch_size=args.batch_size,
        task_manager=manager,
        log_samples=False,
    )
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    table = paper_table(results, f"{lm.model.config.spec.display_name} (step {step})")
    if table:
        print(table)
    # through JSON once (lm-eval's own serializer for its objects), then with NaN as null
    _write_results(
        out, json.loads(json.dumps(results, default=handle_non_serializable)), replaced, indent=2, ensure_ascii=False
    )
    return 0


@command
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_cli_logging()
    if args.distributed:
        initialize(args.coordinator, args.num_processes, args.process_id)
    return ppl(args) if args.command == "ppl" else lm_eval_command(args)


if __name__ == "__main__":
    sys.exit(main())
