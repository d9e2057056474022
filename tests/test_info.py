"""`info` reproduces the paper's Table 1 (KV cache, per-device loading) and Table 2 (decode AI)."""

import json

import pytest
from mlra_jax.experiments.paper_tables import TABLE_VARIANTS, analysis_config

from mlra_jax import info
from mlra_jax.cache_accounting import cache_report, per_device_kv_elements
from mlra_jax.model import abstract_model
from mlra_jax.params import flat_params

# Paper Table 1, in units of d_h: KV cache per token, then loading per token per device at TP = 1, 2, 4, 8.
TABLE1 = {
    "mha": (128, (128, 64, 32, 16)),
    "mqa": (2, (2, 2, 2, 2)),
    "gqa": (16, (16, 8, 4, 2)),
    "mla": (4.5, (4.5, 4.5, 4.5, 4.5)),
    "mfa": (4, (4, 4, 4, 4)),
    "tpa": (6, (6, 5, 4.5, 4.25)),
    "gla2": (4.5, (4.5, 2.5, 2.5, 2.5)),
    "gta": (8.5, (8.5, 4.5, 2.5, 1.5)),
    "mlra2": (4.5, (4.5, 2.5, 1.5, 1.5)),
    "mlra4": (4.5, (4.5, 2.5, 1.5, 1.5)),
}
# Paper Table 2, transcribed with its symbols; n cancels. Qwen3-32B / Kimi-K2 shapes (Sec. 3.4).
h, d_h, d_c, d_r, g, beta = 64, 128, 512, 64, 8, 2
TABLE2 = {
    "mha": 4 * h * d_h / (4 * h * d_h),
    "mqa": 4 * h * d_h / (4 * d_h),
    "gqa": 4 * h * d_h / (4 * g * d_h),
    "mla": (4 * h * d_c + 2 * h * d_r) / (2 * (d_c + d_r)),
    "mfa": 4 * h * 2 * d_h / (4 * 2 * d_h),
    "tpa": (4 * h * beta * d_h + 4 * h * d_h) / (4 * beta * (h + d_h)),
    "gla2": (2 * h * d_c / 2 + h * d_r) / (2 * (d_c / 2 + d_r)),
    "gta": 4 * h * d_h / (2 * (g * d_h + d_r)),
    "mlra2": (2 * h * d_c / 4 + h * d_r) / (2 * (d_c / 4 + d_r)),
    "mlra4": (4 * h * d_c / 4 + 2 * h * d_r) / (2 * (d_c / 4 + d_r)),
}


def test_tables_cover_the_papers_variants():
    assert set(TABLE1) == set(TABLE_VARIANTS) == set(TABLE2)


@pytest.mark.parametrize("variant", TABLE_VARIANTS)
def test_table1_kv_cache_and_per_device_loading(variant):
    report = cache_report(analysis_config(variant))
    cache, per_device = TABLE1[variant]
    assert report.d_h == d_h
    assert report.in_d_h(report.kv_cache_elements) == cache
    assert tuple(report.in_d_h(report.per_device[tp]) for tp in (1, 2, 4, 8)) == per_device


@pytest.mark.parametrize("variant", TABLE_VARIANTS)
def test_table2_arithmetic_intensity(variant):
    assert cache_report(analysis_config(variant)).decode.arithmetic_intensity() == pytest.approx(TABLE2[variant])


def attention_params(variant):
    """Attention parameters of one layer, without the RMSNorm weights (Table 1 omits them)."""
    params = flat_params(abstract_model(analysis_config(variant)))
    return sum(v.size for k, v in params.items() if k.startswith("blocks.attn.") and not k.endswith("norm.scale"))


def test_table1_parameter_formulas():
    d, dq = 7168, 1536
    assert attention_params("mha") == 4 * d * h * d_h
    assert attention_params("mqa") == 2 * d * d_h * (h + 1)
    assert attention_params("gqa") == 2 * d * d_h * (h + g)
    assert attention_params("mla") == dq * (d + h * d_h + h * d_r) + d * d_r + d_c * (d + 2 * h * d_h) + d * h * d_h
    assert attention_params("mlra4") == attention_params("mla")
    assert attention_params("gla2") == dq * (d + h * d_h + h * d_r) + d * d_r + d_c * (d + h * d_h) + d * h * d_h
    assert attention_params("mlra2") == attention_params("gla2")
    assert attention_params("mfa") == 2048 * (d + h * 2 * d_h) + 2 * d * 2 * d_h + d * h * 2 * d_h
    assert attention_params("tpa") == d * (6 + 2 * beta) * (h + d_h) + d * h * d_h
    assert attention_params("gta") == d * h * d_h + d * g * d_h + d * d_r + d * h * d_h


def test_tp_degree_that_does_not_divide_falls_back_to_replication():
    cfg = analysis_config("gqa")  # 8 KV heads: TP=3 neither splits nor spreads them
    assert per_device_kv_elements(cfg, 3) == per_device_kv_elements(cfg, 1)
    assert cache_report(cfg, (3, 4)).replicated == {3: ["k", "v"], 4: []}


def test_cli_experiment(capsys):
    assert info.main(["--experiment=mlra4_2p9b"]) == 0
    out = capsys.readouterr().out
    assert "2,873,220,096" in out and "TP=4: 1.5 d_h" in out and "4.5 d_h" in out


def test_cli_json(capsys):
    assert info.main(["--experiment", "gqa_2p9b", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_params"] == 2872593408 and data["per_device_kv_d_h"]["2"] == 6
    # 6 KV heads of 24 query heads at TP=4: each device stores the 2 KV heads its 6 query heads read
    assert data["per_device_kv_d_h"]["4"] == 4 and data["replicated"]["4"] == []


def test_cli_paper_tables_and_list(capsys):
    assert info.main(["--paper-tables"]) == 0
    tables = capsys.readouterr().out
    assert "MLRA-4" in tables and "4.25 d_h" in tables and "106.67" in tables
    assert info.main(["--list"]) == 0
    listing = capsys.readouterr().out
    assert "mlra4_2p9b" in listing and "mlra4_tiny" in listing and len(listing.splitlines()) >= 41


def test_cli_unknown_experiment(capsys):
    assert info.main(["--experiment=nope"]) == 2
    assert "unknown experiment 'nope'; mlra info --list lists them" in capsys.readouterr().err
