"""Decoding throughput of the attention layer on several GPUs (the paper's Sec. 5 study).

    python -m mlra_jax.benchmarks.decode_throughput --out=experiments/results/decode_throughput_8gpu.json

For each variant (experiments/benchmarks.py) it shards the layer's weights and KV cache
over a DP x TP mesh of all devices, fills the cache to each context length, and times
one jitted decode step (pre-attention projections, cache write, attention; absorbed
weights for the latent family) for the whole batch: tokens/s = batch / step time.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from mlra_jax.attention import attention_class
from mlra_jax.benchmarks.common import median_time, save
from mlra_jax.config import MeshConfig
from mlra_jax.experiments.benchmarks import THROUGHPUT_CONTEXTS, THROUGHPUT_MODELS, deployment
from mlra_jax.kv_cache import cache_shardings, init_cache, slot_mask
from mlra_jax.params import logical_axes
from mlra_jax.sharding import batch_sharding, make_mesh, tree_shardings


def measure(variant: str, contexts: list[int], repeats: int, impl: str = "xla") -> list[dict]:
    cfg = THROUGHPUT_MODELS[variant]
    if impl != "xla" and cfg.spec.latent_layout:  # the Pallas kernels cover the latent family's decode
        cfg = dataclasses.replace(cfg, attention_impl=impl)
    tp, dp, batch = deployment(variant, jax.device_count())
    mesh = make_mesh(MeshConfig(data=dp, tensor=tp))
    attn = attention_class(variant)(cfg, rngs=nnx.Rngs(params=0))
    graphdef, params = nnx.split(attn)[0], nnx.to_pure_dict(nnx.state(attn, nnx.Param))
    axes = {k: v[1:] if v and v[0] == "layers" else v for k, v in logical_axes(attn).items()}
    results = []
    with jax.set_mesh(mesh):
        params = jax.device_put(params, tree_shardings(params, axes, mesh))

        def step(params, x, state):
            positions, mask = slot_mask(state, 1)
            layer = {k: v[0] for k, v in state.kv.items()}
            heads, layer = nnx.merge(graphdef, params).write_and_attend(x, positions, layer, mask, state.index,
                                                                         dict(state.plans), absorbed=True)
            return heads, dataclasses.replace(state, kv={k: v[None] for k, v in layer.items()}, index=state.index + 1)

        jitted = jax.jit(step, donate_argnums=(2,))
        x = jax.device_put(jax.random.normal(jax.random.key(0), (batch, 1, cfg.n_embd), jnp.bfloat16),
                           batch_sharding(mesh, 3))
        for context in contexts:
            state = init_cache(cfg, batch, context + repeats + 8, mesh=mesh)
            kv = {k: jax.random.normal(jax.random.key(1), v.shape, v.dtype) for k, v in state.kv.items()}
            holder = {"state": dataclasses.replace(state, kv=jax.device_put(kv, cache_shardings(cfg, mesh)),
                                                   index=jnp.int32(context))}

            def run():
                heads, holder["state"] = jitted(params, x, holder["state"])
                return heads

            seconds = median_time(run, repeats=repeats)
            results.append({"variant": variant, "tp": tp, "dp": dp, "devices": jax.device_count(), "batch": batch,
                            "context": context, "attention_impl": cfg.attention_impl, "step_time_s": seconds,
                            "tokens_per_s": batch / seconds})
            print(f"{variant:6} TP={tp} DP={dp} B={batch:<4} ctx={context:<6} {seconds * 1e3:8.3f} ms  "
                  f"{batch / seconds:12,.0f} tokens/s", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlra_jax.benchmarks.decode_throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="gqa,mla,gla2,mlra4")
    parser.add_argument("--contexts", default=",".join(map(str, THROUGHPUT_CONTEXTS)))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--attention_impl", default="xla", choices=("xla", "pallas"),
                        help="pallas: the latent family decodes with the Pallas kernels (GQA stays on XLA)")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/decode_throughput.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    contexts = [int(c) for c in args.contexts.split(",")]
    results = []
    for variant in args.variants.split(","):
        try:
            results += measure(variant, contexts, args.repeats, args.attention_impl)
        except Exception as err:  # noqa: BLE001 - record it and measure the other variants
            message = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            results.append({"variant": variant, "attention_impl": args.attention_impl, "error": message})
            print(f"{variant}: failed: {message}", flush=True)
    record = save(args.out, "decode_throughput", results)
    print(f"saved {args.out} ({record['device']} x{record['device_count']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
