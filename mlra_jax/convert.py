"""Checkpoints to Hugging Face, and to and from the official PyTorch code: `mlra convert COMMAND`.

    mlra convert to-hf --workdir runs/mlra4 [--out runs/mlra4/hf] [--step N] [--dtype bfloat16]
        [--shard_size 5GB] [--push USER/NAME]
    mlra convert to-reference --workdir runs/mlra4 [--out runs/mlra4/reference] [--step N] [--shard_size 10GB]
    mlra convert from-reference --src Soughing-MLRA/mlra_4 --out runs/mlra4_imported [--variant mlra4]

to-hf writes a Hugging Face folder: config.json (model_type "mlra", every field of the variant, auto_map),
our PyTorch modeling code (configuration_mlra.py, modeling_mlra.py: all 11 variants and their options, a KV
cache through transformers' Cache API), the weights as transformers saves them (model.safetensors, sharded
with an index above --shard_size, the tied embedding once) in --dtype, and the GPT-2 tokenizer made offline
from the bundled BPE ranks. `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` and
`AutoTokenizer.from_pretrained(DIR)` load it, `train --init_from=DIR` starts a run from it, and --push uploads
it to the Hub with huggingface_hub (create_repo + upload_folder; log in first with `hf auth login`).

to-reference writes `config.json` and `pytorch_model.bin` (shards `pytorch_model-0000k-of-0000N.bin` with
`pytorch_model.bin.index.json` above --shard_size), which the official `GPT.from_pretrained(DIR)` of the model
file it names loads. from-reference reads a `.pt`/`.bin` state dict, a `.safetensors` file or a folder of
either (sharded with its index or not), with `torch.load(weights_only=True)` or safetensors, finds the variant
from config.json and the tensor names, and writes a run directory (experiment.json and an Orbax checkpoint at
step 0) that `generate` reads and `train --init_from` starts from. Errors exit with status 2 and leave no output.

Every output is complete or absent: it is written into a hidden `.OUT.partial-HOST-PID-XXXXXXXX` folder beside
--out (named after its writer), checked (an HF folder: config, code, every weight file and the tokenizer), given
the modes that the umask gives a plain mkdir and open(), flushed to disk and renamed to --out at the end. A
convert that was killed leaves its partial folder; the next convert into the same --out removes those whose
writer is no longer running. --out is never an input, a run's own file, or a folder that exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import secrets
import shutil
import socket
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import jax

from mlra_jax.checkpoint import Checkpointer
from mlra_jax.cli import add_run_argument, add_subcommand, command_parser, dtype_argument
from mlra_jax.command import command
from mlra_jax.config import CheckpointConfig, ConfigError, Experiment, ModelConfig, TrainConfig
from mlra_jax.generate import load_model
from mlra_jax.guards import InputError, check_output_path, error_summary, follow_umask
from mlra_jax.interop import StateDictError, from_state_dict, model_state_dict
from mlra_jax.interop.detect import detect_config
from mlra_jax.interop.files import parse_size, read_reference, write_reference
from mlra_jax.interop.hf_folder import DTYPES, check_hf_folder, check_repo_id, push_folder, write_hf_folder
from mlra_jax.interop.reference_config import reference_config
from mlra_jax.params import unflatten
from mlra_jax.paths import is_remote
from mlra_jax.progress import configure_cli_logging
from mlra_jax.training.state import build_setup, state_from_params

# .OUT.partial-HOST-PID-XXXXXXXX after the prefix: the host and process that write it
_PARTIAL = re.compile(r"(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}")


def _check_new_output(out: Path, inputs: Sequence[Path | str] = (), run_dirs: Sequence[Path | str] = ()) -> None:
    """Before any work: --out is a folder to make, neither an input nor a run's own files, whose parent takes it."""
    check_output_path(out, inputs, run_dirs, kind="folder", make_folder=False)  # made once the output is written
    if out.exists():
        raise ConfigError(f"{out} exists; choose another --out (nothing is overwritten)")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_partials(out: Path) -> list[Path]:
    """Remove the partial folders of `out` that a convert on this host left when it was killed (its process is
    gone), saying so; name those whose writer cannot be told (another host's, or of a version that did not record
    it). The folders removed."""
    prefix, host = f".{out.name}.partial-", socket.gethostname()
    if not out.parent.is_dir():
        return []
    removed, unknown = [], []
    for folder in sorted(p for p in out.parent.iterdir() if p.name.startswith(prefix) and p.is_dir()):
        writer = _PARTIAL.fullmatch(folder.name[len(prefix) :])
        if writer is not None and writer["host"] == host:
            if not _running(int(writer["pid"])):
                shutil.rmtree(folder)
                removed.append(folder)
                print(
                    f"removed {folder}: the unfinished output of a convert (pid {writer['pid']}) that is no longer "
                    f"running"
                )
        else:
            unknown.append(
                f"{folder} (" + (f"host {writer['host']}, pid {writer['pid']})" if writer else "no writer recorded)")
            )
    if unknown:
        print(
            f"note: {'; '.join(unknown)}: unfinished output{'s' if len(unknown) > 1 else ''} of a convert into {out} "
            f"that may still be running; remove {'them' if len(unknown) > 1 else 'it'} once it is not"
        )
    return removed


