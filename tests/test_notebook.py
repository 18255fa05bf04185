"""The preview notebook executes headless against a real checkpoint, from any folder, writing only
into the run folder; without a checkpoint it stops and says to run `make demo`."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

from omni_diffusion_rl import notebook_runner
from omni_diffusion_rl.config import load_config
from omni_diffusion_rl.notebook_runner import NoCheckpointError, preview_paths, repo_root
from omni_diffusion_rl.trainers.trainer import Trainer

from .helpers import REPO, fast_overrides, tiny_model_dir

NOTEBOOK = REPO / "notebooks" / "preview_generations.ipynb"
# The executing tool: nbclient starting an ipykernel (the `notebook` extra). Without it, the code
# cells run in this process.
KERNEL = all(importlib.util.find_spec(name) for name in ("nbclient", "nbformat", "ipykernel"))
ENVIRONMENT = ("ODRL_RUN_DIR", "ODRL_CHECKPOINT", "ODRL_PREVIEW_DIR", "ODRL_PRETRAINED")


@pytest.fixture(autouse=True)
def _no_preview_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _files(folder: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in folder.rglob("*")}


def _run_in_process(monkeypatch: pytest.MonkeyPatch, cwd: Path) -> None:
    """The notebook's code cells in this process, started in `cwd`, IPython's display stubbed."""
    import nbformat

    display = types.ModuleType("IPython.display")
    display.Audio = display.Image = lambda *args, **kwargs: (args, kwargs)
    display.display = lambda *objects: None
    monkeypatch.setitem(sys.modules, "IPython.display", display)
    monkeypatch.chdir(cwd)
    namespace: dict = {"__name__": "__main__"}
    for cell in nbformat.read(NOTEBOOK, as_version=4).cells:
        if cell.cell_type == "code":
            exec(compile(cell.source, f"{NOTEBOOK.name}[{cell.get('id')}]", "exec"), namespace)


def _checkpoint(tmp_path: Path) -> Path:
    """A run folder with a one-step checkpoint of a tiny model."""
    model = tiny_model_dir(tmp_path / "model")
    run = tmp_path / "run"
    Trainer(load_config(None, fast_overrides(model, run, 1) + ["train.eval_at_start_and_end=false"])).fit()
    return run


@pytest.mark.slow
def test_the_notebook_previews_a_checkpoint_into_its_run_from_another_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _checkpoint(tmp_path)
    monkeypatch.setenv("ODRL_CHECKPOINT", str(run / "checkpoints"))
    notebooks_before = _files(NOTEBOOK.parent)
    out = run / "notebook"
    if KERNEL:  # `make notebook`'s way: a kernel started in notebooks/, as Jupyter starts it
        monkeypatch.chdir(NOTEBOOK.parent)
        assert notebook_runner.main([]) == 0
        import nbformat

        nb = nbformat.read(out / "preview_generations.ipynb", as_version=4)
        outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
        assert not [o for o in outputs if o.get("output_type") == "error"]
        mimes = {m for o in outputs for m in o.get("data", {})}
        assert "image/png" in mimes, f"the contact sheet must be shown; got {mimes}"
        players = [o.get("data", {}).get("text/html", "") for o in outputs]
        assert any("<video" in html and "data:video/mp4;base64" in html for html in players), (
            "each sample must play as an MP4 with its sound"
        )
        assert any("audio" in html for html in players), "audio players must be shown"
        printed = "".join(o.get("text", "") for o in outputs)
        assert f"checkpoint: {run / 'checkpoints'}" in printed and f"previews go to: {out}" in printed
    else:
        _run_in_process(monkeypatch, NOTEBOOK.parent)
    assert {"sheet.png", "sample_00.gif", "sample_00.wav", "sample_00.mp4", "index.json"} <= {
        p.name for p in out.iterdir()
    }
    assert {"sheet.png", "sample_00.mp4"} <= {p.name for p in (out / "sync").iterdir()}, (
        "the sync section shows its own sheet and MP4s with sound"
    )
    assert _files(NOTEBOOK.parent) == notebooks_before, "nothing may be written under notebooks/"


@pytest.mark.slow
def test_the_notebook_without_a_checkpoint_says_to_run_make_demo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "never_trained"
    monkeypatch.setenv("ODRL_RUN_DIR", str(run))
    if KERNEL:
        from nbclient.exceptions import CellExecutionError

        with pytest.raises(CellExecutionError, match="NoCheckpointError") as caught:
            notebook_runner.execute_notebook(NOTEBOOK, timeout_s=300)
        assert "make demo" in str(caught.value)
        assert notebook_runner.main([]) == 2  # refused before any kernel starts
        assert "make demo" in capsys.readouterr().err
    else:
        with pytest.raises(NoCheckpointError, match="make demo"):
            _run_in_process(monkeypatch, NOTEBOOK.parent)
    assert not run.exists(), "nothing is written for a run without a checkpoint"


def _checkout(root: Path) -> Path:
    """A stand-in checkout: pyproject.toml naming the project, the demo's run with a checkpoint."""
    (root / "notebooks").mkdir(parents=True)
    (root / "pyproject.toml").write_text('[project]\nname = "omni-diffusion-rl"\n')
    demo = root / "runs" / "tiny_t2av_nft" / "checkpoints"
    demo.mkdir(parents=True)
    (demo / "latest").write_text("step_0000240")
    other = root / "runs" / "other" / "checkpoints" / "step_0000001"
    other.mkdir(parents=True)
    (other / "manifest.json").write_text("{}")
    (other.parent / "latest").write_text(other.name)
    return root


