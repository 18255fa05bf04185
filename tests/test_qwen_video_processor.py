"""Qwen2.5-Omni's video input against transformers' own Qwen2_5OmniProcessor (its video processor needs
torchvision, which this environment lacks: the arrays were saved from it in a separate environment by
tests/fixtures/make_qwen_video_arrays.py, at Qwen2.5-Omni-7B's image settings). A non-square clip
keeps its aspect ratio and gets the processor's grid; a clip already on that grid gets its patches."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_diffusion_rl.answer_data.questions import AskedQuestion
from omni_diffusion_rl.models.qwen_omni import QwenOmniModel, processor_frame_size

from .qwen_omni_tiny import save_tiny_qwen_omni

FIXTURES = Path(__file__).parent / "fixtures"


def _maker():
    spec = importlib.util.spec_from_file_location(
        "make_qwen_video_arrays", FIXTURES / "make_qwen_video_arrays.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def seven_b_pixels_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny thinker with Qwen2.5-Omni-7B's image settings in its preprocessor_config.json."""
    folder = save_tiny_qwen_omni(tmp_path_factory.mktemp("qwen7b_pixels"))
    config = folder / "preprocessor_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | _maker().QWEN25_OMNI_7B_PIXELS))
    return folder


@pytest.mark.parametrize("name", ["small", "on_grid"])
def test_a_non_square_clip_gets_the_processors_grid_and_patches(
    seven_b_pixels_folder: Path, name: str
) -> None:
    maker = _maker()
    saved = np.load(FIXTURES / "qwen_video_processor.npz")
    frames, height, width = maker.CLIPS[name]
    probe = QwenOmniModel.from_pretrained(seven_b_pixels_folder, fps=4, seconds=1)
    size = processor_frame_size(height, width, probe.image_processor)
    grid = saved[f"{name}_grid"][0]
    assert size == (grid[1] * 14, grid[2] * 14)  # 30 x 40 -> 56 x 84: the aspect ratio kept, not a square
    model = QwenOmniModel.from_pretrained(
        seven_b_pixels_folder, fps=4, seconds=1, frame_size=f"{size[1]}x{size[0]}"
    )
    video = torch.from_numpy(maker.clip(frames, height, width)).permute(0, 3, 1, 2).float() / 255
    clips, _ = model.clip_tensors([AskedQuestion("which colour ?", "red", "colour", video=video)])
    made = model._video_inputs(clips)
    assert made["video_grid_thw"].tolist() == saved[f"{name}_grid"].tolist()
    ours, theirs = made["pixel_values_videos"].numpy(), saved[f"{name}_pixels"]
    assert ours.shape == theirs.shape
    if name == "on_grid":  # nothing resized on either side: the same patches, to rounding
        np.testing.assert_allclose(ours, theirs, atol=1e-6)
        return
    # resized on both sides, bicubic (the processor's resample): the processor resizes bytes and
    # rounds, we resize floats, so a pixel may differ by a level or so; bilinear differed by 0.17 on average
    one_level = 1 / 255 / min(probe.image_processor.image_std)
    gap = np.abs(ours - theirs)
    assert gap.mean() < 0.01 and np.median(gap) < 1e-6 and (gap <= one_level + 1e-6).mean() >= 0.9


def test_a_question_files_frames_are_resized_as_the_processor_resizes(
    seven_b_pixels_folder: Path, tmp_path: Path
) -> None:
    """A clip on disk is resized to the model's frame size as it is decoded: for the Qwen families
    as the folder's processor says (bicubic for Qwen's; bilinear when its `resample` is 2), the same
    frames as decoding whole and resizing after; the tiny models keep bilinear."""
    from omni_diffusion_rl.answer_data.clip_files import ClipFormat, decode_video, write_mp4

    model = QwenOmniModel.from_pretrained(seven_b_pixels_folder, fps=4, seconds=1, frame_size="84x56")
    assert model.clip_format.resample == "bicubic"
    video = torch.from_numpy(_maker().clip(4, 30, 40)).permute(0, 3, 1, 2).float() / 255
    write_mp4(tmp_path / "clip.mp4", video, 4.0)
    whole = decode_video(tmp_path / "clip.mp4", ClipFormat(4.0, 8000, 1.0))
    decoded = decode_video(tmp_path / "clip.mp4", model.clip_format)
    bicubic = torch.nn.functional.interpolate(whole, (56, 84), mode="bicubic", antialias=True).clamp(0, 1)
    bilinear = torch.nn.functional.interpolate(whole, (56, 84), mode="bilinear", antialias=True)
    torch.testing.assert_close(decoded, bicubic, atol=1e-6, rtol=0)
    assert float((decoded - bilinear).abs().mean()) > 0.01
    bilinear_folder = tmp_path / "bilinear"
    shutil.copytree(seven_b_pixels_folder, bilinear_folder)
    config = bilinear_folder / "preprocessor_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"resample": 2}))
    assert QwenOmniModel.from_pretrained(bilinear_folder, fps=4, seconds=1).clip_format.resample == "bilinear"
    with pytest.raises(ValueError, match="resample='nearest': bilinear or bicubic"):
        ClipFormat(4.0, 8000, 1.0, resample="nearest")
