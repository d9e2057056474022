"""Train an experiment: `mlra train --experiment=NAME [--section.field=value ...]`.

    mlra train --experiment=mlra4_tiny
    mlra train --experiment=mlra4_2p9b --data.dataset=data/fineweb_edu --workdir=runs/mlra4
    mlra train --experiment=mlra4_2p9b --dry_run      # config, parameters, mesh, memory; no training
    mlra train --experiment=mlra4_2p9b --compile_for=v5p-128   # fits a TPU slice? (needs libtpu)

A run lives in --workdir (default runs/NAME; a local folder or gs://bucket/path):
checkpoints/ (Orbax), metrics.jsonl, tensorboard/ and experiment.json. Running the same
command again resumes from the latest complete checkpoint; SIGTERM or Ctrl-C (SIGINT) saves a
checkpoint and exits (a second Ctrl-C aborts without saving). Resuming with another data order or
schedule (batch size, seq_len, total_steps, learning rate, seed, data, other data under the same path)
is refused unless --allow_changed names the fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from mlra_jax.backends import compile_only
from mlra_jax.cli import apply_overrides, command_parser, fields_help
from mlra_jax.command import command
from mlra_jax.compilation_cache import enable_compilation_cache, repairing
from mlra_jax.config import ConfigError, Experiment
from mlra_jax.distributed import add_arguments as add_distributed_arguments
from mlra_jax.experiments import all_experiments, resolve_experiment
from mlra_jax.paths import as_path
from mlra_jax.progress import configure_cli_logging
from mlra_jax.xla_flags import apply_gpu_defaults


def _parser(experiment: Experiment | None = None) -> argparse.ArgumentParser:
    """The command's parser; its help lists the fields with `experiment`'s values (the dataclasses' defaults
    when no --experiment was given)."""
    experiments = "\n".join(f"  {e.name:28} {e.description}" for e in all_experiments())
    values = (
        f"the values of {experiment.name}"
        if experiment is not None
        else "their defaults; --experiment=NAME --help shows its values"
    )
    epilog = (
        f"experiments (or FILE.py:NAME, package.module:NAME, RUN/experiment.json):\n{experiments}\n\n"
        f"overridable fields (--SECTION.FIELD=VALUE; {values}):\n{fields_help(experiment)}"
    )
    parser = command_parser("mlra train", __doc__, epilog=epilog)
    parser.add_argument(
        "--experiment",
        required=True,
        help="an experiment's name (listed below), FILE.py:NAME or "
        "package.module:NAME (an Experiment kept outside this package), or RUN/experiment.json",
    )
    parser.add_argument("--workdir", help="run directory, local or gs://bucket/path (default runs/EXPERIMENT)")
    parser.add_argument(
        "--dry_run",
        action="store_true",
        help="print the resolved config, parameter count, mesh and per-device memory, then exit "
        "(simulate N CPU devices with XLA_FLAGS=--xla_force_host_platform_device_count=N)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="with --dry_run: also compile the train step and report XLA's memory analysis (activations included)",
    )
    parser.add_argument(
        "--compile_for",
        metavar="TPU_SLICE",
        help="compile the train step for a TPU slice (v5p-128, v5e-256, v6e-64, v4-32, or a chip grid "
        "such as v5p:4x4x4) on this machine, which needs no TPU, and report per-chip memory "
        "against HBM, the Mosaic kernels, XLA's cost analysis and a step-time estimate; nothing "
        "runs or is written; exit 2 when it does not fit. Needs libtpu: pip install 'jax[tpu]'",
    )
    parser.add_argument(
        "--compile_report", metavar="FILE", type=Path, help="with --compile_for: also write the report as JSON to FILE"
    )
    parser.add_argument(
        "--allow_changed",
        default="",
        metavar="FIELD,...",
        help="resume although these data-order or schedule settings differ from the run's "
        "experiment.json (e.g. train.global_batch_size,train.total_steps); the run continues at "
        "the next unseen example",
    )
    parser.add_argument(
        "--init_from",
        metavar="RUN_OR_HF_DIR",
        help="start a new run from the weights of this run directory (e.g. one made by mlra "
        "convert from-reference) or Hugging Face folder (made by convert to-hf): fresh "
        "optimizer state, step 0, data from its start; the model config must be the same. "
        "Ignored once --workdir has checkpoints (it resumes)",
    )
    add_distributed_arguments(parser)
    return parser


def _options(parser: argparse.ArgumentParser) -> tuple[str, ...]:
    return tuple(option for action in parser._actions for option in action.option_strings)


def initialize_distributed(args: argparse.Namespace) -> None:
    from mlra_jax.distributed import initialize

    initialize(args.coordinator, args.num_processes, args.process_id)


def dry_run(experiment: Experiment, compile_step: bool) -> None:
    from mlra_jax import fp8, fp8_head
    from mlra_jax.attention import fp8_attention
    from mlra_jax.data.pipeline import check_data
    from mlra_jax.training.state import build_setup, compiled_memory, fsdp_gather, memory_estimate

    train = experiment.train
    data = check_data(experiment.data, train.seq_len, train.eval_every > 0, train.named_eval_sets)
    setup = build_setup(experiment)
    print(json.dumps(dataclasses.asdict(experiment), indent=1))
    print(data)
    print(f"parameters: {setup.num_params:,}")
    cfg = experiment.model
    print(fp8.describe(cfg.matmul_dtype, setup.mesh.devices.flat[0], scaling=cfg.fp8_scaling, casts=cfg.fp8_casts))
    print(fp8_attention.describe(cfg, setup.abstract_state["fp8"], train.seq_len, setup.mesh.devices.flat[0]))
    print(fp8_head.describe(cfg.matmul_dtype, cfg.fp8_head, setup.mesh.devices.flat[0]))
    if cfg.keeps_fp8_histories:
        print(fp8.describe_histories(setup.abstract_state["fp8"]))
    steps = setup.experiment.train.accumulation_steps
    where = {"step": "once per step", "micro_batch": "in each micro-batch"}.get(fsdp_gather(setup))
    gather = f"; FSDP gathers the weights {where}" if where else ""
    print(
        f"mesh: {dict(setup.mesh.shape)} over {setup.mesh.size} {setup.mesh.devices.flat[0].device_kind} "
        f"devices; {steps} micro-batch(es) of "
        f"{setup.experiment.train.micro_batch_size or experiment.train.global_batch_size} sequences per step{gather}"
    )
    estimate = memory_estimate(setup)
    parts = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in estimate.items())
    print(f"per-device memory: {parts}; total {sum(estimate.values()) / 2**30:.2f} GiB before activations")
    if compile_step:
        analysis = compiled_memory(setup)
        if analysis:
            print(
                "compiled train step per device: " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in analysis.items())
            )


def compile_for(experiment: Experiment, slice_name: str, report_path: Path | None) -> int:
    """--compile_for: the train step compiled for a TPU slice; 0 when it fits, 2 when it does not."""
    from mlra_jax.tpu_compile import compile_train, not_fitting_advice
    from mlra_jax.tpu_topology import parse_topology

    report = compile_train(experiment, parse_topology(slice_name))
    print(report.describe())
    if report_path is not None:
        report_path.write_text(json.dumps(report.to_json(), indent=1) + "\n")
    if not report.fits:
        print(f"error: {not_fitting_advice(report)}", file=sys.stderr)
        return 2
    return 0


def _chosen_experiment(argv: list[str]) -> Experiment | None:
    """The --experiment of argv for --help to show its values, when it resolves; else None."""
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    early.add_argument("--experiment")
    try:
        name = early.parse_known_args(argv)[0].experiment
        return resolve_experiment(name) if name else None
    except ConfigError:
        return None


@command
def main(argv: list[str] | None = None) -> int:
    parser = _parser(_chosen_experiment(argv) if "-h" in argv or "--help" in argv else None)
    args, overrides = parser.parse_known_args(argv)
    if args.compile_for is not None and not args.compile_for.strip():
        raise ConfigError(
            "--compile_for is empty (an unset variable in a launcher?); give a TPU slice such as v5p-128, or leave "
            "the option out to train"
        )
    if args.compile_for:
        compile_only()  # compile-only TPU devices; no accelerator is needed here
    apply_gpu_defaults()  # before JAX starts a backend
    configure_cli_logging()  # one handler, on stdout; orbax and grain stay at WARNING
    if args.distributed:
        initialize_distributed(args)
    experiment = apply_overrides(resolve_experiment(args.experiment), overrides, _options(parser))
    if args.compile_for:
        return compile_for(experiment, args.compile_for, args.compile_report)
    if args.dry_run:
        dry_run(experiment, args.compile)
        return 0
    from mlra_jax.training.loop import train

    cache = enable_compilation_cache()  # a restart loads its compiled steps (MLRA_JAX_COMPILATION_CACHE=0: off)
    if cache:
        logging.getLogger("mlra_jax.train").info("compiled steps are cached in %s", cache)
    workdir = as_path(args.workdir or Path("runs") / experiment.name)
    with repairing(cache):  # damaged entries are replaced; an error they cause names the cache
        result = train(
            experiment,
            workdir,
            allow_changed=tuple(filter(None, args.allow_changed.split(","))),
            init_from=args.init_from,
        )
    print(
        f"{'stopped' if result.stopped_by_signal else 'finished'} at step {result.step}"
        f"{f' (loss {result.last_loss:.4f} on the last step line)' if result.last_loss is not None else ''}. "
        f"Checkpoints: "
        f"{workdir / 'checkpoints'}; metrics: {workdir / 'metrics.jsonl'} and TensorBoard logs in "
        f"{workdir / 'tensorboard'} (tensorboard --logdir {workdir / 'tensorboard'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
