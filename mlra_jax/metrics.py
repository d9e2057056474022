"""Training metrics: model FLOPs and MFU, the JSONL / TensorBoard writer (and a tracker it feeds), the step line."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from typing import Any

import jax

from mlra_jax.attention import attention_class
from mlra_jax.config import ModelConfig
from mlra_jax.guards import atomic_write_text
from mlra_jax.model import abstract_model
from mlra_jax.params import flat_params
from mlra_jax.paths import as_path, is_remote
from mlra_jax.rewritten_file import REWRITE_EVERY_S, RewrittenFile, RewrittenFileFactory

log = logging.getLogger(__name__)

# Dense bfloat16 peak FLOP/s per chip (vendor datasheets), matched against jax's device_kind.
PEAK_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "TPU7x": 2307e12,
}


def peak_flops(device: jax.Device) -> float | None:
    """The chip's dense bf16 peak, or None when unknown (CPUs): MFU is then not reported."""
    for name in sorted(PEAK_FLOPS, key=len, reverse=True):
        if name.lower() in device.device_kind.lower():
            return PEAK_FLOPS[name]
    return None


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token: 3 x forward (forward + backward), causal attention.

    Weight matmuls count 2 FLOPs per parameter (the tied embedding once, as the output
    head; norms excluded); the attention core counts 2 (d_qk + d_v) per head per visible
    key, with (seq_len + 1) / 2 keys visible on average under the causal mask.
    """
    params = flat_params(abstract_model(cfg))
    matmul_params = sum(math.prod(p.shape) for name, p in params.items() if not name.endswith("norm.scale"))
    extra = attention_class(cfg.variant).extra_flops_per_token(cfg)
    return 3 * (2 * matmul_params + cfg.n_layer * extra) + attention_flops_per_token(cfg, seq_len)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """The attention core's share of training_flops_per_token (forward and backward, every layer)."""
    heads, qk_dim, v_dim = attention_class(cfg.variant).core_shape(cfg)
    return 3 * cfg.n_layer * 2 * heads * (qk_dim + v_dim) * (seq_len + 1) / 2


def json_safe(values: dict[str, Any]) -> dict[str, Any]:
    """NaN and infinities as null: json.dumps would write NaN / Infinity, which is not JSON."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()}


def tensorboardx_writer() -> tuple[Any, Any]:
    """tensorboardX's SummaryWriter and register_writer_factory. Its writer module imports torch when it can,
    only to accept torch tensors (2 s at every start where torch is installed); we log Python floats, so torch
    stays out unless something else already imported it."""
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError
    try:
        from tensorboardX import SummaryWriter
        from tensorboardX.record_writer import register_writer_factory
    finally:
        if blocked:
            del sys.modules["torch"]
    return SummaryWriter, register_writer_factory


class MetricWriter:
    """One record per call, to a JSONL file, TensorBoard (when tensorboardX is installed) and a tracker (W&B).

    Local files are appended to. On an object store (a gs:// workdir), which cannot append, the records
    stay in memory and metrics.jsonl and the event files are rewritten whole at most every
    `rewrite_every_s` seconds and at each `flush` (the training loop flushes at every checkpoint) and `close`.
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        enabled: bool = True,
        rewrite_every_s: float = REWRITE_EVERY_S,
        tracker: Any = None,
    ):
        """`tracker`: another sink of every record (tracking.WandbTracker: write(step, values), close())."""
        workdir = as_path(workdir)
        self.tracker = tracker
        self.enabled, self.remote, self.rewrite_every_s = enabled, is_remote(workdir), rewrite_every_s
        self.jsonl_path = workdir / "metrics.jsonl"
        self._jsonl: RewrittenFile | None = None  # the remote metrics.jsonl, loaded on first use
        self._event_files: RewrittenFileFactory | None = None
        self.tensorboard = None
        if enabled:
            try:
                SummaryWriter, register_writer_factory = tensorboardx_writer()
            except ImportError:
                log.warning("tensorboardX is not installed: no TensorBoard logs (pip install tensorboardX)")
            else:
                if self.remote:  # event files through epath, like every other run file
                    self._event_files = RewrittenFileFactory(rewrite_every_s)
                    register_writer_factory(os.fspath(workdir).split(":", 1)[0], self._event_files)
                self.tensorboard = SummaryWriter(os.fspath(workdir / "tensorboard"))

    def _remote_jsonl(self) -> RewrittenFile:
        if self._jsonl is None:
            content = self.jsonl_path.read_bytes() if self.jsonl_path.exists() else b""
            self._jsonl = RewrittenFile(self.jsonl_path, content, self.rewrite_every_s)
        return self._jsonl

    def truncate_after(self, step: int) -> None:
        """Forget records past `step` (a resumed run logs those steps again). A line that is not a JSON
        record (the last one torn by a kill mid-write) is dropped with a warning."""
        if not self.enabled or not self.jsonl_path.exists():
            return
        kept = []
        text = self.jsonl_path.read_bytes().decode("utf-8", errors="replace")  # bytes that are not text: dropped
        for number, line in enumerate(text.splitlines(), 1):
            try:
                record = json.loads(line)
                keep = record["step"] <= step
            except (json.JSONDecodeError, KeyError, TypeError):
                log.warning(
                    "%s line %d is not a metrics record (torn by an interrupted write?); dropped: %.80s",
                    self.jsonl_path,
                    number,
                    line,
                )
                continue
            if keep:
                kept.append(line)
        content = "".join(line + "\n" for line in kept)
        if self.remote:
            self._remote_jsonl().replace_content(content.encode())
            self._remote_jsonl().flush(force=True)
        else:
            atomic_write_text(self.jsonl_path, content)  # a kill here leaves the old file or the new, whole

    def write(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = json.dumps({"step": step, **json_safe(values)}) + "\n"
        if self.remote:
            self._remote_jsonl().write(line.encode())
            self._remote_jsonl().flush()
        else:
            with open(self.jsonl_path, "a") as f:
                f.write(line)
        if self.tensorboard is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and value is not None:
                    self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.tracker is not None:
            self.tracker.write(step, values)

    def flush(self) -> None:
        """Write out what an object store holds only in memory (local files are always current)."""
        if self._jsonl is not None:
            self._jsonl.flush(force=True)
        if self._event_files is not None:
            self._event_files.flush_all()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        self.flush()
        if self.tracker is not None:
            self.tracker.close()


def format_line(step: int, total: int, values: dict[str, Any]) -> str:
    parts = [f"step {step}/{total}"]
    for key, fmt in (
        ("loss", ".4f"),
        ("val_loss", ".4f"),
        ("grad_norm", ".3f"),
        ("lr", ".3e"),
        ("tokens_per_s", ",.0f"),
        ("step_time_s", ".3f"),
        ("mfu", ".1%"),
    ):
        if values.get(key) is not None:
            parts.append(f"{key} {values[key]:{fmt}}")
    parts += [f"{key} {value:.4f}" for key, value in values.items() if key.startswith("val/") and value is not None]
    return "  ".join(parts)
