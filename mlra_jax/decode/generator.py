"""Batched generation: left-padded prompts, prefill, absorbed decode steps, sampling, EOS.

    generator = Generator(model, max_len=512)
    outputs = generator.generate([[50256, 464, 3290], [50256, 40]], Sampling(temperature=0.8, top_p=0.95))

Prompts of different lengths are left-padded into one batch; every sequence counts
positions from its own first token (the cache's `starts`), so a prompt gives the same
logits in a batch as alone (RoPE is translation equivariant, paper App. B).

`generate` runs the serving path (decode.serving: weights cast once, per-layer caches updated
in place, capacity in buckets, chunked prefill, last-position logits). `prefill` and `step`
are the model's own forward_cached over a stacked cache with every position's logits
(scoring, tests: the definition the serving path is tested against).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mlra_jax.decode.serving import MIN_BUCKET, PREFILL_CHUNK, ServingModel
from mlra_jax.kv_cache import DecodeState, init_cache
from mlra_jax.model import Transformer

# Decode steps per call in `generate`: on GPUs XLA records a step's CUDA graphs again whenever the step's buffers
# moved since it last ran, which steps dispatched back to back make them do; the steps of one call share its
# buffers. A call's steps after every row has ended are wasted.
STEPS_PER_CALL = 8


class GenerationError(ValueError):
    """A prompt or request that cannot be served; the message says why and what to change."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; top_k 0 and top_p 1 disable those filters."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    eos_id: int | None = 50256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
        temperature_ok = math.isfinite(self.temperature) and self.temperature >= 0
        if not temperature_ok or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise GenerationError(
                f"temperature={self.temperature} must be >= 0, top_k={self.top_k} >= 0 and top_p={self.top_p} in (0, 1]"
            )
        if not -(2**63) <= self.seed < 2**63:  # what jax.random.key takes
            raise GenerationError(f"seed={self.seed} is out of range: give a 64-bit integer, from -2**63 to 2**63 - 1")


def sample(logits: jax.Array, key: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """Next tokens [B] from logits [B, V]: greedy, or temperature with top-k and nucleus filtering."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        before = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1) - jax.nn.softmax(sorted_logits, -1)
        sorted_logits = jnp.where(before >= top_p, -jnp.inf, sorted_logits)  # keep the smallest head reaching top_p
        logits = jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int = 0, width: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, T], starts [B]) with every prompt ending at column T - 1; T is the longest prompt's
    length, or `width` (at least that) to keep the compiled shapes few."""
    width = max(max(len(p) for p in prompts), width or 0)
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt) :] = prompt
    return tokens, np.array([width - len(p) for p in prompts], np.int32)


