"""The ImageBind reward on a tiny random-init ImageBindModel built from the real `imagebind-unofficial` code.

Preprocessing tests need no ImageBind; the model tests are skipped when the package is not installed
(set ODRL_REQUIRE_IMAGEBIND=1 to make that a failure, as CI should).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.reward import RewardOutput
from rewards import imagebind_preprocess as prep
from rewards.imagebind import (
    CHECKPOINT_URL,
    INSTALL_COMMAND,
    TINY_ARCHITECTURE,
    ImageBindReward,
    build_model,
    imagebind_available,
    load_imagebind,
)

PROMPTS = ["a dog barks", "rain on a window", "a violin plays"]
HAVE_IMAGEBIND = imagebind_available()
needs_imagebind = pytest.mark.skipif(
    not HAVE_IMAGEBIND and not os.environ.get("ODRL_REQUIRE_IMAGEBIND"),
    reason=f"imagebind-unofficial is not installed ({INSTALL_COMMAND})",
)


def _media(seed: int = 0, batch: int = 3, seconds: float = 3.0) -> MediaBatch:
    """Random stereo audio at 8 kHz and 12 non-square 20x16 frames at 4 fps."""
    g = torch.Generator().manual_seed(seed)
    video = torch.rand(batch, 12, 3, 20, 16, generator=g)
    audio = torch.rand(batch, 2, int(8000 * seconds), generator=g) * 1.6 - 0.8
    return MediaBatch(video=video, audio=audio, fps=4.0, sample_rate=8000)


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(TINY_ARCHITECTURE)


# ----------------------------------------------------------------------------------------------------------
# Audio preprocessing


def _noise(samples: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(samples, generator=g) * 0.1).double()


# At 128 bins the lowest Kaldi mel filters are empty, as in Kaldi; transformers warns about it.
EMPTY_MEL_FILTER_WARNING = "ignore:At least one mel filter has all zero values"


@pytest.mark.filterwarnings(EMPTY_MEL_FILTER_WARNING)
def test_fbank_matches_transformers_kaldi_reference() -> None:
    from transformers import ASTFeatureExtractor

    wave = _noise(32_000)
    # AST's extractor computes Kaldi-style fbank (its own numpy code without torchaudio, torchaudio's with it)
    # and pads to max_length with zeros before normalising: ImageBind's recipe for a 2 s clip.
    extractor = ASTFeatureExtractor(num_mel_bins=128, max_length=204, do_normalize=False)
    reference = extractor(wave.numpy(), sampling_rate=16_000, return_tensors="pt").input_values[0].double()
    mine = prep.kaldi_fbank(wave, 16_000)
    assert mine.shape == (198, 128)  # 1 + (32000 - 400) // 160 frames
    torch.testing.assert_close(mine, reference[:198], atol=1e-4, rtol=0)
    assert (reference[198:] == 0).all()

    # The whole ImageBind clip feature: AST normalises with (x - mean) / (2 std), so std = 9.138 / 2.
    normalising = ASTFeatureExtractor(num_mel_bins=128, max_length=204, mean=-4.268, std=9.138 / 2)
    expected = normalising(wave.numpy(), sampling_rate=16_000, return_tensors="pt").input_values[0]
    features = prep.audio_features(wave.float()[None, None], 16_000)
    assert features.shape == (1, 1, 1, 128, 204) and features.dtype == torch.float32
    torch.testing.assert_close(features[0, 0, 0].T, expected, atol=1e-4, rtol=0)


@pytest.mark.filterwarnings(EMPTY_MEL_FILTER_WARNING)
def test_fbank_povey_window_matches_reference_and_differs_from_hanning() -> None:
    from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

    wave = _noise(8000, seed=1)
    banks = mel_filter_bank(
        num_frequency_bins=257,
        num_mel_filters=128,
        min_frequency=20,
        max_frequency=8000,
        sampling_rate=16_000,
        norm=None,
        mel_scale="kaldi",
        triangularize_in_mel_space=True,
    )
    reference = spectrogram(
        wave.numpy(),
        window_function(400, "povey", periodic=False),
        frame_length=400,
        hop_length=160,
        fft_length=512,
        power=2.0,
        center=False,
        preemphasis=0.97,
        mel_filters=banks,
        log_mel="log",
        mel_floor=1.192092955078125e-07,
        remove_dc_offset=True,
    ).T
    povey = prep.kaldi_fbank(wave, 16_000, window="povey")
    torch.testing.assert_close(povey, torch.from_numpy(reference).double(), atol=1e-4, rtol=0)
    assert (povey - prep.kaldi_fbank(wave, 16_000)).abs().max() > 0.1  # the window choice is not a no-op
    with pytest.raises(ValueError, match="unknown window"):
        prep.kaldi_fbank(wave, 16_000, window="blackman")


def test_hanning_window_is_numpy_symmetric_hann() -> None:
    # ImageBind asks torchaudio for window_type='hanning': the symmetric Hann window, numpy's np.hanning.
    np.testing.assert_allclose(prep.kaldi_window("hanning", 400).numpy(), np.hanning(400), atol=1e-12)


def test_clip_starts_are_even_and_deduplicated() -> None:
    assert prep.clip_starts(48_000, 32_000, 3) == [0, 8_000, 16_000]
    assert prep.clip_starts(32_000, 32_000, 3) == [0]
    assert prep.clip_starts(10_000, 32_000, 3) == [0]  # shorter than a clip: one clip, the whole input
    assert prep.clip_starts(100, 10, 1) == [0]
    with pytest.raises(ValueError):
        prep.clip_starts(100, 10, 0)


def test_audio_features_clips_padding_and_mono() -> None:
    g = torch.Generator().manual_seed(2)
    stereo = torch.rand(2, 2, 24_000, generator=g) * 2 - 1  # 3 s at 8 kHz -> 48000 samples at 16 kHz
    features = prep.audio_features(stereo, 8000)
    assert features.shape == (2, 3, 1, 128, 204)
    mono = prep.audio_features(stereo.mean(dim=1, keepdim=True), 8000)
    torch.testing.assert_close(features, mono)  # channels are averaged first
    # Each clip ends with 6 frames of padding (0 before normalisation); the clips differ.
    pad = (0.0 - prep.FBANK_MEAN) / prep.FBANK_STD
    torch.testing.assert_close(features[..., 198:], torch.full_like(features[..., 198:], pad))
    assert not torch.allclose(features[:, 0], features[:, 1])

    short = prep.audio_features(stereo[:, :, :4000], 8000)  # 0.5 s: one clip, 48 frames + padding
    assert short.shape == (2, 1, 1, 128, 204)
    torch.testing.assert_close(short[..., 48:], torch.full_like(short[..., 48:], pad))
    assert (short[..., :48] != pad).any()
    with pytest.raises(ValueError, match="shorter than one"):
        prep.audio_features(stereo[:, :, :100], 8000)


# ----------------------------------------------------------------------------------------------------------
# Vision preprocessing


def test_video_frame_indices() -> None:
    # 16 frames at 4 fps: 8-frame windows starting at 0, 2, 4, 6, 8; first and last frame of each.
    index = prep.video_frame_indices(16, 4.0, num_clips=5, frames_per_clip=2)
    assert index.tolist() == [[0, 7], [2, 9], [4, 11], [6, 13], [8, 15]]
    assert prep.video_frame_indices(1, 8.0).tolist() == [[0, 0]]  # a still image: the frame twice
    assert prep.video_frame_indices(6, 8.0).tolist() == [[0, 5]]  # shorter than 2 s: one clip
    assert prep.video_frame_indices(40, 10.0, num_clips=2, frames_per_clip=3).tolist() == [
        [0, 9, 19],
        [20, 29, 39],
    ]


def test_vision_inputs_resize_crop_and_normalisation() -> None:
    colour = torch.tensor([0.2, 0.5, 0.9])
    video = colour[None, None, :, None, None].expand(2, 3, 3, 12, 20).clone()
    out = prep.vision_inputs(video, fps=8.0)
    assert out.shape == (2, 1, 3, 2, 224, 224) and out.dtype == torch.float32
    expected = (colour - torch.tensor(prep.CLIP_MEAN)) / torch.tensor(prep.CLIP_STD)
    torch.testing.assert_close(out.mean(dim=(0, 1, 3, 4, 5)), expected, atol=1e-5, rtol=0)

    assert prep.resize_short_side(torch.rand(1, 3, 12, 20)).shape == (1, 3, 224, 373)
    assert prep.resize_short_side(torch.rand(1, 3, 30, 20)).shape == (1, 3, 336, 224)
    overshoot = prep.resize_short_side((torch.rand(1, 3, 9, 9) > 0.5).float())
    assert overshoot.min() >= 0 and overshoot.max() <= 1  # bicubic ringing clamped like an 8-bit image

    # A left-to-right ramp: the centre crop sits in the middle; 3 crops go left, centre, right.
    ramp = torch.linspace(0, 1, 40).expand(1, 1, 3, 20, 40).clone()
    centre = prep.vision_inputs(ramp, fps=8.0)
    three = prep.vision_inputs(ramp, fps=8.0, spatial_crops=3)
    assert three.shape == (1, 3, 3, 2, 224, 224)
    means = three.mean(dim=(2, 3, 4, 5))[0]
    assert means[0] < means[1] < means[2]
    torch.testing.assert_close(three[:, 1], centre[:, 0])
    with pytest.raises(ValueError, match="spatial crops"):
        prep.vision_inputs(ramp, fps=8.0, spatial_crops=2)


# ----------------------------------------------------------------------------------------------------------
# Loading


def test_missing_package_names_the_install_command(tmp_path: Path) -> None:
    with pytest.raises(ImportError, match="not installed") as info:
        load_imagebind(search_path=[str(tmp_path)])
    assert INSTALL_COMMAND in str(info.value) and "imagebind-unofficial==0.1.1" in str(info.value)
    (tmp_path / "imagebind").mkdir()
    (tmp_path / "imagebind" / "__init__.py").write_text("")  # what PyPI's 'imagebind' 0.0.1.dev0 holds
    with pytest.raises(ImportError, match="empty placeholder") as info:
        load_imagebind(search_path=[str(tmp_path)])
    assert INSTALL_COMMAND in str(info.value)


@needs_imagebind
def test_real_modules_load_without_torchvision_and_leave_no_partial_packages() -> None:
    modules = load_imagebind()
    assert modules.model.__file__.endswith(os.path.join("imagebind", "models", "imagebind_model.py"))
    assert os.path.basename(modules.bpe_path) == "bpe_simple_vocab_16e6.txt.gz"
    trunk_globals = modules.model.SimpleTransformer.__init__.__globals__
    assert trunk_globals["DropPath"].__module__ == "timm.layers.drop"  # timm's own class, not a stand-in
    assert trunk_globals["trunc_normal_"].__module__ == "timm.layers.weight_init"
    assert not [m for m in sys.modules if m.split(".")[0] in ("imagebind", "timm")]
    assert "torchvision" not in sys.modules and "torchaudio" not in sys.modules
    tokens = modules.preprocessors.SimpleTokenizer(bpe_path=modules.bpe_path)("a dog barks")
    assert tokens.shape == (77,) and tokens[0] == 49406 and tokens[1:3].tolist() == [320, 1929]  # CLIP BPE
    assert 49407 in tokens.tolist()


@needs_imagebind
def test_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        ImageBindReward(checkpoint=tmp_path / "imagebind_huge.pth")
    assert CHECKPOINT_URL in str(info.value)
    with pytest.raises(ValueError, match="needs a checkpoint"):
        ImageBindReward()


@needs_imagebind
def test_checkpoint_round_trip(tiny_model: torch.nn.Module, tmp_path: Path) -> None:
    path = tmp_path / "tiny_imagebind.pth"
    torch.save(tiny_model.state_dict(), path)
    media = _media()
    direct = ImageBindReward(model=tiny_model, mode="all").score(media, PROMPTS)
    loaded = ImageBindReward(checkpoint=path, architecture=TINY_ARCHITECTURE, mode="all")
    assert loaded.model is not tiny_model
    from_file = loaded.score(media, PROMPTS)
    assert isinstance(direct, RewardOutput) and isinstance(from_file, RewardOutput)
    torch.testing.assert_close(from_file.scores, direct.scores, atol=1e-6, rtol=0)
    for name in direct.components:
        torch.testing.assert_close(from_file.components[name], direct.components[name], atol=1e-6, rtol=0)

    other = dict(TINY_ARCHITECTURE, out_embed_dim=8)
    with pytest.raises(ValueError, match="does not fit"):
        ImageBindReward(checkpoint=path, architecture=other)


# ----------------------------------------------------------------------------------------------------------
# Scoring


@needs_imagebind
def test_every_mode_scores_in_range(tiny_model: torch.nn.Module) -> None:
    media = _media()
    for mode in ("audio_video", "text_audio", "text_video"):
        scores = ImageBindReward(model=tiny_model, mode=mode).score(media, PROMPTS)
        assert isinstance(scores, torch.Tensor) and scores.shape == (3,) and scores.dtype == torch.float32
        assert torch.isfinite(scores).all() and scores.abs().max() <= 1.0
        assert scores.std() > 0  # the samples are told apart

    weights = {"audio_video": 2.0, "text_audio": 1.0, "text_video": 0.5}
    out = ImageBindReward(model=tiny_model, mode="all", weights=weights).score(media, PROMPTS)
    assert isinstance(out, RewardOutput) and set(out.components) == set(weights)
    expected = sum(w * out.components[k] for k, w in weights.items()) / sum(weights.values())
    torch.testing.assert_close(out.scores, expected)
    assert out.scores.shape == (3,) and out.scores.abs().max() <= 1.0
    single = ImageBindReward(model=tiny_model, mode="text_video").score(media, PROMPTS)
    torch.testing.assert_close(out.components["text_video"], single)
    assert rewards.get("imagebind") is ImageBindReward


@needs_imagebind
def test_scores_are_deterministic_and_follow_the_inputs(tiny_model: torch.nn.Module) -> None:
    media = _media()
    reward = ImageBindReward(model=tiny_model, mode="all")
    first, second = reward.score(media, PROMPTS), reward.score(media, PROMPTS)
    again = ImageBindReward(model=tiny_model, mode="all").score(_media(), PROMPTS)
    assert torch.equal(first.scores, second.scores) and torch.equal(first.scores, again.scores)

    other_audio = MediaBatch(video=media.video, audio=_media(seed=5).audio, fps=4.0, sample_rate=8000)
    moved = ImageBindReward(model=tiny_model).score(other_audio, PROMPTS)
    assert not torch.allclose(moved, first.components["audio_video"])
    # audio_video ignores the prompts; text modes do not.
    shuffled = PROMPTS[::-1]
    same = ImageBindReward(model=tiny_model).score(media, shuffled)
    torch.testing.assert_close(same, first.components["audio_video"])
    assert not torch.allclose(
        reward.score(media, shuffled).components["text_audio"], first.components["text_audio"]
    )


@needs_imagebind
def test_embeddings_are_renormalised(tiny_model: torch.nn.Module) -> None:
    media = _media()
    reward = ImageBindReward(model=tiny_model, mode="all")
    with torch.no_grad():
        raw = tiny_model(reward.inputs(media, PROMPTS))
    # ImageBind's heads scale audio by 20 and text by its logit scale: raw outputs are not unit vectors.
    assert raw["audio"].norm(dim=-1).min() > 10 and raw["text"].norm(dim=-1).min() > 10
    emb = reward.embed(media, PROMPTS)
    for value in emb.values():
        torch.testing.assert_close(value.norm(dim=-1), torch.ones(3))
    out = reward.score(media, PROMPTS)
    manual = (F.normalize(raw["audio"], dim=-1) * F.normalize(raw["vision"], dim=-1)).sum(-1)
    torch.testing.assert_close(out.components["audio_video"], manual)
    assert ((raw["audio"] * raw["text"]).sum(-1).abs() > 1).any()  # the unnormalised dot leaves [-1, 1]


@needs_imagebind
def test_still_image_and_short_audio(tiny_model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(3)
    media = MediaBatch(
        video=torch.rand(2, 1, 3, 8, 8, generator=g),
        audio=torch.rand(2, 1, 4000, generator=g) - 0.5,
        fps=8.0,
        sample_rate=8000,
    )
    scores = ImageBindReward(model=tiny_model).score(media, PROMPTS[:2])
    assert scores.shape == (2,) and torch.isfinite(scores).all()


@needs_imagebind
def test_errors(tiny_model: torch.nn.Module) -> None:
    media = _media()
    audio_only = MediaBatch(audio=media.audio, sample_rate=8000)
    video_only = MediaBatch(video=media.video, fps=4.0)
    with pytest.raises(ValueError, match="needs video"):
        ImageBindReward(model=tiny_model).score(audio_only, PROMPTS)
    with pytest.raises(ValueError, match="needs audio"):
        ImageBindReward(model=tiny_model, mode="text_audio").score(video_only, PROMPTS)
    ImageBindReward(model=tiny_model, mode="text_video").score(video_only, PROMPTS)  # audio not needed

    bad_audio = media.audio.clone()
    bad_audio[1, 0, 7] = float("nan")
    with pytest.raises(ValueError, match=r"audio has non-finite values .* samples \[1\]"):
        ImageBindReward(model=tiny_model).score(MediaBatch(media.video, bad_audio, 4.0, 8000), PROMPTS)
    bad_video = media.video.clone()
    bad_video[2, 0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"video has non-finite values .* samples \[2\]"):
        ImageBindReward(model=tiny_model, mode="text_video").score(MediaBatch(video=bad_video), PROMPTS)
    with pytest.raises(ValueError, match="2 prompts for 3"):
        ImageBindReward(model=tiny_model).score(media, PROMPTS[:2])

    with pytest.raises(ValueError, match="mode must be"):
        ImageBindReward(model=tiny_model, mode="video_text")
    with pytest.raises(ValueError, match="only apply to mode 'all'"):
        ImageBindReward(model=tiny_model, weights={"text_audio": 1.0})
    with pytest.raises(ValueError, match="unknown weights"):
        ImageBindReward(model=tiny_model, mode="all", weights={"audio_text": 1.0})
    with pytest.raises(ValueError, match="positive sum"):
        ImageBindReward(
            model=tiny_model,
            mode="all",
            weights=dict.fromkeys(("audio_video", "text_audio", "text_video"), 0.0),
        )


@needs_imagebind
def test_only_the_frames_imagebind_reads_go_to_its_device() -> None:
    """A request's frames stay where they came (a server's host memory): the 2 frames of each of
    ImageBind's 5 clips are picked there and only they are copied to the reward's device (here the
    meta device, so that the copies can be told apart), not the whole clip."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CopiesToMeta(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.elements: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("meta"):
                self.elements.append(args[0].numel())
            return func(*args, **kwargs)

    torch.manual_seed(0)
    reward = ImageBindReward(model=build_model(TINY_ARCHITECTURE), device="meta")
    media = _media(batch=2, seconds=3.0)
    media = MediaBatch(video=torch.rand(2, 48, 3, 20, 16), audio=media.audio, fps=4.0, sample_rate=8000)
    with CopiesToMeta() as copies:
        inputs = reward.inputs(media, PROMPTS[:2])
    assert inputs["vision"].device.type == "meta"
    frame = 3 * 20 * 16
    picked = 2 * reward.video_clips * reward.frames_per_clip * frame
    assert picked in copies.elements, copies.elements
    assert media.video.numel() not in copies.elements, "the whole clip went to the device"
