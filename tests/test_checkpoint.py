"""Atomic checkpoints: round trip, the `latest` pointer, pruning, and refusal of damaged checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import omni_diffusion_rl.checkpoint as checkpoint_module
from omni_diffusion_rl.checkpoint import CheckpointError, load_checkpoint, resolve_checkpoint, save_checkpoint


def _payload(step: int) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    gen = torch.Generator().manual_seed(step)
    tensors = {
        "lora.default.A": torch.randn(4, 3, generator=gen),
        "lora.old.B": torch.randn(3, 4, generator=gen).double(),
        "counts": torch.arange(5, dtype=torch.int64) * step,
        "view": torch.randn(6, 4, generator=gen)[:, 1],  # non-contiguous
    }
    objects = {
        "optimizer": {"state": {0: {"exp_avg": torch.randn(4, generator=gen)}}, "lr": 3e-4},
        "rng": torch.Generator().manual_seed(step).get_state(),
        "python": (1, "two", [3.0]),
    }
    state = {"step": step, "prompt_cursor": 17, "metrics": {"reward": 0.5}, "name": "run é"}
    return tensors, objects, state


def test_round_trip(tmp_path: Path) -> None:
    tensors, objects, state = _payload(3)
    path = save_checkpoint(tmp_path / "ckpt", 3, tensors, objects, state)
    assert path == tmp_path / "ckpt" / "step_0000003"
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json",
        "objects.pt",
        "state.json",
        "tensors.safetensors",
    ]
    got_tensors, got_objects, got_state = load_checkpoint(path)
    assert set(got_tensors) == set(tensors)
    for key, value in tensors.items():
        assert got_tensors[key].dtype == value.dtype
        assert torch.equal(got_tensors[key], value)
    assert got_objects["optimizer"]["lr"] == 3e-4
    assert torch.equal(
        got_objects["optimizer"]["state"][0]["exp_avg"], objects["optimizer"]["state"][0]["exp_avg"]
    )
    assert torch.equal(got_objects["rng"], objects["rng"])
    assert got_objects["python"] == (1, "two", [3.0])
    assert {k: v for k, v in got_state.items() if k != "format"} == state
    assert got_state["format"] == checkpoint_module.FORMAT_VERSION
    manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["step"] == 3
    assert set(manifest["files"]) == {"objects.pt", "state.json", "tensors.safetensors"}


def test_latest_pointer(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    for step in (1, 2):
        save_checkpoint(root, step, *_payload(step))
    assert (root / "latest").read_text(encoding="utf-8").strip() == "step_0000002"
    assert resolve_checkpoint(root) == root / "step_0000002"
    tensors, _, state = load_checkpoint(root)
    assert state["step"] == 2
    assert torch.equal(tensors["counts"], torch.arange(5) * 2)
    # An explicit older checkpoint is still loadable.
    assert load_checkpoint(root / "step_0000001")[2]["step"] == 1
    assert not list(root.glob(".tmp*")) and not list(root.glob(".latest*"))


def test_keep_last_prunes_older_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    for step in (10, 20, 30, 40):
        save_checkpoint(root, step, *_payload(step), keep_last=2)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000030", "step_0000040"]
    save_checkpoint(root, 50, *_payload(50), keep_last=1)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000050"]
    assert load_checkpoint(root)[2]["step"] == 50


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    tensors, objects, _ = _payload(5)
    save_checkpoint(root, 5, tensors, objects, {"step": 5, "tag": "first"})
    save_checkpoint(root, 5, tensors, objects, {"step": 5, "tag": "second"})
    assert load_checkpoint(root)[2]["tag"] == "second"


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist") as info:
        load_checkpoint(tmp_path / "nowhere")
    assert "nowhere" in str(info.value)


def test_directory_without_manifest_is_an_interrupted_save(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "ckpt", 1, *_payload(1))
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest.json.*interrupted") as info:
        load_checkpoint(path)
    assert "step_0000001" in str(info.value)
    # The pointer leads to the same refusal.
    with pytest.raises(CheckpointError, match="interrupted"):
        load_checkpoint(tmp_path / "ckpt")


def test_latest_pointing_at_a_missing_directory(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, *_payload(1))
    (root / "latest").write_text("step_0000099\n", encoding="utf-8")
    with pytest.raises(CheckpointError, match="step_0000099"):
        load_checkpoint(root)


def test_truncated_tensors_file(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "ckpt", 1, *_payload(1))
    data = (path / "tensors.safetensors").read_bytes()
    (path / "tensors.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupted") as info:
        load_checkpoint(path)
    assert "tensors.safetensors" in str(info.value)


def test_tampered_state_json_of_the_same_size(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "ckpt", 1, *_payload(1))
    text = (path / "state.json").read_text(encoding="utf-8")
    assert '"prompt_cursor": 17' in text
    tampered = text.replace('"prompt_cursor": 17', '"prompt_cursor": 99')
    assert len(tampered) == len(text)  # only the sha256 can tell
    (path / "state.json").write_text(tampered, encoding="utf-8")
    with pytest.raises(CheckpointError, match="truncated or corrupted") as info:
        load_checkpoint(path)
    assert "state.json" in str(info.value)


def test_missing_file_listed_in_manifest(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "ckpt", 1, *_payload(1))
    (path / "objects.pt").unlink()
    with pytest.raises(CheckpointError, match="missing objects.pt"):
        load_checkpoint(path)


def test_unreadable_manifest(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "ckpt", 1, *_payload(1))
    (path / "manifest.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(path)


def test_crash_during_save_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, *_payload(1))

    def crash(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module.torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(root, 2, *_payload(2))
    assert not (root / "step_0000002").exists()
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000001"]
    assert (root / "latest").read_text(encoding="utf-8").strip() == "step_0000001"
    assert load_checkpoint(root)[2]["step"] == 1
    # After the crash, saving the same step works and leaves no temporary directory behind.
    monkeypatch.undo()
    save_checkpoint(root, 2, *_payload(2))
    assert load_checkpoint(root)[2]["step"] == 2
    assert not list(root.glob(".tmp*"))
