"""Frozen, validated configuration dataclasses.

A bad value fails at construction with a `ConfigError` that names the field and
the values it accepts, so a typo never reaches a compiled program.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, Iterable, Literal

import jax.numpy as jnp

from mlra_jax.variants import LATENT_FIELDS, SPECS, VARIANTS, VariantSpec

# The variant-specific fields: each variant requires some of them and takes no others
OPTIONAL_FIELDS = ("head_dim", "group_size", "tpa_rank", "tpa_q_rank", *LATENT_FIELDS)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "splash", "pallas", "mlra_kernel")
# auto: the least recomputation that fits the device's memory (training.remat_choice)
REMAT_POLICIES = ("none", "full", "dots", "dots_attn", "dots_attn_kv", "dots_attn_qkv", "auto")
LATENT_FORMS = ("auto", "expanded", "absorbed")
LATENT_KEYS = ("auto", "product", "concat")
FSDP_GATHER = ("auto", "step", "micro_batch")
MATMUL_DTYPES = ("compute", "float8")  # compute: the compute dtype
FP8_SCALINGS = ("delayed", "dynamic")
FUSED_ELEMENTWISE = ("off", "auto", "on", "norms", "swiglu")
FP8_CASTS = ("auto", "kernel", "xla")  # mlra_jax.fp8_casts
FP8_HEADS = ("off", "gradients", "all")  # mlra_jax.fp8_head
MLRA_BACKWARDS = ("auto", "stored_ds", "recomputed_ds")  # the MLRA kernel's backward (attention.mlra_kernel)
# Fields that choose how a model runs, not what it computes: a run may resume with other values.
RUNTIME_FIELDS = (
    "attention_impl",
    "remat",
    "scan_layers",
    "compute_dtype",
    "latent_form",
    "latent_keys",
    "mlra_backward",
    "matmul_dtype",
    "fp8_scaling",
    "fp8_casts",
    "fused_elementwise",
    "fp8_attention",
    "fp8_head",
)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """'; did you mean X?' for the closest of `candidates` (hyphens and underscores alike), or ''."""
    normal = {c.replace("-", "_"): c for c in candidates}
    close = difflib.get_close_matches(word.replace("-", "_"), list(normal), n=1, cutoff=0.6)
    return f" (did you mean {normal[close[0]]}?)" if close else ""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _check_choice(field: str, value: Any, allowed: tuple | list) -> None:
    _require(value in allowed, f"{field}={value!r} is not valid; allowed values: {', '.join(map(str, allowed))}")


# The largest count a field takes: JAX indexes and shapes arrays with 32-bit integers
MAX_COUNT = 2**31 - 1
# Layers at most (the largest published decoders have a few hundred); more is a typo, not a model
MAX_LAYERS = 4096


def _check_positive(obj: Any, *fields: str) -> None:
    for name in fields:
        value = getattr(obj, name)
        if value is not None:
            _require(
                isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_COUNT,
                f"{name}={value!r} must be a positive integer of at most {MAX_COUNT:,} (2**31 - 1)",
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Llama-3 decoder with one of the paper's attention variants.

    Field names follow the reference GPTConfig where one exists (docs/conventions.md);
    `d_h` is `head_dim` for MHA/GQA/MQA/MFA/TPA/GTA and `qk_nope_head_dim` for the
    latent family (MLA, GLA, MLRA), whose RoPE width is `qk_rope_head_dim`.
    """

    variant: str = dataclasses.field(metadata={"choices": VARIANTS})  # the attention variant (mlra_jax.variants)
    n_layer: int  # decoder layers
    n_head: int  # query heads
    n_embd: int  # model width d
    intermediate_size: int  # SwiGLU hidden width of each MLP
    vocab_size: int = 50304  # embedding rows: GPT-2's 50257 tokens padded to a multiple of 64
    head_dim: int | None = None  # d_h of MHA, GQA, MQA, MFA, TPA and GTA (None: n_embd / n_head)
    group_size: int | None = None  # query heads per KV head (GQA, GTA); MQA: n_head
    q_lora_rank: int | None = None  # d_c' (latent family); share_q_dim (MFA)
    kv_lora_rank: int | None = None  # d_c
    qk_nope_head_dim: int | None = None  # d_h of the latent family
    qk_rope_head_dim: int | None = None  # d_h^R
    tpa_rank: int | None = None  # beta_kv
    tpa_q_rank: int | None = None  # beta_q
    gated: bool = False  # sigmoid gate before the output projection
    # The sqrt(d/d_c') and sqrt(d/d_c) latent scales and MLRA's 1/sqrt(branches) output scale;
    # False is the no-scale ablation (as the reference *_no_scale.py files compute it).
    latent_scale: bool = True
    output_init: Literal["zero", "normal"] = "zero"  # init of the two output projections
    init_std: float = 0.02  # standard deviation of the normal initialization of the weights
    rope_theta: float = 10000.0  # RoPE base frequency
    norm_eps: float = 1e-6  # epsilon of the RMSNorms
    max_seq_len: int = 2048  # longest sequence the model takes (RoPE table, train.seq_len and decoding's limit)
    # dtype of the stored weights and optimizer state
    param_dtype: str = dataclasses.field(default="float32", metadata={"choices": tuple(DTYPES)})
    # dtype of the activations and matmuls (bfloat16 on accelerators)
    compute_dtype: str = dataclasses.field(default="float32", metadata={"choices": tuple(DTYPES)})
    # auto: the fastest kernel for the backend and shape (attention.fused; the latent family's decode steps:
    # attention.latent_kernels), else XLA; xla, cudnn, splash: that one (a kernel that cannot run is an error);
    # pallas: the latent decode kernels, else as auto; mlra_kernel: the latent family's absorbed training attention
    # (latent_form auto or absorbed, one device's layer) on our MLRA kernel (Mosaic GPU, Hopper; attention.mlra_kernel),
    # else as auto
    attention_impl: str = dataclasses.field(default="auto", metadata={"choices": ATTENTION_IMPLS})
    scan_layers: bool = True  # one scanned layer body (compile time flat in depth); false unrolls the layers
    # what the backward recomputes, least first: none, dots_attn_qkv, dots_attn_kv, dots_attn, dots, full; auto: the
    # least that fits the device's memory
    remat: str = dataclasses.field(default="none", metadata={"choices": REMAT_POLICIES})
    # Training attention of the latent family (same math, same FLOPs): "expanded" up-projects per-head keys and
    # values; "absorbed" folds W_UK into the query and applies W_UV after the attention, so that each latent block
    # is one KV head ([block || RoPE key], value the block) shared by its query heads. "auto": absorbed where our
    # MLRA kernel runs it (MLRA-2 and MLRA-4 on a Hopper GPU in bf16, one device's layer; MLRA-4's 8-layer step 5%
    # faster on an H200, docs/performance.md), expanded elsewhere (on cuDNN's attention the faster form).
    latent_form: str = dataclasses.field(default="auto", metadata={"choices": LATENT_FORMS})
    # How the expanded form builds each head's key [k_nope || k_rope]: "product" multiplies [block || RoPE key] by
    # [[W_UK, 0], [0, I]] (the keys come out of one matmul, no concatenation of per-head keys forward or backward);
    # "concat" up-projects k_nope and concatenates the RoPE key to it. "auto": product where a block is at most
    # LatentAttention.PRODUCT_KEYS_MAX_RANK wide (where it measured faster), concat elsewhere.
    latent_keys: str = dataclasses.field(default="auto", metadata={"choices": LATENT_KEYS})
    # The backward of our MLRA kernel (where it trains the absorbed form): "stored_ds": its dK/dV kernel stores the
    # score gradients dS (bf16, batch x query heads x T^2 bytes per layer while that layer's backward runs) and its
    # dQ kernel reads them (MLRA-4's layer 10% faster on an H200); "recomputed_ds": the dQ kernel recomputes them
    # (more FLOPs, no extra memory); "auto": stored where a layer's dS takes at most 8 GiB on a device
    # (attention.mlra_kernel.STORED_DS_BYTES: MLRA-4 at 2,048 tokens up to 20 sequences a device, at 8,192 one)
    mlra_backward: str = dataclasses.field(default="auto", metadata={"choices": MLRA_BACKWARDS})
    # Training's projections (attention and MLP; not the tied head, kv_up or the attention core) in the compute
    # dtype, or "float8": FP8 GEMMs with per-tensor scaling on GPUs that have them (mlra_jax.fp8), with a
    # bfloat16 compute_dtype; evaluation, decoding and export stay in the compute dtype
    matmul_dtype: str = dataclasses.field(default="compute", metadata={"choices": MATMUL_DTYPES})
    # FP8 scales: "delayed" for activations and gradients from their absolute maxima of the previous step (an amax
    # history of fp8.HISTORY steps, kept in the train state and checkpoints; one pass over each tensor), weights by
    # their own; "dynamic" from each tensor's own absolute maximum (two passes, no state)
    fp8_scaling: str = dataclasses.field(default="delayed", metadata={"choices": FP8_SCALINGS})
    # How float8 matmuls quantize their activations and gradients, in both layouts their GEMMs read: "auto" (or
    # "kernel") one Pallas Triton pass per operand on NVIDIA GPUs, outside tensor parallelism (mlra_jax.fp8_casts;
    # 1.8-2.0x as fast as XLA's fusion on an H200); "xla" XLA's fusions. Weights are quantized by XLA either way
    fp8_casts: str = dataclasses.field(default="auto", metadata={"choices": FP8_CASTS})
    # Training's elementwise passes on single-pass Pallas Triton kernels (mlra_jax.fused_elementwise), NVIDIA GPUs:
    # "norms" each residual add with the RMSNorm after it (one pass forward, one backward), "swiglu" the SwiGLU's
    # backward, "on" both; "auto" those measured faster on an H100 (both); "off" XLA's fusions. Elsewhere XLA's
    # ("on", "norms" and "swiglu" log one line)
    fused_elementwise: str = dataclasses.field(default="auto", metadata={"choices": FUSED_ELEMENTWISE})
    # true: with float8 and delayed scaling, the training attention core of layers whose queries, keys and values
    # are 128 wide runs on cuDNN's FP8 flash attention (attention.fp8_attention; Hopper GPUs, sequences of
    # multiples of 128), with amax histories in the train state. Experimental and off by default: on one H100 it
    # runs forward + backward at 0.66x bf16 cuDNN's rate, the GQA proxy's FP8 step takes 3.8% longer with it, and
    # its loss against bf16 has not been measured
    fp8_attention: bool = False
    # With float8, the tied head's GEMMs in FP8 too (mlra_jax.fp8_head: e4m3 hidden states and embedding scaled by
    # their own amaxes, the logits' gradient in e5m2 at a fixed scale; no state): "gradients" the two backward
    # GEMMs (the hidden states' and the embedding's gradients), "all" the logits' too; "off" the head in the compute
    # dtype
    fp8_head: str = dataclasses.field(default="off", metadata={"choices": FP8_HEADS})

    def __post_init__(self) -> None:
        _check_choice("variant", self.variant, VARIANTS)
        _check_positive(
            self, "n_layer", "n_head", "n_embd", "intermediate_size", "vocab_size", "max_seq_len", *OPTIONAL_FIELDS
        )
        _require(
            self.n_layer <= MAX_LAYERS,
            f"n_layer={self.n_layer} is more layers than any model has; give at most {MAX_LAYERS}",
        )
        _check_choice("output_init", self.output_init, ("zero", "normal"))
        _check_choice("param_dtype", self.param_dtype, tuple(DTYPES))
        _check_choice("compute_dtype", self.compute_dtype, tuple(DTYPES))
        _check_choice("attention_impl", self.attention_impl, ATTENTION_IMPLS)
        _check_choice("remat", self.remat, REMAT_POLICIES)
        _check_choice("latent_form", self.latent_form, LATENT_FORMS)
        _check_choice("latent_keys", self.latent_keys, LATENT_KEYS)
        _check_choice("mlra_backward", self.mlra_backward, MLRA_BACKWARDS)
        _check_choice("matmul_dtype", self.matmul_dtype, MATMUL_DTYPES)
        _check_choice("fp8_scaling", self.fp8_scaling, FP8_SCALINGS)
        _check_choice("fused_elementwise", self.fused_elementwise, FUSED_ELEMENTWISE)
        _check_choice("fp8_casts", self.fp8_casts, FP8_CASTS)
        _check_choice("fp8_head", self.fp8_head, FP8_HEADS)
        _require(
            self.matmul_dtype != "float8" or self.compute_dtype == "bfloat16",
            f"matmul_dtype='float8' trains with compute_dtype='bfloat16' (now {self.compute_dtype!r}); set "
            "--model.compute_dtype=bfloat16",
        )
        _require(
            self.latent_form != "absorbed" or self.spec.latent_layout is not None,
            f"latent_form={self.latent_form!r} applies to the latent family (MLA, GLA, MLRA), not variant "
            f"{self.variant!r}; leave it unset",
        )
        _require(
            self.attention_impl != "mlra_kernel"
            or (self.latent_form != "expanded" and self.spec.latent_layout is not None),
            f"attention_impl='mlra_kernel' runs the latent family's absorbed training attention (variant "
            f"{self.variant!r}, latent_form={self.latent_form!r}); set --model.latent_form=absorbed on MLA, GLA or "
            "MLRA (or leave it at auto), or another attention_impl",
        )
        _require(
            self.latent_keys == "auto" or self.spec.latent_layout is not None,
            f"latent_keys={self.latent_keys!r} applies to the latent family (MLA, GLA, MLRA), not variant "
            f"{self.variant!r}; leave it unset",
        )
        _require(math.isfinite(self.init_std) and self.init_std > 0, f"init_std={self.init_std} must be positive")
        _require(math.isfinite(self.norm_eps) and self.norm_eps > 0, f"norm_eps={self.norm_eps} must be positive")
        _require(
            math.isfinite(self.rope_theta) and self.rope_theta > 0,
            f"rope_theta={self.rope_theta} must be a positive number (the reference uses 10000)",
        )
        self._check_variant_fields()
        self._check_divisibility()

    # -- validation ---------------------------------------------------------
    def _check_variant_fields(self) -> None:
        required = self.spec.required_fields
        missing = [name for name in required if getattr(self, name) is None]
        _require(not missing, f"variant {self.variant!r} needs {', '.join(missing)} (required: {', '.join(required)})")
        # MHA and MQA fix their group size; accept it only when it agrees.
        fixed_group = self.spec.fixed_group_size(self.n_head) if self.spec.fixed_group_size else None
        if fixed_group is not None and self.group_size is not None:
            _require(
                self.group_size == fixed_group,
                f"group_size={self.group_size} contradicts variant {self.variant!r}, whose group_size is "
                f"{fixed_group}; leave group_size unset",
            )
            required = required + ("group_size",)
        unused = [name for name in OPTIONAL_FIELDS if name not in required and getattr(self, name) is not None]
        _require(
            not unused,
            f"{', '.join(unused)} do not apply to variant {self.variant!r}; leave them unset "
            f"(it uses: {', '.join(required)})",
        )

    def _check_divisibility(self) -> None:
        v, spec = self.variant, self.spec
        if "group_size" in spec.required_fields:
            _require(
                self.n_head % self.group_size == 0,
                f"n_head={self.n_head} is not divisible by group_size={self.group_size}; choose a group_size "
                f"among the divisors of n_head: {_divisors(self.n_head)}",
            )
        if spec.latent_layout:
            blocks, branches = spec.latent_layout
            _require(
                self.kv_lora_rank % blocks == 0,
                f"kv_lora_rank={self.kv_lora_rank} is not divisible by the {blocks} latent blocks of "
                f"{v!r}; use a multiple of {blocks}",
            )
            head_groups = blocks // branches
            _require(
                self.n_head % head_groups == 0,
                f"n_head={self.n_head} is not divisible by the {head_groups} latent groups of {v!r}; use a "
                f"multiple of {head_groups}",
            )
            _require(
                self.qk_rope_head_dim % 2 == 0,
                f"qk_rope_head_dim={self.qk_rope_head_dim} is odd; RoPE rotates pairs, use an even width",
            )
        elif spec.half_rope:
            _require(
                self.head_dim % 4 == 0,
                f"head_dim={self.head_dim}: GTA applies RoPE to head_dim/2 channels, which must be even; "
                f"use a multiple of 4",
            )
        else:
            _require(
                self.head_dim % 2 == 0, f"head_dim={self.head_dim} is odd; RoPE rotates pairs, use an even head_dim"
            )

    # -- derived quantities ---------------------------------------------------
    @property
    def spec(self) -> VariantSpec:
        """The variant's entry in the registry (mlra_jax.variants)."""
        return SPECS[self.variant]

    @property
    def n_kv_head(self) -> int:
        """KV heads of the GQA family and GTA (1 for MQA/MFA)."""
        if self.spec.kv_heads is None:
            raise AttributeError(f"variant {self.variant!r} has no KV heads")
        return self.spec.kv_heads(self)

    @property
    def latent_layout(self) -> tuple[int, int]:
        """(latent blocks, branches) for the latent family."""
        if self.spec.latent_layout is None:
            raise AttributeError(f"variant {self.variant!r} has no latent layout")
        return self.spec.latent_layout

    @property
    def keeps_fp8_histories(self) -> bool:
        """Whether the train state holds FP8 amax histories (float8 matmuls with delayed scaling)."""
        return self.matmul_dtype == "float8" and self.fp8_scaling == "delayed"

    @property
    def trains_absorbed(self) -> bool:
        """Whether the latent family's training attention always runs absorbed (latent_form="absorbed", or "auto" with
        attention_impl="mlra_kernel"); under latent_form="auto" LatentAttention decides per call (absorbed where
        the MLRA kernel runs)."""
        kernel = self.latent_form == "auto" and self.attention_impl == "mlra_kernel"
        return self.spec.latent_layout is not None and (self.latent_form == "absorbed" or kernel)

    @property
    def value_head_dim(self) -> int:
        return self.qk_nope_head_dim if self.spec.latent_layout else self.head_dim

    @property
    def d_h(self) -> int:
        """The paper's d_h for the variant (MFA's heads are 2 d_h wide)."""
        return self.value_head_dim // self.spec.head_width

    @property
    def dtype(self) -> Any:
        return DTYPES[self.compute_dtype]

    @property
    def weight_dtype(self) -> Any:
        return DTYPES[self.param_dtype]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The optimization recipe; defaults are the paper's (docs/conventions.md)."""

    seq_len: int = 2048  # tokens per training sequence (at most model.max_seq_len)
    global_batch_size: int = 480  # sequences per optimizer step
    micro_batch_size: int | None = None  # sequences per forward/backward (gradient accumulation); None: global
    # With micro_batch_size None: the micro-batch is the largest that puts at most this many sequences on
    # each data-parallel replica (resolved for the mesh by the trainer; None: the whole global batch)
    max_micro_batch_per_device: int | None = None
    total_steps: int = 100_000  # optimizer steps of the run (the cosine schedule ends here)
    # Linear warmup: a number of steps, or a fraction of total_steps below 1 (0.1: the first tenth)
    warmup_steps: int | float = 2000
    peak_lr: float = 1.6e-4  # AdamW learning rate after the warmup
    min_lr_ratio: float = 0.1  # cosine decays to min_lr_ratio * peak_lr at total_steps
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's epsilon
    weight_decay: float = 0.1  # applied to all parameters, as the reference does
    grad_clip: float = 1.0  # global norm
    seed: int = 5000  # initialization and data order
    log_every: int = 10  # steps between metric lines
    eval_every: int = 1000  # steps between validation losses (0: never)
    eval_batches: int = 20  # global batches per validation
    loss_chunk: int = 512  # positions per cross-entropy chunk (never the whole [B, T, V] logits); 0: whole
    # Held-out llm.c files, "NAME=PATH,NAME=PATH": each evaluated every eval_every steps on its first
    # eval_batches batches of the official evaluation's windows, logged as val/NAME/loss and val/NAME/ppl
    eval_sets: str = ""

    def __post_init__(self) -> None:
        _check_positive(
            self,
            "seq_len",
            "global_batch_size",
            "total_steps",
            "micro_batch_size",
            "log_every",
            "eval_batches",
            "max_micro_batch_per_device",
        )
        _require(
            isinstance(self.seed, int) and not isinstance(self.seed, bool) and 0 <= self.seed < 2**32,
            f"seed={self.seed!r} must be a whole number in [0, 2**32) (JAX's and grain's random keys take 32 bits)",
        )
        _require(self.eval_every >= 0, f"eval_every={self.eval_every} must be >= 0")
        _require(self.loss_chunk >= 0, f"loss_chunk={self.loss_chunk} must be >= 0 (0: no chunking)")
        for item in filter(None, self.eval_sets.split(",")):
            name, _, path = item.partition("=")
            _require(
                bool(name) and bool(path) and "/" not in name,
                f"eval_sets item {item!r} is not NAME=PATH (for example c4=data/eval/c4_val.bin)",
            )
        if self.micro_batch_size is not None:
            _require(
                self.global_batch_size % self.micro_batch_size == 0,
                f"micro_batch_size={self.micro_batch_size} must divide global_batch_size={self.global_batch_size}",
            )
        _require(
            isinstance(self.warmup_steps, (int, float))
            and not isinstance(self.warmup_steps, bool)
            and (self.warmup_steps == int(self.warmup_steps) or 0 < self.warmup_steps < 1),
            f"warmup_steps={self.warmup_steps!r} must be a whole number of steps or a fraction of total_steps "
            f"between 0 and 1 (0.1: the first tenth)",
        )
        _require(
            0 <= self.warmup < self.total_steps,
            f"warmup_steps={self.warmup_steps} must lie in [0, total_steps={self.total_steps}) so the cosine "
            f"phase has at least one step; a fraction such as 0.1 follows total_steps",
        )
        _require(math.isfinite(self.peak_lr) and self.peak_lr > 0, f"peak_lr={self.peak_lr} must be a positive number")
        _require(
            math.isfinite(self.eps) and self.eps > 0,
            f"eps={self.eps} must be positive (AdamW divides by sqrt(v) + eps; the paper uses 1e-8)",
        )
        _require(
            math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            f"weight_decay={self.weight_decay} must be >= 0 (the paper uses 0.1)",
        )
        _require(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio={self.min_lr_ratio} must lie in [0, 1]")
        _require(
            0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, f"beta1={self.beta1}, beta2={self.beta2} must lie in [0, 1)"
        )
        _require(self.grad_clip > 0, f"grad_clip={self.grad_clip} must be positive")

    @property
    def warmup(self) -> int:
        """Warmup steps: warmup_steps itself, or its fraction of total_steps (rounded)."""
        if 0 < self.warmup_steps < 1:
            return round(self.warmup_steps * self.total_steps)
        return int(self.warmup_steps)

    def for_replicas(self, replicas: int) -> TrainConfig:
        """This recipe with max_micro_batch_per_device resolved into a micro_batch_size for `replicas`
        data-parallel replicas: the largest per-replica micro-batch within the cap that divides the step."""
        if self.micro_batch_size is not None or self.max_micro_batch_per_device is None:
            return self
        _require(
            self.global_batch_size % replicas == 0,
            f"global_batch_size={self.global_batch_size} does not split over {replicas} data-parallel replicas; "
            f"use a multiple of {replicas}",
        )
        per_replica = self.global_batch_size // replicas
        micro = max(d for d in range(1, min(per_replica, self.max_micro_batch_per_device) + 1) if per_replica % d == 0)
        return dataclasses.replace(self, micro_batch_size=micro * replicas)

    @property
    def named_eval_sets(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.eval_sets.split(",") if item)

    @property
    def accumulation_steps(self) -> int:
        return self.global_batch_size // (self.micro_batch_size or self.global_batch_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Token data: 'builtin' (the shipped corpus) or a folder of llm.c shards."""

    dataset: str = "data/fineweb_edu"  # builtin, a folder of llm.c shards, or gs://bucket/path
    train_pattern: str = "*_train_*.bin"  # the training shards in the folder (a glob)
    val_pattern: str = "*_val_*.bin"  # the validation shards in the folder (a glob)
    read_threads: int = 4  # grain threads reading windows
    prefetch: int = 4  # batches read ahead

    def __post_init__(self) -> None:
        _check_positive(self, "read_threads", "prefetch")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh axes; one -1 takes the remaining devices."""

    data: int = -1  # data-parallel replicas
    fsdp: int = 1  # devices the weights and optimizer state are sharded over (FSDP)
    tensor: int = 1  # tensor-parallel devices (the heads, latent blocks and MLP split over them)
    # When FSDP's compute-dtype weights are gathered under gradient accumulation: "step" once before the
    # micro-batches (held through them), "micro_batch" by each micro-batch where it reads them; "auto":
    # "step" where the layers recompute nothing in the backward (model.remat none) or where remat=auto found the
    # compiled step fitting with it, else "micro_batch"
    fsdp_gather: str = dataclasses.field(default="auto", metadata={"choices": FSDP_GATHER})

    def __post_init__(self) -> None:
        _check_choice("fsdp_gather", self.fsdp_gather, FSDP_GATHER)
        sizes = (self.data, self.fsdp, self.tensor)
        _require(
            all(s == -1 or (isinstance(s, int) and s > 0) for s in sizes) and sizes.count(-1) <= 1,
            f"mesh sizes data={self.data}, fsdp={self.fsdp}, tensor={self.tensor} must be positive, with at "
            f"most one -1",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every: int = 1000  # steps between checkpoints (also on SIGTERM and at the end)
    keep: int = 3  # most recent checkpoints kept
    async_save: bool = True  # write checkpoints in the background while training goes on

    def __post_init__(self) -> None:
        _check_positive(self, "every", "keep")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """Where metrics go besides metrics.jsonl, TensorBoard and stdout."""

    wandb_project: str | None = None  # log the same records to this Weights & Biases project (the wandb extra)
    wandb_entity: str | None = None  # the W&B team or user (default: wandb's default entity)
    wandb_name: str | None = None  # the W&B run's display name (default: the experiment's name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """A JAX profiler trace of a few training steps into RUN/profile (TensorBoard's profile tab, Perfetto)."""

    start_step: int = 10  # the first traced step (steps count from 1; the first ones include compilation)
    steps: int = 0  # how many steps to trace (0: none)

    def __post_init__(self) -> None:
        _check_positive(self, "start_step")
        _require(isinstance(self.steps, int) and self.steps >= 0, f"steps={self.steps!r} must be >= 0 (0: no trace)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Experiment:
    """A named experiment: the model, the recipe, the data, the mesh and the checkpoints."""

    name: str  # the experiment's name (runs/NAME by default)
    description: str  # one line, shown by mlra info --list
    model: ModelConfig  # the model (--model.FIELD)
    train: TrainConfig = TrainConfig()  # the optimization recipe (--train.FIELD)
    data: DataConfig = DataConfig()  # the token data (--data.FIELD)
    mesh: MeshConfig = MeshConfig()  # the device mesh (--mesh.FIELD)
    checkpoint: CheckpointConfig = CheckpointConfig()  # checkpoints (--checkpoint.FIELD)
    metrics: MetricsConfig = MetricsConfig()  # metrics destinations (--metrics.FIELD)
    profile: ProfileConfig = ProfileConfig()  # profiler trace (--profile.FIELD)
    reference_key: str | None = None  # key in paper_experiments.json, for the paper's runs

    def __post_init__(self) -> None:
        _require(
            self.train.seq_len <= self.model.max_seq_len,
            f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}",
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