class Generator:
    """Jitted prefill and decode steps over one model; `mesh` shards the cache and the weights' use."""

    def __init__(
        self,
        model: Transformer,
        max_len: int,
        mesh: jax.sharding.Mesh | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        min_bucket: int = MIN_BUCKET,
        serving: ServingModel | None = None,
        keep_model: bool = True,
        steps_per_call: int = STEPS_PER_CALL,
    ):
        """serving: the model already prepared for serving (its weights are a copy of the model's: pass it
        rather than have a second one made); else made on first use with mesh, prefill_chunk and min_bucket.
        keep_model=False prepares the serving model now and keeps no reference to the model's parameters:
        generate runs as before, the stacked-cache prefill and step refuse, and the model's float32 weights
        are freed once the caller drops the model (2.9B: 11.6 GB beside the 5.8 GB bf16 serving copy).
        steps_per_call: decode steps that `generate` runs in one call (ServingModel.sampled_steps)."""
        if max_len < 1:
            raise GenerationError(f"max_len={max_len} must be at least 1 (the cache holds the prompt and new tokens)")
        if serving is not None and (serving.cfg != model.config or serving.mesh is not mesh):
            raise ValueError("the serving model must be prepared from the same model config and on the same mesh")
        if steps_per_call < 1:
            raise GenerationError(f"steps_per_call={steps_per_call} must be at least 1")
        self.cfg, self.max_len, self.mesh = model.config, max_len, mesh
        self.steps_per_call = steps_per_call
        self.graphdef, params = nnx.split(model)[0], nnx.to_pure_dict(nnx.state(model, nnx.Param))
        self._serving_options = dict(mesh=mesh, prefill_chunk=prefill_chunk, min_bucket=min_bucket)
        self._serving = serving if keep_model or serving else ServingModel(model, **self._serving_options)
        self.params: dict | None = params if keep_model else None

        def forward(params, tokens, state, absorbed):
            return nnx.merge(self.graphdef, params).forward_cached(tokens, state, absorbed)

        self._prefill = jax.jit(lambda p, t, s: forward(p, t, s, False))
        self._step = jax.jit(lambda p, t, s: forward(p, t, s, True))
        self._samplers: dict[tuple[float, int, float], Callable] = {}  # one object per setting: one compilation

    def check(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, width: int | None = None) -> None:
        if not prompts:
            raise GenerationError("no prompts given")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise GenerationError(f"prompt {i} is empty; start it with <|endoftext|> (50256) at least")
            bad = [t for t in prompt if not 0 <= int(t) < self.cfg.vocab_size]
            if bad:
                raise GenerationError(
                    f"prompt {i} holds token id {bad[0]}, outside the vocabulary [0, {self.cfg.vocab_size})"
                )
        longest = max(len(p) for p in prompts)
        padded = f"{width} tokens padded" if width and width > longest else f"{longest} tokens"
        if max(longest, width or 0) + max_new_tokens > self.max_len:
            raise GenerationError(
                f"the longest prompt ({padded}) plus max_new_tokens={max_new_tokens} "
                f"exceeds the cache length max_len={self.max_len}; raise max_len or shorten it"
            )

    def prefill(self, prompts: Sequence[Sequence[int]], width: int | None = None) -> tuple[jax.Array, DecodeState]:
        """Logits of every prompt position [B, T, V] and the filled cache (T: see left_pad)."""
        tokens, starts = left_pad(prompts, width=width)
        state = init_cache(self.cfg, len(prompts), self.max_len, starts, mesh=self.mesh)
        return self._run(self._prefill, tokens, state)

    def step(self, tokens: jax.Array, state: DecodeState) -> tuple[jax.Array, DecodeState]:
        """One decode step: logits [B, 1, V] of tokens [B, 1] and the updated cache."""
        return self._run(self._step, tokens, state)

    def _run(self, fn, tokens, state):
        if self.params is None:
            raise GenerationError(
                "this Generator was made with keep_model=False: it serves generate only; make one "
                "with keep_model=True for the stacked-cache prefill and step"
            )
        if self.mesh is None:
            return fn(self.params, jnp.asarray(tokens), state)
        with jax.set_mesh(self.mesh):
            return fn(self.params, jnp.asarray(tokens), state)

    def sampler(self, sampling: Sampling) -> Callable[[jax.Array, jax.Array], jax.Array]:
        """sample() with the setting's temperature, top-k and top-p, jitted: one object per setting, which the
        serving path's sampled steps compile once for."""
        setting = sampling.temperature, sampling.top_k, sampling.top_p
        if setting not in self._samplers:
            self._samplers[setting] = jax.jit(
                functools.partial(sample, temperature=setting[0], top_k=setting[1], top_p=setting[2])
            )
        return self._samplers[setting]

    @property
    def serving(self) -> ServingModel:
        """The serving path's model (weights cast and split on first use)."""
        if self._serving is None:
            self._serving = ServingModel(nnx.merge(self.graphdef, self.params), **self._serving_options)
        return self._serving

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling = Sampling(),
        stop: Callable[[int, list[int]], bool] | None = None,
        width: int | None = None,
    ) -> list[list[int]]:
        """New tokens per prompt on the serving path, ending at (and including) EOS or after max_new_tokens.
        `stop(row, tokens)`, asked after each new token of a row still running, ends that row when it returns
        True (a stop sequence reached, say); decoding ends when every row has ended. `width` pads the prompts
        to at least that many columns (fewer compiled shapes across calls)."""
        self.check(prompts, sampling.max_new_tokens, width)
        if sampling.top_k > self.cfg.vocab_size:
            raise GenerationError(
                f"top_k={sampling.top_k} exceeds the vocabulary of {self.cfg.vocab_size} tokens; "
                f"use top_k <= {self.cfg.vocab_size} (0 disables it)"
            )
        tokens, starts = left_pad(prompts, width=width)
        logits, session = self.serving.prefill(tokens, starts, sampling.max_new_tokens, self.max_len)
        key, draw_key = jax.random.split(jax.random.key(sampling.seed))
        sampler = self.sampler(sampling)
        outputs: list[list[int]] = [[] for _ in prompts]
        done = np.zeros(len(prompts), bool)
        drawn = sampler(logits, draw_key)[:, None]  # [B, tokens]: the tokens drawn by the last call
        remaining = sampling.max_new_tokens - 1
        while True:
            # The next call (several decode steps that sample) is dispatched before this call's tokens reach the
            # host, so that the host's work (dispatch, stop checks) overlaps the device's; when every row ends
            # here it is wasted, and so are a call's steps after every row has ended.
            upcoming = None
            if remaining:
                steps = min(self.steps_per_call, remaining)
                upcoming, key = self.serving.sampled_steps(drawn[:, -1], session, key, sampler, steps)
                remaining -= steps
            for column in np.asarray(drawn).T:
                for row in np.flatnonzero(~done):
                    outputs[row].append(int(column[row]))
                    if stop is not None and stop(int(row), outputs[row]):
                        done[row] = True
                if sampling.eos_id is not None:
                    done |= column == sampling.eos_id
                if done.all():
                    return outputs
            if upcoming is None:
                return outputs
            drawn = upcoming
