"""Describe experiments without allocating weights.

mlra info --list                      # every experiment
mlra info --experiment=mlra4_2p9b     # parameters, KV cache, TP loading, decode AI
mlra info --paper_tables              # Tables 1 and 2 at the paper's analysis settings
"""

from __future__ import annotations

import json
import sys
from typing import Any

import jax

from mlra_jax import fp8
from mlra_jax.cache_accounting import cache_report
from mlra_jax.cli import command_parser
from mlra_jax.command import command
from mlra_jax.config import Experiment, ModelConfig
from mlra_jax.experiments import all_experiments, resolve_experiment
from mlra_jax.experiments.paper_tables import TABLE_VARIANTS, TP_DEGREES, analysis_config
from mlra_jax.model import abstract_model, count_params, fp8_histories


def _fmt_d_h(value: float | None) -> str:
    return "n/a" if value is None else f"{value:g} d_h"


def describe(experiment: Experiment) -> dict[str, Any]:
    cfg = experiment.model
    report = cache_report(cfg, TP_DEGREES)
    decode = report.decode
    return {
        "experiment": experiment.name,
        "description": experiment.description,
        "variant": cfg.variant,
        "num_params": count_params(abstract_model(cfg)),
        "d_h": report.d_h,
        "kv_cache_elements_per_token_per_layer": report.kv_cache_elements,
        "kv_cache_elements_per_token": report.kv_cache_elements * cfg.n_layer,
        "kv_cache_d_h": report.in_d_h(report.kv_cache_elements),
        "per_device_kv_elements": {str(tp): n for tp, n in report.per_device.items()},
        "per_device_kv_d_h": {str(tp): report.in_d_h(n) for tp, n in report.per_device.items()},
        "replicated": {str(tp): names for tp, names in report.replicated.items()},
        "decode_tp": decode.tp,
        "decode_arithmetic_intensity": decode.arithmetic_intensity(),
        "fp8": fp8.describe_histories(jax.eval_shape(lambda: fp8_histories(cfg))) if cfg.keeps_fp8_histories else None,
    }


def format_description(info: dict[str, Any], cfg: ModelConfig) -> str:
    bytes_per_token = info["kv_cache_elements_per_token"] * 2
    per_device = "   ".join(
        f"TP={tp}: {_fmt_d_h(v)}{' (replicated)' if info['replicated'][tp] else ''}"
        for tp, v in info["per_device_kv_d_h"].items()
    )
    return "\n".join(
        [
            f"{info['experiment']}: {info['description']}",
            f"  model        {cfg.spec.display_name}, {cfg.n_layer} layers, d={cfg.n_embd}, {cfg.n_head} heads, "
            f"FFN {cfg.intermediate_size}, vocab {cfg.vocab_size}, {cfg.compute_dtype} compute",
            f"  parameters   {info['num_params']:,} ({info['num_params'] / 1e6:.2f}M; tied embedding counted once)",
            f"  KV cache     {info['kv_cache_elements_per_token_per_layer']} elements per token per layer = "
            f"{_fmt_d_h(info['kv_cache_d_h'])} (d_h={info['d_h']}); {info['kv_cache_elements_per_token']:,} per token "
            f"over {cfg.n_layer} layers = {bytes_per_token / 1024:.1f} KiB in 16-bit",
            f"  per device   {per_device}   (KV cache loaded per token per layer)",
            f"  decode AI    {info['decode_arithmetic_intensity']:.1f} FLOP/byte per device at TP={info['decode_tp']} "
            f"(attention over the cache, 16-bit)",
            *([f"  FP8          {info['fp8']}"] if info["fp8"] else []),
        ]
    )


def paper_tables() -> str:
    """Table 1 (KV cache and per-device loading) and Table 2 (decode arithmetic intensity)."""
    rows = [f"{'Method':8} {'KV cache':>9} " + " ".join(f"{f'TP={tp}':>8}" for tp in TP_DEGREES) + f" {'AI':>8}"]
    for variant in TABLE_VARIANTS:
        cfg = analysis_config(variant)
        report = cache_report(cfg, TP_DEGREES)
        cells = " ".join(f"{_fmt_d_h(report.in_d_h(report.per_device[tp])):>8}" for tp in TP_DEGREES)
        rows.append(
            f"{cfg.spec.display_name:8} {_fmt_d_h(report.in_d_h(report.kv_cache_elements)):>9} {cells} "
            f"{report.decode.arithmetic_intensity():8.2f}"
        )
    header = (
        "Paper Tables 1-2 at the analysis settings (64 heads, d_h=128, g=8, d_c=4d_h, d_h^R=d_h/2, "
        "beta_kv=2):\nKV cache per token, loading per token per device under TP, and decode arithmetic "
        "intensity (FLOP/byte, per device at the native TP)"
    )
    return header + "\n" + "\n".join(rows)


@command
def main(argv: list[str] | None = None) -> int:
    parser = command_parser("mlra info", __doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument(
        "--experiment",
        help="an experiment's name (see --list), FILE.py:NAME, package.module:NAME or RUN/experiment.json",
    )
    group.add_argument("--list", action="store_true", help="list every experiment")
    group.add_argument(
        "--paper_tables",
        "--paper-tables",
        action="store_true",
        help="print paper Tables 1 and 2 (--paper-tables: the same)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument(
        "--measure",
        action="store_true",
        help="with --experiment: also build real sharded caches at TP=1,2,4,8 and report the bytes "
        "each device holds per token (needs 8 devices; on a CPU set "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8)",
    )
    args = parser.parse_args(argv)
    if args.list:
        for exp in all_experiments():
            print(f"{exp.name:28} {exp.description}")
        return 0
    if args.paper_tables:
        print(paper_tables())
        return 0
    experiment = resolve_experiment(args.experiment)  # an unknown name: exit 2 with the closest one (command.py)
    info = describe(experiment)
    if args.measure:
        from mlra_jax.kv_cache import measured_kv_bytes_per_token

        info["measured_kv_bytes_per_token_per_device"] = {
            str(tp): measured_kv_bytes_per_token(experiment.model, tp) for tp in TP_DEGREES
        }
    text = format_description(info, experiment.model)
    if args.measure:
        text += (
            "\n  measured     "
            + "   ".join(f"TP={tp}: {b} B" for tp, b in info["measured_kv_bytes_per_token_per_device"].items())
            + "   (bytes per token per layer on one device, from sharded caches)"
        )
    print(json.dumps(info, indent=1) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
