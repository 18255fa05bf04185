"""`odrl bench memory`: the on-paper estimate adds up its parts, counts the released sizes, and
moves the way the recipe's knobs should move it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni_diffusion_rl.benchmarks.memory import GIB, estimate_h3, run_memory_bench


def test_the_estimate_adds_up_and_follows_the_knobs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    estimates = run_memory_bench(tmp_path / "memory.json")
    rows = json.loads((tmp_path / "memory.json").read_text())["estimates"]
    assert "| recipe | transformer |" in capsys.readouterr().out and len(rows) == len(estimates) == 4
    for row in rows:
        parts = (
            "transformer_gib",
            "text_encoder_gib",
            "vaes_gib",
            "lora_gib",
            "activations_gib",
            "overhead_gib",
        )
        assert row["total_gib"] == pytest.approx(sum(row[k] for k in parts))
    ltx2, h3_offloaded, h3_on_gpu, h3_short = estimates
    assert ltx2.transformer_gib * GIB / 2 == pytest.approx(18.88e9, rel=0.01)  # LTX-2's 19B, bf16
    assert h3_offloaded.transformer_gib * GIB / 2 == pytest.approx(33.12e9, rel=0.01)  # H3's 33B, bf16
    assert h3_offloaded.text_encoder_gib == 0 and 40 < h3_on_gpu.text_encoder_gib < 60
    assert h3_short.activations_gib < h3_offloaded.activations_gib / 3
    assert estimate_h3(rank=128).lora_gib == pytest.approx(2 * h3_offloaded.lora_gib)
