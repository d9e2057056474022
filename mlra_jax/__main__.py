"""One entry for every command: `mlra COMMAND ...` (the console script) or `python -m mlra_jax COMMAND ...`.

    mlra train --experiment=mlra4_tiny          # the same as python -m mlra_jax.train --experiment=mlra4_tiny
    mlra bench train --n_layer=8                # python -m mlra_jax.benchmarks.train --n_layer=8
    mlra COMMAND --help                         # a command's options

Each command is its module's `main`; the `python -m mlra_jax.MODULE` forms keep working.
"""

from __future__ import annotations

import difflib
import importlib
import sys

# command -> (module, what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("mlra_jax.train", "train or resume an experiment; --dry_run, --compile_for=TPU_SLICE"),
    "info": ("mlra_jax.info", "experiments, parameter counts, KV cache per token, the paper's Tables 1-2"),
    "prepare": ("mlra_jax.data.prepare", "tokenize text (files, Hugging Face or TFDS datasets) into llm.c shards"),
    "generate": ("mlra_jax.generate", "continue prompts from a run's checkpoint"),
    "eval": ("mlra_jax.eval", "perplexity on held-out token files, lm-evaluation-harness tasks"),
    "convert": ("mlra_jax.convert", "checkpoints to Hugging Face and to or from the official PyTorch files"),
    "plot": ("mlra_jax.plot", "loss curves of runs"),
    "bench": ("mlra_jax.benchmarks", "benchmarks: mlra bench NAME (names listed by mlra bench --help)"),
}
BENCHMARKS: dict[str, str] = {
    "train": "training tokens/s, MFU, memory (--reference: the official code's figures beside)",
    "reference": "put the official code's figures beside a saved train benchmark record",
    "interleaved": "two settings of one train step alternated on one state (the same GPU clocks for both)",
    "loss_parity": "loss curves of training settings against a reference setting, over seeds and repeated runs",
    "attention_kernels": "the training attention: cuDNN against the Pallas kernels JAX ships and our MLRA kernel",
    "optimizer": "the update after the backward (clipping, AdamW) against its memory-traffic floor",
    "tpu_compile": "the paper's experiments compiled for TPU slices",
    "decode": "decode attention and whole-model decode steps",
    "decode_throughput": "the paper's decoding-throughput study",
    "throughput_figure": "the decoding-throughput study's figure from a decode_throughput record",
    "latent_kernel": "the Mosaic GPU latent decode kernel: self-check, tuning, bound",
    "row_products": "the batch-1 row kernels against XLA's GEMMs",
    "elementwise": "training's fused norm and SwiGLU kernels against XLA's fusions (model.fused_elementwise)",
    "dependent_launch": "whether programmatic dependent launch overlaps a chain of Pallas kernels on this GPU",
}


def usage(commands: dict[str, str], prog: str) -> str:
    width = max(map(len, commands))
    rows = "\n".join(f"  {name:{width}}  {what}" for name, what in commands.items())
    return (
        f"usage: {prog} COMMAND [ARGS ...]\n\ncommands:\n{rows}\n\n{prog} COMMAND --help shows a command's options"
        + ("; mlra --version the installed version" if prog == "mlra" else "")
    )


def _unknown(name: str, known: dict, prog: str) -> int:
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    print(f"error: unknown command {name!r}{hint}\n\n{usage(known, prog)}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run `mlra COMMAND ARGS`: the command's own main with ARGS; its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {name: what for name, (_, what) in COMMANDS.items()}
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(commands, "mlra"))
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from mlra_jax import __version__

        print(f"mlra_jax {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        return _unknown(name, commands, "mlra")
    module = COMMANDS[name][0]
    if name == "bench":
        if not rest or rest[0] in ("-h", "--help"):
            print(usage(BENCHMARKS, "mlra bench"))
            return 0 if rest else 2
        if rest[0] not in BENCHMARKS:
            return _unknown(rest[0], BENCHMARKS, "mlra bench")
        module, rest = f"mlra_jax.benchmarks.{rest[0]}", rest[1:]
    return importlib.import_module(module).main(rest)


if __name__ == "__main__":
    sys.exit(main())
