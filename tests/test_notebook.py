"""The preview notebook executes headless against a real checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from omni_diffusion_rl.config import load_config
from omni_diffusion_rl.trainers.nft import NFTTrainer

from .helpers import REPO, fast_overrides, tiny_model_dir


def test_preview_notebook_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model_dir(tmp_path / "model")
    run = tmp_path / "run"
    NFTTrainer(load_config(None, fast_overrides(model, run, 1) + ["train.eval_at_start_and_end=false"])).fit()
    monkeypatch.setenv("ODRL_CHECKPOINT", str(run / "checkpoints"))
    monkeypatch.setenv("ODRL_PREVIEW_DIR", str(tmp_path / "preview"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nb = nbformat.read(REPO / "notebooks" / "preview_generations.ipynb", as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}
    ).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    mimes = {m for o in outputs for m in o.get("data", {})}
    assert {"image/png", "image/gif"} <= mimes, f"contact sheet and animations must be shown; got {mimes}"
    assert any("audio" in o.get("data", {}).get("text/html", "") for o in outputs), (
        "audio players must be shown"
    )
    assert (tmp_path / "preview" / "sheet.png").exists()
    assert os.environ["ODRL_CHECKPOINT"] in "".join(o.get("text", "") for o in outputs)
