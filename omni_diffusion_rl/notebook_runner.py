"""Where notebooks/preview_generations.ipynb reads its checkpoint and writes its previews, and
running it headless (`make notebook`).

By default the notebook previews the latest checkpoint of `make demo` (`runs/tiny_t2av_nft/` of
this checkout, found from wherever the notebook is started) and writes into that run's `notebook/`
folder. ODRL_RUN_DIR names another run folder (its `checkpoints/` is read), ODRL_CHECKPOINT a
checkpoint folder or a run's `checkpoints/` folder, ODRL_PREVIEW_DIR where the previews go;
relative paths are from the checkout's root. Without a checkpoint it stops with NoCheckpointError
rather than preview the untrained model.

python -m omni_diffusion_rl.notebook_runner [--run-dir DIR | --checkpoint DIR] [--output FILE.ipynb]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUN_DIR_ENV = "ODRL_RUN_DIR"
CHECKPOINT_ENV = "ODRL_CHECKPOINT"
PREVIEW_DIR_ENV = "ODRL_PREVIEW_DIR"
DEMO_RUN = Path("runs") / "tiny_t2av_nft"
NOTEBOOK = Path("notebooks") / "preview_generations.ipynb"
PROJECT_NAME = 'name = "omni-diffusion-rl"'


class NoCheckpointError(FileNotFoundError):
    """There is no checkpoint to preview."""


@dataclass(frozen=True)
class PreviewPaths:
    """What the notebook previews (`checkpoint`: a checkpoint folder or a run's checkpoints/) and
    where it writes (`out_dir`, in the run folder `run_dir` unless ODRL_PREVIEW_DIR says otherwise)."""

    checkpoint: Path
    run_dir: Path
    out_dir: Path


def repo_root(start: str | os.PathLike[str] | None = None) -> Path | None:
    """The omni-diffusion-rl checkout holding `start` (default: the working directory), else the one
    this package is installed from (an editable install), else None."""
    here = Path.cwd() if start is None else Path(start)
    here = here.resolve()
    for folder in (here, *here.parents):
        if _is_checkout(folder):
            return folder
    installed = Path(__file__).resolve().parent.parent
    return installed if _is_checkout(installed) else None


def _is_checkout(folder: Path) -> bool:
    try:
        with open(folder / "pyproject.toml", encoding="utf-8", errors="replace") as f:
            return PROJECT_NAME in f.read(65536)
    except OSError:
        return False


GSPO_RUN = Path("runs") / "tiny_avqa_gspo"  # recipes/configs/tiny_avqa_gspo.yaml's output_dir


def gspo_checkpoint(cwd: str | os.PathLike[str] | None = None) -> Path | None:
    """The GSPO recipe's checkpoints folder in this checkout when that run has saved one, else None
    (the notebook then shows the shipped tiny omni base)."""
    root = repo_root(cwd)
    folder = None if root is None else root / GSPO_RUN / "checkpoints"
    return folder if folder is not None and (folder / "latest").exists() else None


SYNC_RUN = Path("runs") / "tiny_sync_nft"  # recipes/configs/tiny_sync_nft.yaml's output_dir (make demo-sync)


def sync_checkpoint(cwd: str | os.PathLike[str] | None = None) -> Path | None:
    """The sync recipe's checkpoints folder in this checkout when `make demo-sync` has saved one, else
    None (the notebook then shows the shipped tiny sync base)."""
    root = repo_root(cwd)
    folder = None if root is None else root / SYNC_RUN / "checkpoints"
    return folder if folder is not None and (folder / "latest").exists() else None


def preview_paths(
    environ: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None
) -> PreviewPaths:
    """The checkpoint the notebook previews and where its previews go (see the module's docstring);
    NoCheckpointError, naming `make demo`, when there is no checkpoint."""
    env = os.environ if environ is None else environ
    root = repo_root(cwd)
    base = root if root is not None else Path.cwd() if cwd is None else Path(cwd)

    def given(name: str) -> Path | None:
        text = env.get(name, "").strip()
        return (base / Path(text).expanduser()).resolve() if text else None

    run_dir, checkpoint = given(RUN_DIR_ENV), given(CHECKPOINT_ENV)
    if run_dir is None and checkpoint is not None:  # the run folder that holds the checkpoint
        if checkpoint.name == "checkpoints":
            run_dir = checkpoint.parent
        elif checkpoint.parent.name == "checkpoints":
            run_dir = checkpoint.parent.parent
        else:
            run_dir = checkpoint.parent
    if run_dir is None:
        if root is None:
            raise NoCheckpointError(
                f"found no omni-diffusion-rl checkout above {base} to take the demo's run from; set "
                f"{CHECKPOINT_ENV} to a checkpoint folder or a run's checkpoints/ folder, or {RUN_DIR_ENV}"
            )
        run_dir = root / DEMO_RUN
    if checkpoint is None:
        checkpoint = run_dir / "checkpoints"
    _check_checkpoint(checkpoint)
    return PreviewPaths(checkpoint, run_dir, given(PREVIEW_DIR_ENV) or run_dir / "notebook")


def _check_checkpoint(path: Path) -> None:
    from .checkpoint import MANIFEST

    advice = (
        "Run `make demo` first (it post-trains the tiny model and writes runs/tiny_t2av_nft/checkpoints/), "
        f"or set {CHECKPOINT_ENV} to a checkpoint folder or a run's checkpoints/ folder "
        f"({RUN_DIR_ENV} to a run folder). The notebook does not preview an untrained model."
    )
    if not path.exists():
        raise NoCheckpointError(f"no checkpoint at {path}. {advice}")
    if not ((path / "latest").is_file() or (path / MANIFEST).is_file()):
        raise NoCheckpointError(f"{path} holds no complete checkpoint (no latest or {MANIFEST}). {advice}")


def execute_notebook(
    notebook: str | os.PathLike[str],
    output: str | os.PathLike[str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout_s: int = 1800,
) -> Any:
    """Run every cell of `notebook` in a fresh kernel of this interpreter (ipykernel), started in
    `cwd` (default: the notebook's folder, as Jupyter does); write the executed notebook, outputs
    and all, to `output` (also when a cell fails); return it (an nbformat NotebookNode). A failing
    cell raises nbclient's CellExecutionError."""
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    notebook = Path(notebook)
    nb = nbformat.read(notebook, as_version=4)
    # no kernel_dirs: the ipykernel of this interpreter, never a "python3" registered elsewhere
    kernel = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))
    folder = Path(cwd) if cwd is not None else notebook.resolve().parent
    client = NotebookClient(nb, km=kernel, timeout=timeout_s, resources={"metadata": {"path": str(folder)}})
    try:
        client.execute()
    finally:
        if output is not None:
            Path(output).parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, str(output))
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omni_diffusion_rl.notebook_runner",
        description="Execute notebooks/preview_generations.ipynb headless against a run's checkpoint "
        "(default: the demo's, runs/tiny_t2av_nft) and write the executed copy, with its pictures and "
        "audio players, into the run folder (RUN/notebook/preview_generations.ipynb).",
    )
    parser.add_argument("--run-dir", type=Path, help="a run folder (reads its checkpoints/)")
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint folder or a run's checkpoints/")
    parser.add_argument(
        "--output", type=Path, help="the executed notebook (default: in the previews' folder)"
    )
    parser.add_argument("--notebook", type=Path, help="the notebook to execute (default: the checkout's)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a cell may run")
    args = parser.parse_args(argv)
    for name, value in ((RUN_DIR_ENV, args.run_dir), (CHECKPOINT_ENV, args.checkpoint)):
        if value is not None:
            os.environ[name] = str(value.resolve())  # the kernel inherits this environment
    try:
        paths = preview_paths()
    except NoCheckpointError as e:
        print(f"odrl notebook: {e}", file=sys.stderr)
        return 2
    root = repo_root()
    notebook = args.notebook or (root / NOTEBOOK if root is not None else NOTEBOOK)
    output = args.output or paths.out_dir / NOTEBOOK.name
    from nbclient.exceptions import CellExecutionError

    try:
        execute_notebook(notebook, output, timeout_s=args.timeout)
    except CellExecutionError as e:
        print(f"odrl notebook: a cell failed (executed copy: {output}):\n{e}", file=sys.stderr)
        return 1
    print(f"executed {notebook} on {paths.checkpoint}: {output} (previews in {paths.out_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
