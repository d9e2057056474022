"""Our model and GPT-2 tokenizer as an lm-evaluation-harness model, registered as "mlra_jax".

    from mlra_jax.lm_eval_model import MlraLM
    model, step = mlra_jax.generate.load_model("runs/mlra4")
    lm = MlraLM(model, batch_size=32, checkpoint="runs/mlra4", step=step)
    lm_eval.simple_evaluate(model=lm, tasks=["arc_easy"])

(`mlra eval lm-eval` does this.)

Requests are tokenized as lm-eval's Hugging Face model (HFLM) tokenizes them, through its own
TemplateLM: a context's trailing spaces move to the continuation, the pair is encoded whole and
split at the context's length, and an empty context becomes <|endoftext|>; no BOS is added (GPT-2's
tokenizer adds none). `loglikelihood` sorts requests by length (lm-eval's Collator) and scores them
in batches padded to a few shapes (mlra_jax/scoring.py); `loglikelihood_rolling` cuts documents into
lm-eval's rolling windows at max_length; `generate_until` decodes with our Generator, greedy or with
the task's sampling arguments, and cuts at the stop sequences (decoding of a row ends at the first).
Needs the `eval` extra (`pip install -e '.[eval]'`).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import jax
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from mlra_jax.config import ConfigError, MeshConfig
from mlra_jax.data.tokenizer import EOT, gpt2_tokenizer
from mlra_jax.decode.generator import Generator, Sampling
from mlra_jax.model import Transformer
from mlra_jax.progress import bars_drawn
from mlra_jax.scoring import ContinuationScorer, length_buckets
from mlra_jax.sharding import make_mesh

log = logging.getLogger(__name__)
SAMPLING_ARGUMENTS = {"do_sample", "temperature", "top_k", "top_p"}  # gen_kwargs we follow (and until, max_gen_toks)


@register_model("mlra_jax")
class MlraLM(TemplateLM):
    """lm-eval's LM interface over a Transformer; `checkpoint` and `step` name it in the results."""

    def __init__(
        self,
        model: Transformer,
        batch_size: int | str = 32,
        max_length: int | str | None = None,
        max_gen_toks: int | str = 256,
        seed: int | str = 0,
        checkpoint: str | None = None,
        step: int | None = None,
        **unused: Any,
    ):
        super().__init__()
        if str(batch_size).startswith("auto"):
            raise ConfigError("batch_size=auto is not supported; give a number of sequences (default 32)")
        self.checkpoint, self.step = checkpoint, step
        self.model, self.batch_size, self.seed = model, int(batch_size), int(seed)
        self._max_length = int(max_length if max_length not in (None, "") else model.config.max_seq_len)
        self.max_gen_toks = int(max_gen_toks)
        if self.batch_size < 1 or not 1 <= self._max_length <= model.config.max_seq_len or self.max_gen_toks < 1:
            raise ConfigError(
                f"batch_size={self.batch_size} must be >= 1, max_length={self._max_length} in "
                f"[1, {model.config.max_seq_len}] (the model's max_seq_len) and max_gen_toks="
                f"{self.max_gen_toks} >= 1"
            )
        self.tokenizer = gpt2_tokenizer()
        devices = jax.local_devices()
        data_parallel = max(d for d in range(1, len(devices) + 1) if self.batch_size % d == 0 and len(devices) % d == 0)
        mesh = make_mesh(MeshConfig(data=data_parallel), devices[:data_parallel]) if data_parallel > 1 else None
        self.scorer = ContinuationScorer(model, self.batch_size, self._max_length, mesh)
        self.generator = Generator(model, self._max_length)
        if unused:
            log.info("mlra_jax model ignores %s", ", ".join(sorted(unused)))

    # -- tokenizer: GPT-2 through tiktoken, special tokens parsed as the Hugging Face tokenizer does

    @property
    def eot_token_id(self) -> int:
        return EOT

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return "gpt2"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string, allowed_special="all")

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        keep = [t for t in tokens if t < EOT or (t == EOT and not skip_special_tokens)]  # ids above: padding
        return self.tokenizer.decode(keep)

    # -- scoring

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(log-probability, is_greedy) of each (strings, context tokens, continuation tokens); the
        sequence keeps its last max_length + 1 tokens, as HFLM truncates."""
        collator = Collator(requests, sort_fn=lambda r: (-len(r[1]) - len(r[2]), tuple(r[1] + r[2])))
        results = []
        with tqdm(
            total=len(requests), disable=disable_tqdm or not bars_drawn(), desc="loglikelihood", leave=False
        ) as bar:
            for chunk in collator.get_batched(n=self.batch_size):
                sequences = [(context + continuation)[-(self._max_length + 1) :] for _, context, continuation in chunk]
                scores = self.scorer.score(sequences, [len(continuation) for _, _, continuation in chunk])
                for (strings, _, _), answer in zip(chunk, scores):
                    results.append(answer)
                    if strings is not None:
                        self.cache_hook.add_partial("loglikelihood", strings, answer)
                bar.update(len(chunk))
        return collator.get_original(results)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood given <|endoftext|>, over lm-eval's disjoint rolling windows."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self._max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (log_prob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += log_prob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # -- generation

    def _sampling(self, gen_kwargs: dict) -> tuple[Sampling, list[str]]:
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode([EOT], False))
        ignored = set(kwargs) - SAMPLING_ARGUMENTS - {"max_gen_toks"}
        if ignored:
            log.warning("generate_until ignores %s", ", ".join(sorted(ignored)))
        sample = bool(kwargs.get("do_sample"))
        return Sampling(
            max_new_tokens=kwargs["max_gen_toks"],
            temperature=float(kwargs.get("temperature") or 0.0) if sample else 0.0,
            top_k=int(kwargs.get("top_k") or 0) if sample else 0,
            top_p=float(kwargs.get("top_p") or 1.0) if sample else 1.0,
            seed=self.seed,
        ), until

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        collator = Collator(
            [request.args for request in requests],
            group_by="gen_kwargs",
            group_fn=lambda a: a[1],
            sort_fn=lambda a: (-len(self.tok_encode(a[0])), a[0]),
        )
        results = []
        with tqdm(
            total=len(requests), disable=disable_tqdm or not bars_drawn(), desc="generate_until", leave=False
        ) as bar:
            for chunk in collator.get_batched(n=self.batch_size):
                contexts, all_kwargs = zip(*chunk)
                sampling, until = self._sampling(all_kwargs[0])
                room = self._max_length - sampling.max_new_tokens
                if room < 1:
                    raise ConfigError(
                        f"max_gen_toks={sampling.max_new_tokens} leaves no room for a prompt within "
                        f"max_length={self._max_length}"
                    )
                prompts = [self.tok_encode(context)[-room:] or [EOT] for context in contexts]
                for context, kwargs, tokens in zip(contexts, all_kwargs, self._generate(prompts, sampling, until)):
                    text = postprocess_generated_text(self.tok_decode(tokens), until, None)
                    results.append(text)
                    self.cache_hook.add_partial("generate_until", (context, kwargs), text)
                bar.update(len(chunk))
        return collator.get_original(results)

    def _generate(self, prompts: list[list[int]], sampling: Sampling, until: list[str]) -> list[list[int]]:
        """New tokens of each prompt; the batch is filled to batch_size with one-token rows and the prompts
        padded to a length bucket, so that the generator compiles few shapes."""
        longest = max(len(p) for p in prompts)
        buckets = [b for b in length_buckets(self._max_length - sampling.max_new_tokens) if b >= longest]
        tail = max(len(s) for s in until) + 8  # tokens enough to hold any stop sequence

        def stop(row: int, tokens: list[int]) -> bool:
            return row >= len(prompts) or any(s in self.tok_decode(tokens[-tail:]) for s in until if s)

        rows = prompts + [[EOT]] * (self.batch_size - len(prompts))
        return self.generator.generate(rows, sampling, stop, width=buckets[0])[: len(prompts)]

    def get_model_info(self) -> dict[str, Any]:
        """Recorded by lm-eval under the results' "config"."""
        cfg = self.model.config
        return {
            "checkpoint": self.checkpoint,
            "step": self.step,
            "variant": cfg.variant,
            "compute_dtype": cfg.compute_dtype,
            "max_length": self._max_length,
            "batch_size": self.batch_size,
        }