def _flush(folder: Path) -> None:
    """Every file and folder under `folder` on disk (before the rename that publishes it)."""
    for root, _, files in os.walk(folder):
        for path in [*(os.path.join(root, name) for name in files), root]:
            descriptor = os.open(path, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)


def _fresh_output(out: Path, write: Callable[[Path], Any], check: Callable[[Path], None] | None = None) -> Any:
    """Run `write` on a new folder beside `out` named after this host and process, `check` what it wrote, give it
    the umask's modes, flush it and rename it to `out`: a failure leaves nothing, a kill a folder that the next
    convert into `out` removes (remove_stale_partials)."""
    remove_stale_partials(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()  # as mkdir makes folders (tempfile.mkdtemp's are 0700: no colleague could read the output)
    try:
        result = write(tmp)
        if check is not None:
            check(tmp)
        follow_umask(tmp)
        _flush(tmp)
        if out.exists():
            raise InputError(
                f"{out} was made by another process while this convert wrote it; nothing was "
                f"overwritten, choose another --out"
            )
        tmp.rename(out)
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def to_reference(checkpoint: str, out: Path, step: int | None = None, shard_size: str = "10GB") -> str:
    """Write a run's weights in the official format into `out`; the reference model file to load them with."""
    try:
        limit = parse_size(shard_size)
    except ValueError as err:
        raise ConfigError(f"--shard_size: {err}") from None
    _check_new_output(out, run_dirs=[checkpoint])
    model, step = load_model(checkpoint, step)
    fields, reference_model = reference_config(model.config)
    config = {
        "architectures": ["GPT"],
        "model_type": "gpt2",
        **fields,
        "bias": False,
        "dropout": 0.0,
        "torch_dtype": model.config.param_dtype,
        "reference_model": reference_model,
        "mlra_jax": {"variant": model.config.variant, "source": str(checkpoint), "step": step},
    }
    state_dict = model_state_dict(model)
    files = _fresh_output(out, lambda tmp: write_reference(state_dict, config, tmp, limit))
    print(f"wrote {', '.join(files)} to {out} (step {step} of {checkpoint})")
    print(f"load it with the official {reference_model}: GPT.from_pretrained({str(out)!r})")
    return reference_model


def to_hf(
    checkpoint: str,
    out: Path,
    step: int | None = None,
    dtype: str = "float32",
    shard_size: str = "5GB",
    push: str | None = None,
) -> list[str]:
    """Write a run's model as a Hugging Face folder into `out` (and upload it to the Hub repository `push`);
    the files written."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is none of {', '.join(DTYPES)}")
    try:
        limit = parse_size(shard_size)
    except ValueError as err:
        raise ConfigError(f"--shard_size: {err}") from None
    if push is not None:
        check_repo_id(push)
    _check_new_output(out, run_dirs=[checkpoint])
    model, step = load_model(checkpoint, step)
    state_dict = model_state_dict(model)
    source = {"variant": model.config.variant, "source": str(checkpoint), "step": step}
    files = _fresh_output(
        out,
        lambda tmp: write_hf_folder(state_dict, model.config, tmp, dtype, limit, source),
        check=lambda tmp: check_hf_folder(tmp, "the export"),
    )
    print(f"wrote {', '.join(files)} to {out} (step {step} of {checkpoint}, {DTYPES[dtype]})")
    print(f"load it with transformers: AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)")
    if push is not None:
        try:
            print(f"uploaded to {push_folder(out, push)}")
        except Exception as err:  # noqa: BLE001 - the Hub client raises its own and the HTTP library's errors
            raise ConfigError(
                f"{out} is written, but uploading it to {push} failed ({error_summary(err, 300)}); "
                f"log in (hf auth login, or set HF_TOKEN) and upload it with: hf upload {push} {out}"
            ) from None
    return files


def write_run(run_dir: Path, experiment: Experiment, flat_params: dict[str, Any], source: str) -> None:
    """A run directory holding `flat_params` as its step-0 checkpoint (fresh optimizer state) and experiment.json."""
    setup = build_setup(experiment, jax.devices()[:1])
    state = state_from_params(setup, unflatten(flat_params))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "experiment.json").write_text(json.dumps(dataclasses.asdict(experiment), indent=1))
    checkpointer = Checkpointer(run_dir.absolute() / "checkpoints", CheckpointConfig(async_save=False))
    try:
        checkpointer.save(
            0,
            state,
            {"step": 0, "examples": 0, "log_window": [], "experiment": experiment.name, "converted_from": source},
        )
    finally:
        checkpointer.close()


def imported_experiment(cfg: ModelConfig, name: str, source: str) -> Experiment:
    train = TrainConfig(seq_len=min(TrainConfig().seq_len, cfg.max_seq_len))
    return Experiment(name=name, description=f"weights converted from {source}", model=cfg, train=train)


def from_reference(src: Path, out: Path, variant: str | None = None) -> ModelConfig:
    """Write the run directory `out` from an official checkpoint file or folder; the model config found."""
    _check_new_output(out, inputs=[src])
    tensors, config = read_reference(src)
    if config is None:
        raise ConfigError(
            f"{src} has no config.json beside its weights; the sizes (n_head, ranks, ...) come from "
            f"it: put the official config.json of the checkpoint there"
        )
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    try:
        cfg = detect_config(shapes, config, config.get("reference_model"), variant)
        flat = from_state_dict(tensors, cfg)  # validated completely before anything is written
    except (ConfigError, StateDictError) as err:  # named with the checkpoint they are about
        raise type(err)(f"{src}: {err}") from None
    del tensors
    experiment = imported_experiment(cfg, out.name, str(src))
    _fresh_output(out, lambda tmp: write_run(tmp, experiment, flat, str(src)))
    print(
        f"wrote run {out} ({cfg.variant}{' gated' if cfg.gated else ''}, {cfg.n_layer} layers) from {src}; "
        f"generate with mlra generate --workdir {out}, or train from it with "
        f"mlra train --init_from={out} ..."
    )
    return cfg


def _parser() -> argparse.ArgumentParser:
    parser = command_parser("mlra convert", __doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    to_hf_cmd = add_subcommand(commands, "to-hf", "a run's checkpoint -> a Hugging Face folder (transformers)")
    add_run_argument(to_hf_cmd)
    to_hf_cmd.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    to_hf_cmd.add_argument("--out", type=Path, help="output folder (must not exist; default RUN/hf)")
    to_hf_cmd.add_argument(
        "--dtype",
        default="float32",
        type=dtype_argument,
        help="dtype of the stored weights: bfloat16 or float32 (default float32)",
    )
    to_hf_cmd.add_argument(
        "--shard_size", default="5GB", help="largest model.safetensors shard (e.g. 5GB, 500MB; default 5GB)"
    )
    to_hf_cmd.add_argument(
        "--push",
        metavar="USER/NAME",
        help="also upload the folder to this Hub model repository (created if needed; needs a "
        "login: hf auth login or HF_TOKEN)",
    )
    to_ref = add_subcommand(commands, "to-reference", "a run's checkpoint -> the official code's files")
    add_run_argument(to_ref)
    to_ref.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    to_ref.add_argument("--out", type=Path, help="output folder (must not exist; default RUN/reference)")
    to_ref.add_argument("--shard_size", default="10GB", help="largest .bin file (e.g. 5GB, 500MB; default 10GB)")
    from_ref = add_subcommand(commands, "from-reference", "the official code's files -> a run directory")
    from_ref.add_argument(
        "--src",
        required=True,
        type=Path,
        help="a .pt/.bin/.safetensors file or a folder (config.json, weights or shards + index)",
    )
    from_ref.add_argument(
        "--variant",
        help="our variant (mla, mlra4, ...) or a reference file (model/mla_no_scale.py);"
        " needed only when config.json and the tensor names cannot tell",
    )
    from_ref.add_argument("--out", required=True, type=Path, help="run directory to write (must not exist)")
    return parser


def _default_out(workdir: str, name: str) -> Path:
    """An export's default folder: `name` inside the (local) run directory."""
    if is_remote(workdir):
        raise ConfigError(f"--workdir {workdir} is not a local folder: give the export's folder with --out")
    return Path(workdir) / name


@command
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_cli_logging()
    if args.command in ("to-hf", "to-reference") and args.out is None:
        args.out = _default_out(args.workdir, "hf" if args.command == "to-hf" else "reference")
    if args.command == "to-hf":
        to_hf(args.workdir, args.out, args.step, args.dtype, args.shard_size, args.push)
    elif args.command == "to-reference":
        to_reference(args.workdir, args.out, args.step, args.shard_size)
    else:
        from_reference(args.src, args.out, args.variant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
