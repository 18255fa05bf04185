"""MetricsLogger (JSONL and offline wandb through accelerate), read_metrics and plot_reward_curve."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from PIL import Image

from omni_diffusion_rl.tracking import (
    METRICS_FILE,
    MetricsLogger,
    flatten_config,
    plot_reward_curve,
    read_metrics,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps process-wide state; reset it around tests that build an Accelerator."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_flatten_config() -> None:
    config = {"lr": 1e-4, "model": {"name": "tiny", "lora": {"rank": 8}}, "seeds": [1, 2], "tag": None}
    assert flatten_config(config) == {
        "lr": 1e-4,
        "model.name": "tiny",
        "model.lora.rank": 8,
        "seeds": "[1, 2]",
        "tag": "None",
    }


def test_jsonl_round_trip_without_accelerator(tmp_path: Path) -> None:
    out = tmp_path / "run"
    logger = MetricsLogger(out, None, False, "proj", "run-a", {"a": {"b": 1}})
    logger.log({"reward/mean": 0.5, "loss": torch.tensor(2.0)}, step=1)
    # Flushed per line: readable before close.
    assert read_metrics(out / METRICS_FILE) == [{"step": 1, "reward/mean": 0.5, "loss": 2.0}]
    logger.log({"reward/mean": 0.75, "loss": 1.5}, step=2)
    logger.close()
    logger.close()  # idempotent
    with pytest.raises(RuntimeError):
        logger.log({"x": 1.0}, step=3)

    lines = (out / METRICS_FILE).read_text().splitlines()
    assert len(lines) == 2 and all(isinstance(json.loads(line), dict) for line in lines)
    assert read_metrics(out / METRICS_FILE) == [
        {"step": 1, "reward/mean": 0.5, "loss": 2.0},
        {"step": 2, "reward/mean": 0.75, "loss": 1.5},
    ]

    # A second logger on the same folder appends (resumed run).
    with MetricsLogger(out) as again:
        again.log({"reward/mean": 1.0}, step=3)
    assert [r["step"] for r in read_metrics(out / METRICS_FILE)] == [1, 2, 3]


def test_read_metrics_skips_cut_off_last_line(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 1.0}]
    path.write_text('{"step": 1, "lo\n{"step": 2, "loss": 1.0}\n')
    with pytest.raises(json.JSONDecodeError):
        read_metrics(path)


def test_wandb_needs_a_wandb_accelerator(tmp_path: Path, fresh_accelerate_state: None) -> None:
    from accelerate import Accelerator

    with pytest.raises(ValueError, match="log_with"):
        MetricsLogger(tmp_path, Accelerator(cpu=True), True, "proj", "run", {})


@pytest.mark.slow
def test_wandb_without_an_accelerator_and_a_run_continued_by_id(tmp_path: Path) -> None:
    """The trainer process of separate mode has no accelerator; a resumed run (or auto's next mode)
    logs to the same wandb run through its id."""
    pytest.importorskip("wandb")
    for step in range(2):
        with MetricsLogger(
            tmp_path, None, True, "odrl-test", "direct", {"a": 1}, run_id="odrltest0001"
        ) as log:
            log.log({"reward/mean": float(step)}, step=step)
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    # wandb names a run folder after its id, with a -1 suffix when both parts start in one second
    assert len(runs) == 2 and all("-odrltest0001" in r.name for r in runs)
    assert all(list(r.glob("*.wandb")) for r in runs), "each part has its data file"
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [0, 1]


def test_wandb_missing_package_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import omni_diffusion_rl.tracking as tracking

    monkeypatch.setattr(tracking, "wandb_available", lambda: False)
    with pytest.raises(ImportError, match="pip install wandb") as info:
        MetricsLogger(tmp_path, None, True, "proj", "run", {})
    assert "tracking.wandb=false" in str(info.value)


def test_accelerator_without_wandb_writes_jsonl_only(tmp_path: Path, fresh_accelerate_state: None) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    with MetricsLogger(tmp_path, accelerator, False, "proj", "run", {}) as logger:
        logger.log({"reward/mean": 0.1}, step=0)
    assert read_metrics(tmp_path / METRICS_FILE) == [{"step": 0, "reward/mean": 0.1}]
    assert not (tmp_path / "wandb").exists()


@pytest.mark.slow
def test_offline_wandb_run_through_accelerate(tmp_path: Path, fresh_accelerate_state: None) -> None:
    pytest.importorskip("wandb")
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, log_with="wandb")
    config = {"train": {"lr": 3e-4, "steps": 2}, "model": "tiny"}
    logger = MetricsLogger(tmp_path, accelerator, True, "odrl-test", "unit-run", config)
    try:
        run = accelerator.get_tracker("wandb", unwrap=True)
        assert run.name == "unit-run"
        assert run.config["train.lr"] == 3e-4 and run.config["model"] == "tiny"
        for step in range(2):
            logger.log({"reward/mean": 0.5 + step, "reward/color_match": 0.25}, step=step)
    finally:
        logger.close()

    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    assert list(runs[0].glob("*.wandb")), "offline run has no .wandb data file"
    assert read_metrics(tmp_path / METRICS_FILE) == [
        {"step": 0, "reward/mean": 0.5, "reward/color_match": 0.25},
        {"step": 1, "reward/mean": 1.5, "reward/color_match": 0.25},
    ]


def test_plot_reward_curve_writes_png(tmp_path: Path) -> None:
    metrics = [
        {"step": s, "reward/mean": 0.1 * s, "reward/std": 0.05, "reward/color_match": 0.2 * s, "loss": 1.0}
        for s in range(10)
    ]
    path = tmp_path / "plots" / "reward.png"
    plot_reward_curve(metrics, path)
    assert path.read_bytes()[:8] == PNG_MAGIC
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.size == (700, 400)
        # Several distinct colours: lines were drawn, not a blank canvas.
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 16) or []) > 10
    assert [p.name for p in path.parent.iterdir()] == ["reward.png"]


def test_plot_reward_curve_with_no_rewards(tmp_path: Path) -> None:
    path = tmp_path / "empty.png"
    plot_reward_curve([{"step": 0, "loss": 1.0}], path)
    assert path.read_bytes()[:8] == PNG_MAGIC