def test_the_sync_section_finds_the_sync_demos_checkpoint_or_none(tmp_path: Path) -> None:
    root = _checkout(tmp_path / "checkout")
    assert notebook_runner.sync_checkpoint(root / "notebooks") is None  # the shipped sync base then
    run = root / notebook_runner.SYNC_RUN / "checkpoints"
    run.mkdir(parents=True)
    (run / "latest").write_text("step_0000240")
    assert notebook_runner.sync_checkpoint(root / "notebooks") == run


def test_the_demo_run_is_found_wherever_the_notebook_starts(tmp_path: Path) -> None:
    root = _checkout(tmp_path / "checkout")
    for cwd in (root, root / "notebooks"):
        paths = preview_paths({}, cwd=cwd)
        assert paths.checkpoint == root / "runs" / "tiny_t2av_nft" / "checkpoints"
        assert paths.out_dir == root / "runs" / "tiny_t2av_nft" / "notebook"
    step = {"ODRL_CHECKPOINT": "runs/other/checkpoints/step_0000001"}  # relative: from the root
    paths = preview_paths(step, cwd=root / "notebooks")
    assert (paths.run_dir, paths.out_dir) == (root / "runs" / "other", root / "runs" / "other" / "notebook")
    paths = preview_paths({"ODRL_RUN_DIR": "runs/other", "ODRL_PREVIEW_DIR": "look"}, cwd=root)
    assert paths.checkpoint == root / "runs" / "other" / "checkpoints" and paths.out_dir == root / "look"
    assert repo_root(tmp_path) == REPO, "outside a checkout: the one the package is installed from"


def test_a_missing_or_empty_checkpoint_folder_is_refused_naming_make_demo(tmp_path: Path) -> None:
    root = _checkout(tmp_path / "checkout")
    (root / "runs" / "tiny_t2av_nft" / "checkpoints" / "latest").unlink()  # interrupted before a save
    with pytest.raises(NoCheckpointError, match=r"holds no complete checkpoint.*`make demo`"):
        preview_paths({}, cwd=root)
    with pytest.raises(NoCheckpointError, match=r"no checkpoint at .*missing.*`make demo`"):
        preview_paths({"ODRL_RUN_DIR": str(tmp_path / "missing")}, cwd=root)
