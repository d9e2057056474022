"""Generate text from a trained run: `mlra generate --workdir runs/mlra4_tiny --prompt "..."`.

    mlra generate --workdir runs/mlra4_tiny --prompt "The return value" --prompt "A list" \\
        --max_new_tokens 40 --temperature 0.8 --top_p 0.95

--workdir is a run directory (experiment.json and checkpoints/); the newest
complete checkpoint is used unless --step names one. Prompts are batched with left
padding; decoding stops at <|endoftext|> or after --max_new_tokens. Bad input exits 2 with one line
(mlra_jax/command.py).

--tensor N (and --data M) serve over a mesh of this process's first N x M devices: the heads, latent blocks and
MLP split over `tensor` (the latent family's blocks as one region each, decode.region_block), the prompts over
`data`, with the same tokens as one device gives up to rounding:

    mlra generate --workdir runs/mlra4_2p9b --tensor 4 --prompt "The return value"
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
from flax import nnx

from mlra_jax.checkpoint import Checkpointer, CheckpointError
from mlra_jax.cli import add_run_argument, command_parser
from mlra_jax.command import command
from mlra_jax.config import CheckpointConfig, ConfigError, MeshConfig
from mlra_jax.data.tokenizer import EOT, gpt2_tokenizer
from mlra_jax.decode.generator import STEPS_PER_CALL, GenerationError, Generator, Sampling
from mlra_jax.guards import check_finite, error_summary
from mlra_jax.model import Transformer, abstract_model
from mlra_jax.params import logical_axes
from mlra_jax.paths import as_path
from mlra_jax.progress import configure_cli_logging
from mlra_jax.run_config import run_experiment
from mlra_jax.sharding import make_mesh, tree_shardings


def load_model(
    run_dir: str | os.PathLike,
    step: int | None = None,
    compute_dtype: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[Transformer, int]:
    """The model of a run's newest (or given) checkpoint, on one device or restored sharded over `mesh` as
    its logical axes split it; (model, step). Only the parameters are read (not the optimizer state). `run_dir` is
    a local folder or a URL (gs://...); `compute_dtype` ("float32", "bfloat16") overrides the run's."""
    run_dir = as_path(run_dir)
    experiment = run_experiment(run_dir)
    if compute_dtype is not None:
        experiment = dataclasses.replace(
            experiment, model=dataclasses.replace(experiment.model, compute_dtype=compute_dtype)
        )
    model = abstract_model(experiment.model)
    graphdef, params = nnx.split(model)[0], nnx.to_pure_dict(nnx.state(model, nnx.Param))
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: device, params)
    else:
        shardings = tree_shardings(params, logical_axes(model), mesh)
    abstract = {
        "params": jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, shardings)
    }
    checkpointer = Checkpointer(run_dir / "checkpoints", CheckpointConfig(), read_only=True)
    steps = checkpointer.steps()
    if step is not None and step not in steps:
        checkpointer.close()
        raise ConfigError(f"no checkpoint at step {step} in {checkpointer.directory} (steps: {steps})")
    try:
        restored = checkpointer.restore_latest(abstract) if step is None else checkpointer.restore_step(step, abstract)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of the named step, reported without a traceback
        raise CheckpointError(
            f"checkpoint {checkpointer.directory / str(step)} does not restore "
            f"({error_summary(err, 300)}); nothing was changed"
        ) from err
    finally:
        checkpointer.close()
    if restored is None:
        raise ConfigError(f"{run_dir / 'checkpoints'} holds no complete checkpoint")
    earlier = [s for s in steps if s < restored[0]]
    check_finite(
        restored[1]["params"],
        f"checkpoint {checkpointer.directory / str(restored[0])} (step {restored[0]})",
        fix=(
            f"pass --step with an earlier checkpoint ({', '.join(map(str, earlier))})"
            if earlier
            else "the run has no earlier checkpoint; train it again from its last good weights"
        ),
    )
    return nnx.merge(graphdef, restored[1]["params"]), restored[0]


def serving_devices(tensor: int, data: int) -> list[jax.Device]:
    """The first tensor x data of this process's devices, or a GenerationError that says how many there are."""
    if tensor < 1 or data < 1:
        raise GenerationError(f"--tensor {tensor} --data {data}: give 1 or more of each")
    local = jax.local_devices()
    if tensor * data > len(local):
        raise GenerationError(
            f"--tensor {tensor} x --data {data} needs {tensor * data} devices; this process has {len(local)} "
            f"({local[0].platform}): give a product of at most {len(local)}"
        )
    return local[: tensor * data]


@command
def main(argv: list[str] | None = None) -> int:
    parser = command_parser("mlra generate", __doc__)
    add_run_argument(parser)
    parser.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=0)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max_len",
        type=int,
        help="cache length: the prompt and the new tokens (1 to the model's max_seq_len, the default)",
    )
    parser.add_argument(
        "--steps_per_call",
        type=int,
        default=STEPS_PER_CALL,
        help="decode steps per compiled call (on GPUs a step's CUDA graphs are recorded once per call; "
        "the steps after every prompt has ended are dropped)",
    )
    parser.add_argument(
        "--tensor", type=int, default=1, help="tensor-parallel devices to serve over (this process's devices)"
    )
    parser.add_argument("--data", type=int, default=1, help="data-parallel devices: the prompts split over them")
    parser.add_argument("--json", action="store_true", help="print JSON records")
    args = parser.parse_args(argv)
    configure_cli_logging()
    sampling = Sampling(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )  # checked before the model loads
    if args.steps_per_call < 1:
        raise GenerationError(f"--steps_per_call {args.steps_per_call} is out of range: give 1 or more")
    devices = serving_devices(args.tensor, args.data)
    if args.max_len is not None and args.max_len < 1:
        raise GenerationError(f"--max_len {args.max_len} is out of range: give 1 to the model's max_seq_len")
    mesh = make_mesh(MeshConfig(data=args.data, tensor=args.tensor), devices) if len(devices) > 1 else None
    model, step = load_model(args.workdir, args.step, mesh=mesh)
    max_len = model.config.max_seq_len if args.max_len is None else args.max_len
    if max_len > model.config.max_seq_len:
        raise GenerationError(
            f"--max_len {max_len} exceeds the model's max_seq_len {model.config.max_seq_len} (the "
            f"longest context it was built for); give --max_len from 1 to {model.config.max_seq_len}"
        )
    tokenizer = gpt2_tokenizer()
    prompts = [[EOT, *tokenizer.encode_ordinary(p)] for p in args.prompt]
    generator = Generator(model, max_len, mesh=mesh, keep_model=False, steps_per_call=args.steps_per_call)
    del model  # generate reads the serving copy (cast to the compute dtype): the float32 weights are freed
    outputs = generator.generate(prompts, sampling)
    for prompt, tokens in zip(args.prompt, outputs):
        text = tokenizer.decode([t for t in tokens if t != EOT])
        print(
            json.dumps({"prompt": prompt, "completion": text, "tokens": tokens, "step": step})
            if args.json
            else f"--- {prompt!r} (checkpoint step {step})\n{prompt}{text}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
