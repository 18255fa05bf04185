"""The real CLAP and ImageBind reward code on tiny random-init weights (no download), as the reward
section of a config, for the joint audio-video families' loop tests."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_diffusion_rl.benchmarks.tiny_families import AudioVideoLevel  # noqa: F401 - the tests import it here
from rewards.imagebind import INSTALL_COMMAND, TINY_ARCHITECTURE, build_model, imagebind_available
from rewards.tiny_models import save_tiny_clap

needs_imagebind = pytest.mark.skipif(
    not imagebind_available() and not os.environ.get("ODRL_REQUIRE_IMAGEBIND"),
    reason=f"imagebind-unofficial is not installed ({INSTALL_COMMAND})",
)


def clap_and_imagebind(folder: Path) -> dict[str, Any]:
    """reward: {weights: {clap: 1, imagebind: 1}, options: ...} with tiny checkpoints under `folder`."""
    torch.manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(build_model(TINY_ARCHITECTURE).state_dict(), folder / "imagebind.pth")
    options = {
        "clap": {"checkpoint": str(save_tiny_clap(folder / "clap"))},
        "imagebind": {"checkpoint": str(folder / "imagebind.pth"), "architecture": TINY_ARCHITECTURE},
    }
    return {"weights": {"clap": 1.0, "imagebind": 1.0}, "options": options}


AV_LEVEL_PLUGIN = """
from omni_diffusion_rl.registry import rewards
from tests.av_rewards import AudioVideoLevel

rewards.register("av_level")(AudioVideoLevel)
"""
"""AudioVideoLevel as a plug-in file for launched processes (reward.plugins)."""
