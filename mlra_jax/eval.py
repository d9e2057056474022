"""Evaluate a run: perplexity on held-out token files, or lm-evaluation-harness tasks.

    python -m mlra_jax.eval ppl --checkpoint runs/mlra4 --data fineweb=data/eval/fineweb_val.bin \\
        --data c4=data/eval/c4_val.bin --tokens 1e8 --seq_len 2048 --dtype bfloat16
    python -m mlra_jax.eval lm-eval --checkpoint runs/mlra4 --tasks paper --batch_size 32

ppl: loss and perplexity per set and their average, as the official eval_ppl.py computes them (see
mlra_jax/perplexity.py for the windows): a table on stdout and JSON in RUN/eval/ppl_step{N}.json
(--out to write elsewhere). Data-parallel over the local devices, and over several hosts with
--distributed (launch/local.sh rehearses it: each process reads its rows of every batch); any run
directory works, including one made from imported weights.

lm-eval: the tasks through lm-evaluation-harness (mlra_jax/lm_eval_model.py; the `eval` extra), its
table on stdout and its results JSON in RUN/eval/lm_eval_step{N}.json (or --out). `--tasks paper`
runs the paper's seven zero-shot tasks and prints them in the paper's table layout. Datasets come
through lm-eval's usual download (the Hugging Face Hub and its cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import sys
from pathlib import Path

import jax

from mlra_jax.checkpoint import CheckpointError
from mlra_jax.config import ConfigError, MeshConfig
from mlra_jax.data.shards import DataError
from mlra_jax.distributed import add_arguments as add_distributed_arguments, data_parallel_devices, initialize
from mlra_jax.generate import load_model
from mlra_jax.paths import as_path
from mlra_jax.perplexity import batch_losses, evaluate_set
from mlra_jax.sharding import make_mesh
from mlra_jax.zero_shot import PAPER_SUITE, PAPER_TASKS, check_known, paper_table, task_names


def _named_set(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH (for example fineweb=data/fineweb_val.bin)")
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
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens >= 1")
    return int(value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mlra_jax.eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_distributed_arguments(parser)  # before the command: python -m mlra_jax.eval --distributed ... ppl ...
    commands = parser.add_subparsers(dest="command", required=True)
    ppl = commands.add_parser("ppl", help="loss and perplexity on held-out llm.c token files")
    ppl.add_argument("--checkpoint", required=True, help="a run directory (local or gs://)")
    ppl.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    ppl.add_argument("--data", type=_named_set, action="append", required=True, metavar="NAME=PATH",
                     help="an llm.c .bin file to evaluate (repeat for several sets)")
    ppl.add_argument("--tokens", type=_tokens, default=int(1e8), help="tokens per set (default 1e8, the paper's)")
    ppl.add_argument("--seq_len", type=int, default=2048, help="context per window (the paper's 2048)")
    ppl.add_argument("--batch_size", type=int, default=6,
                     help="windows per batch (the official default 6; it sets the number of windows evaluated)")
    ppl.add_argument("--dtype", choices=("float32", "bfloat16"), help="compute dtype (default: the run's)")
    ppl.add_argument("--out", help="JSON file for the results (default RUN/eval/ppl_step{N}.json)")

    harness = commands.add_parser("lm-eval", help="lm-evaluation-harness tasks (zero-shot accuracy, ...)")
    harness.add_argument("--checkpoint", required=True, help="a run directory (local or gs://)")
    harness.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    harness.add_argument("--tasks", required=True,
                         help=f"comma-separated lm-eval task names or globs; {PAPER_SUITE!r} for the paper's seven "
                              f"({','.join(t.task for t in PAPER_TASKS)})")
    harness.add_argument("--limit", type=_limit, help="examples per task (N) or a fraction of them (0.1); for tests")
    harness.add_argument("--batch_size", type=int, default=32, help="sequences per batch (default 32)")
    harness.add_argument("--num_fewshot", type=int, help="few-shot examples (default: the task's, else 0)")
    harness.add_argument("--dtype", choices=("float32", "bfloat16"), help="compute dtype (default: the run's)")
    harness.add_argument("--max_length", type=int, help="context length (default: the model's max_seq_len)")
    harness.add_argument("--max_gen_toks", type=int, default=256, help="generated tokens at most (generative tasks)")
    harness.add_argument("--include_path", help="a folder of task YAML files of your own")
    harness.add_argument("--out", help="JSON file for the results (default RUN/eval/lm_eval_step{N}.json)")
    return parser


def ppl(args: argparse.Namespace) -> int:
    if args.seq_len < 1 or args.batch_size < 1:
        raise ConfigError("--seq_len and --batch_size must be at least 1")
    try:
        devices = data_parallel_devices(args.batch_size)
    except ValueError as err:
        raise ConfigError(f"--batch_size: {err}") from None
    model, step = load_model(args.checkpoint, args.step, args.dtype)
    mesh = make_mesh(MeshConfig(data=len(devices)), devices)
    evaluate = batch_losses(model, mesh)
    results = [evaluate_set(name, path, evaluate, args.seq_len, args.tokens, args.batch_size)
               for name, path in args.data]
    if jax.process_index() > 0:  # process 0 reports
        return 0
    average = sum(r.loss for r in results) / len(results)
    width = max(len(r.name) for r in results + [dataclasses.replace(results[0], name="average")])
    print(f"{'set':{width}}  {'loss':>8}  {'perplexity':>10}  {'tokens':>14}")
    for r in results:
        print(f"{r.name:{width}}  {r.loss:8.4f}  {r.perplexity:10.3f}  {r.tokens:14,}")
    print(f"{'average':{width}}  {average:8.4f}")
    out = as_path(args.out) if args.out else as_path(args.checkpoint) / "eval" / f"ppl_step{step}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"checkpoint": str(as_path(args.checkpoint)), "step": step,
                               "seq_len": args.seq_len, "batch_size": args.batch_size,
                               "dtype": args.dtype or model.config.compute_dtype, "average_loss": average,
                               "sets": [dataclasses.asdict(r) for r in results]}, indent=1))
    print(f"results: {out}")
    return 0


@functools.cache
def task_manager(include_path: str | None):
    """lm-eval's task index (built once per process: it reads every task YAML it ships)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def lm_eval_command(args: argparse.Namespace) -> int:
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
    names = task_names(args.tasks)
    manager = task_manager(args.include_path)
    check_known(names, manager.all_tasks, lambda name: manager.match_tasks([name]))
    model, step = load_model(args.checkpoint, args.step, args.dtype)
    lm = MlraLM(model, batch_size=args.batch_size, max_length=args.max_length, max_gen_toks=args.max_gen_toks,
                checkpoint=str(as_path(args.checkpoint)), step=step)
    out = (as_path(args.out) if args.out else
           as_path(args.checkpoint) / "eval" / f"lm_eval_step{step}.json")
    results = lm_eval.simple_evaluate(model=lm, tasks=names, num_fewshot=args.num_fewshot, limit=args.limit,
                                      batch_size=args.batch_size, task_manager=manager, log_samples=False)
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    table = paper_table(results, f"{lm.model.config.spec.display_name} (step {step})")
    if table:
        print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    print(f"results: {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.distributed:
        initialize(args.coordinator, args.num_processes, args.process_id)
    try:
        return ppl(args) if args.command == "ppl" else lm_eval_command(args)
    except (ConfigError, DataError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
