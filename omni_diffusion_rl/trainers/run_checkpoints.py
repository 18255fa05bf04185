"""A run's checkpoints: what `odrl train` saves every train.checkpoint_every steps and `--resume`
loads. The algorithm's tensors (whole LoRA tensors, also when sharded), the optimizer state, the RNG
states, the run's progress and its experience source's state; the same files sharded or not."""

from __future__ import annotations

import dataclasses
import random
import reprlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint import (
    CheckpointError,
    ResumeFields,
    check_execution_state,
    check_training_objects,
    load_checkpoint,
    resume_fields,
    save_checkpoint,
)
from ..config import ExperimentConfig
from ..models.fingerprint import fingerprint_matches, model_fingerprint
from ..runtime.sharding import load_whole_optimizer_state, whole_optimizer_state
from .skeleton import Algorithm
from .sources import ExperienceSource


class RunCheckpoints:
    """Saves and loads the checkpoints of one training process (the main one writes; sharded, every
    process gathers the whole tensors with it)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        algorithm: Algorithm,
        optimizer: torch.optim.Optimizer,
        source: ExperienceSource,
        is_main: bool,
        sharded: bool,
        output_dir: Path,
    ) -> None:
        self.cfg, self.algorithm, self.optimizer, self.source = cfg, algorithm, optimizer, source
        self.is_main, self.sharded, self.folder = is_main, sharded, output_dir / "checkpoints"

    def fingerprint(self) -> str:
        """What a checkpoint must match: the model and its adapters (not the training knobs)."""
        return model_fingerprint(dataclasses.asdict(self.cfg.model), self.algorithm.learner.transformer)

    def save(self, step: int, progress: dict[str, Any]) -> Path | None:
        """Write the checkpoint of `step` (on the main process; its path), with `progress`: the
        run's counters kept across a resume (eval_before, sample_counts, wandb_run_id, train_seconds)."""
        if not (self.is_main or self.sharded):
            return None
        tensors = self.algorithm.checkpoint_tensors()
        optimizer = whole_optimizer_state(self.optimizer) if self.sharded else self.optimizer.state_dict()
        if not self.is_main:
            return None
        objects = {
            "optimizer": optimizer,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "numpy_rng": np.random.get_state(),
        }
        state = {
            "step": step,
            "data_position": step * self.cfg.data.prompts_per_step,
            "model_fingerprint": self.fingerprint(),
            **progress,
            "config": self.cfg.to_dict(),
            **self.source.state_dict(),
        }
        return save_checkpoint(self.folder, step, tensors, objects, state)

    def load(self, path: str | Path, set_step: Callable[[int], None]) -> ResumeFields:
        """Resume from the checkpoint at `path`: its adapters, optimizer and RNG states, the step
        (`set_step`, before the source's state, which may read it) and the source's state; the
        fields taken from it. Only the run's own config decides what runs; every field is checked
        (checkpoint.resume_fields and the checks it names) before any is applied, and anything wrong
        is a CheckpointError that says what."""
        tensors, objects, state = load_checkpoint(path)
        transformer = self.algorithm.learner.transformer
        if not fingerprint_matches(state, dataclasses.asdict(self.cfg.model), transformer):
            saved = state.get("config", {}).get("model") if isinstance(state.get("config"), dict) else None
            raise CheckpointError(
                f"checkpoint {path} was made for another model configuration ({reprlib.repr(saved)}); "
                f"this run uses {dataclasses.asdict(self.cfg.model)}"
            )
        resumed = resume_fields(state, path)
        check_execution_state(state, path)
        check_training_objects(objects, self.optimizer, path)
        try:
            self.algorithm.load_checkpoint_tensors(tensors)
            load_whole_optimizer_state(self.optimizer, objects["optimizer"])
            torch.set_rng_state(objects["torch_rng"])
            random.setstate(objects["python_rng"])
            np.random.set_state(objects["numpy_rng"])
            set_step(resumed.step)
            self.source.load_state_dict(state)
        except (KeyError, ValueError, TypeError, RuntimeError, OverflowError) as e:
            raise CheckpointError(f"checkpoint {path} does not fit this run: {e}") from e
        return resumed
