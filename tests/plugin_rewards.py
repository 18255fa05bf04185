"""Rewards for the server tests, registered when a server is started with `--plugin tests.plugin_rewards`."""

from __future__ import annotations

import os
import time

import torch

from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.reward import RewardError, RewardOutput


@rewards.register("test_prompt_length", overwrite=True)
class PromptLength:
    """len(prompt) + mean audio, with the batch size it was called with as a component."""

    def score(self, media: MediaBatch, prompts: list[str]) -> RewardOutput:
        audio = media.audio.flatten(1).mean(1) if media.audio is not None else torch.zeros(len(prompts))
        scores = torch.tensor([float(len(p)) for p in prompts]) + audio
        return RewardOutput(scores, {"batch": torch.full((len(prompts),), float(len(prompts)))})


@rewards.register("test_slow", overwrite=True)
class Slow:
    """Sleeps ODRL_TEST_SLOW_S seconds per call."""

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        time.sleep(float(os.environ.get("ODRL_TEST_SLOW_S", "0")))
        return torch.ones(len(prompts))


@rewards.register("test_fails_on_bad", overwrite=True)
class FailsOnBad:
    """Raises when a prompt says 'bad'; 1.0 otherwise."""

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        if "bad" in prompts:
            raise ValueError(f"cannot score prompt 'bad' (position {prompts.index('bad')})")
        return torch.ones(len(prompts))


@rewards.register("test_fails_on_red", overwrite=True)
class FailsOnRed:
    """Raises when a prompt mentions red; 1.0 otherwise (a reward that cannot score some samples)."""

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        if any("red" in p for p in prompts):
            raise ValueError("no opinion on red things")
        return torch.ones(len(prompts))


@rewards.register("test_dies_after", overwrite=True)
class DiesAfter:
    """Ends its process (as a crash would) on call number ODRL_TEST_DIE_AFTER; 1.0 before that."""

    calls = 0

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        DiesAfter.calls += 1
        if DiesAfter.calls >= int(os.environ.get("ODRL_TEST_DIE_AFTER", "1000000000")):
            os._exit(17)
        return torch.ones(len(prompts))


@rewards.register("test_dies_on_rank", overwrite=True)
class DiesOnRank:
    """Ends its process (exit 17, as a crash would) on the process whose RANK is ODRL_TEST_DIE_RANK."""

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        if os.environ.get("RANK") == os.environ.get("ODRL_TEST_DIE_RANK"):
            os._exit(17)
        return torch.ones(len(prompts))


@rewards.register("test_error_on_rank", overwrite=True)
class ErrorOnRank:
    """Stops the run (RewardError) on the process whose RANK is ODRL_TEST_ERROR_RANK; 1.0 elsewhere."""

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        rank = os.environ.get("RANK")
        if rank is not None and rank == os.environ.get("ODRL_TEST_ERROR_RANK"):
            raise RewardError(f"test_error_on_rank: refused on rank {rank}")
        return torch.ones(len(prompts))


@rewards.register("test_nan_on_red", overwrite=True)
class NanOnRed:
    """NaN for prompts that mention red (a scorer that cannot score some samples); 1.0 otherwise."""

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        return torch.tensor([float("nan") if "red" in p else 1.0 for p in prompts])


@rewards.register("test_constant", overwrite=True)
class Constant:
    """0.5 for every sample: every group-relative advantage is 0."""

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        return torch.full((len(prompts),), 0.5)
