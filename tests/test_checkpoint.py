"""Atomic checkpoints: round trip, the `latest` pointer, pruning, and refusal of damaged checkpoints."""

from __future__ import annotations

import json
import shutil
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
        "state.json",
        "tensors.safetensors",
        "training_state.json",
        "training_state.safetensors",
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
    assert set(manifest["files"]) == {
        "state.json",
        "tensors.safetensors",
        "training_state.json",
        "training_state.safetensors",
    }


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


def test_a_run_killed_before_its_first_latest_pointer_resumes_from_its_newest_complete_checkpoint(
    tmp_path: Path,
) -> None:
    """Killed between a checkpoint's rename and the pointer's write: no `latest`, a complete step."""
    root = tmp_path / "ckpt"
    for step in (1, 2):
        save_checkpoint(root, step, *_payload(step))
    (root / "latest").unlink()
    (root / "step_0000003").mkdir()  # a folder without its manifest is not a checkpoint
    assert resolve_checkpoint(root) == root / "step_0000002"
    assert load_checkpoint(root)[2]["step"] == 2
    for step in ("step_0000001", "step_0000002"):
        shutil.rmtree(root / step)
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        resolve_checkpoint(root)


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
    (path / "training_state.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing training_state.safetensors"):
        load_checkpoint(path)
    assert load_checkpoint(path, objects=False)[2]["step"] == 1  # sampling needs no training state


def test_unreadable_manifest(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "ckpt", 1, *_payload(1))
    (path / "manifest.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(path)


def test_crash_during_save_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, *_payload(1))

    def crash(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module, "encode_state", crash)
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


def test_pruning_keeps_what_latest_names(tmp_path: Path) -> None:
    """A lower step saved after higher ones (a second run in the folder) is not pruned away."""
    root = tmp_path / "ckpt"
    for step in (60, 80, 10):
        save_checkpoint(root, step, *_payload(step), keep_last=2)
    assert (root / "latest").read_text(encoding="utf-8").strip() == "step_0000010"
    assert load_checkpoint(root)[2]["step"] == 10


def test_training_state_round_trips_optimizer_and_rng_without_pickle(tmp_path: Path) -> None:
    import random

    import numpy as np

    param = torch.nn.Parameter(torch.randn(3, 2))
    optimizer = torch.optim.AdamW([param], lr=1e-3, betas=(0.8, 0.95))
    param.grad = torch.ones_like(param)
    optimizer.step()
    objects = {
        "optimizer": optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
    }
    path = save_checkpoint(tmp_path / "ckpt", 1, {"w": torch.zeros(1)}, objects, {"step": 1})
    _, got, _ = load_checkpoint(path)
    assert got["python_rng"] == objects["python_rng"]
    assert got["numpy_rng"][0] == "MT19937" and got["numpy_rng"][1].dtype == np.uint32
    assert np.array_equal(got["numpy_rng"][1], objects["numpy_rng"][1])
    assert torch.equal(got["torch_rng"], objects["torch_rng"])
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3, 2))], lr=1.0)
    fresh.load_state_dict(got["optimizer"])
    assert fresh.param_groups[0]["betas"] == (0.8, 0.95) and fresh.param_groups[0]["lr"] == 1e-3
    assert torch.equal(
        fresh.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )
    random.setstate(got["python_rng"])
    np.random.set_state(got["numpy_rng"])


def _rewrite_manifest(path: Path, edit: Any) -> None:
    manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    (path / "manifest.json").write_text(json.dumps(edit(manifest)), encoding="utf-8")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: [], "no 'files' table"),
        (lambda m: {"files": "x"}, "no 'files' table"),
        (lambda m: {"files": {**m["files"], "state.json": 3}}, "malformed entry for state.json"),
        (lambda m: {"files": {**m["files"], "../outside": {"bytes": 1, "sha256": "0"}}}, "not a file of"),
        (lambda m: {"files": {k: v for k, v in m["files"].items() if k != "tensors.safetensors"}}, "missing"),
    ],
)
def test_hand_edited_manifest_is_a_clear_error(tmp_path: Path, edit: Any, message: str) -> None:
    path = save_checkpoint(tmp_path / "ckpt", 1, *_payload(1))
    _rewrite_manifest(path, edit)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path)


def test_garbage_tensor_file_with_a_matching_manifest_is_a_clear_error(tmp_path: Path) -> None:
    import hashlib

    path = save_checkpoint(tmp_path / "ckpt", 1, *_payload(1))
    data = b"\xff" * 64
    (path / "tensors.safetensors").write_bytes(data)
    _rewrite_manifest(
        path,
        lambda m: {
            "files": {
                **m["files"],
                "tensors.safetensors": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()},
            }
        },
    )
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(path)


@pytest.mark.parametrize("pointer", ["../elsewhere/step_0000001", "/tmp/step_0000001", "step_1"])
def test_latest_pointing_outside_the_run_is_refused(tmp_path: Path, pointer: str) -> None:
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, *_payload(1))
    (root / "latest").write_text(pointer + "\n", encoding="utf-8")
    with pytest.raises(CheckpointError, match="may only name a checkpoint next to it"):
        load_checkpoint(root)


def test_format_1_checkpoint_samples_but_never_unpickles(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "ckpt", 1, *_payload(1))
    state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    (path / "state.json").write_text(json.dumps({**state, "format": 1}), encoding="utf-8")
    import hashlib

    data = (path / "state.json").read_bytes()
    _rewrite_manifest(
        path,
        lambda m: {
            "files": {
                **m["files"],
                "state.json": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()},
            }
        },
    )
    assert load_checkpoint(path, objects=False)[2]["step"] == 1
    with pytest.raises(CheckpointError, match="never unpickled"):
        load_checkpoint(path)


def test_checkpoint_path_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x", encoding="utf-8")
    with pytest.raises(CheckpointError, match="is a file"):
        load_checkpoint(tmp_path / "f")
