"""The CLAP reward on a tiny random-init ClapModel saved offline with its processor."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tokenizers import ByteLevelBPETokenizer, Tokenizer
from tokenizers.models import BPE
from transformers import (
    ClapConfig,
    ClapFeatureExtractor,
    ClapModel,
    ClapProcessor,
    PreTrainedTokenizerFast,
    RobertaTokenizerFast,
)

from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.registry import rewards
from rewards.clap import ClapReward, resample

PROMPTS = ["a dog barks", "rain on a window", "a violin plays a song"]
CORPUS = PROMPTS + ["birds sing in the morning", "a car engine starts", "people talk in a room"]
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def _feature_extractor() -> ClapFeatureExtractor:
    # 1 s window at 48 kHz, hop 480 -> 101 mel frames of 16 bins; fits spec_size 64 (width 256, height 16).
    return ClapFeatureExtractor(
        feature_size=16, sampling_rate=48_000, hop_length=480, max_length_s=1, fft_window_size=1024
    )


def _tokenizer() -> RobertaTokenizerFast:
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 4, vocab_size=300, min_frequency=1, special_tokens=SPECIALS)
    return RobertaTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        cls_token="<s>",
        sep_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
        model_max_length=32,
    )


def _model(vocab_size: int, pad_token_id: int) -> ClapModel:
    text = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=40,
        pad_token_id=pad_token_id,
    )
    audio = dict(
        num_mel_bins=16,
        spec_size=64,
        window_size=4,
        depths=[1, 1],
        num_attention_heads=[2, 2],
        patch_embeds_hidden_size=16,
        hidden_size=32,
    )
    torch.manual_seed(0)
    return ClapModel(ClapConfig(text_config=text, audio_config=audio, projection_dim=16)).eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("clap")
    tokenizer = _tokenizer()
    _model(len(tokenizer), tokenizer.pad_token_id).save_pretrained(path)
    ClapProcessor(feature_extractor=_feature_extractor(), tokenizer=tokenizer).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reward(checkpoint: Path) -> ClapReward:
    return ClapReward(checkpoint=str(checkpoint))


def _noise(batch: int, seconds: float, rate: int = 8000, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (0.3 * torch.randn(batch, 1, round(seconds * rate), generator=gen)).clamp(-1, 1)


def test_scores_a_batch(reward: ClapReward) -> None:
    scores = reward.score(MediaBatch(audio=_noise(3, 1.0), sample_rate=8000), PROMPTS)
    assert scores.shape == (3,) and scores.dtype == torch.float32
    assert torch.isfinite(scores).all() and scores.abs().max() <= 1.0


def test_deterministic(reward: ClapReward, checkpoint: Path) -> None:
    stereo = torch.cat([_noise(3, 0.7, seed=1), _noise(3, 0.7, seed=2)], dim=1)
    media = MediaBatch(audio=stereo, sample_rate=8000)
    first = reward.score(media, PROMPTS)
    assert torch.equal(first, reward.score(media, PROMPTS))
    assert torch.equal(first, ClapReward(checkpoint=checkpoint).score(media, PROMPTS))


def test_short_and_long_clips(reward: ClapReward) -> None:
    short = reward.score(MediaBatch(audio=_noise(3, 0.2), sample_rate=8000), PROMPTS)
    long = reward.score(MediaBatch(audio=_noise(3, 3.0), sample_rate=8000), PROMPTS)
    assert torch.isfinite(short).all() and torch.isfinite(long).all()
    # A clip longer than the 1 s window is scored on its centre second.
    clip = _noise(3, 2.5, rate=48_000, seed=3)
    centre = clip[..., 36_000:84_000]
    whole = reward.score(MediaBatch(audio=clip, sample_rate=48_000), PROMPTS)
    assert torch.equal(whole, reward.score(MediaBatch(audio=centre, sample_rate=48_000), PROMPTS))


def test_matches_hand_computation(reward: ClapReward) -> None:
    media = MediaBatch(audio=_noise(3, 0.5, seed=4), sample_rate=8000)
    with torch.no_grad():
        audio = reward.model.get_audio_features(**reward.preprocess(media)).pooler_output
        text = reward.model.get_text_features(**reward.tokenize(PROMPTS)).pooler_output
    audio = audio / audio.norm(dim=-1, keepdim=True)
    text = text / text.norm(dim=-1, keepdim=True)
    expected = torch.stack([torch.dot(a, t) for a, t in zip(audio, text, strict=True)])
    torch.testing.assert_close(reward.score(media, PROMPTS), expected, rtol=1e-5, atol=1e-6)


def test_prompt_changes_score(reward: ClapReward) -> None:
    clip = _noise(1, 0.5, seed=5)
    media = MediaBatch(audio=torch.cat([clip, clip]), sample_rate=8000)
    scores = reward.score(media, ["a dog barks", "a violin plays a song"])
    assert scores[0] != scores[1]


def test_bad_audio_raises(reward: ClapReward) -> None:
    with pytest.raises(ValueError, match="'clap' needs audio"):
        reward.score(MediaBatch(video=torch.zeros(3, 1, 3, 4, 4)), PROMPTS)
    audio = _noise(3, 0.5)
    audio[1, 0, 10] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        reward.score(MediaBatch(audio=audio, sample_rate=8000), PROMPTS)


def test_configuration_errors(tmp_path: Path, checkpoint: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ClapReward(checkpoint=tmp_path / "missing")
    with pytest.raises(ValueError, match="checkpoint"):
        rewards.create("clap")
    with pytest.raises(ValueError, match="max_seconds"):
        ClapReward(checkpoint=checkpoint, max_seconds=5.0)
    empty = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(BPE()))
    processor = ClapProcessor(feature_extractor=_feature_extractor(), tokenizer=empty)
    with pytest.raises(ValueError, match="empty vocabulary"):
        ClapReward(model=ClapModel.from_pretrained(checkpoint), processor=processor)


def test_max_seconds_crops(checkpoint: Path) -> None:
    half = ClapReward(checkpoint=checkpoint, max_seconds=0.5)
    clip = _noise(3, 1.0, rate=48_000, seed=6)
    cropped = MediaBatch(audio=clip[..., 12_000:36_000], sample_rate=48_000)
    assert torch.equal(
        half.score(MediaBatch(audio=clip, sample_rate=48_000), PROMPTS), half.score(cropped, PROMPTS)
    )


def test_entry_point_listed() -> None:
    assert "clap" in rewards.names()
    assert rewards.get("clap") is ClapReward


@pytest.mark.parametrize(
    ("orig", "new", "freq"), [(8000, 48_000, 440.0), (48_000, 16_000, 1000.0), (44_100, 48_000, 3000.0)]
)
def test_resampler_keeps_frequency(orig: int, new: int, freq: float) -> None:
    seconds = 1.0
    t = torch.arange(round(orig * seconds), dtype=torch.float64) / orig
    out = resample(torch.sin(2 * math.pi * freq * t)[None], orig, new)[0]
    assert out.shape[-1] == math.ceil(orig * seconds * new / orig)
    spectrum = torch.fft.rfft(out * torch.hann_window(len(out), dtype=torch.float64)).abs()
    freqs = torch.fft.rfftfreq(len(out), d=1.0 / new)
    assert abs(freqs[spectrum.argmax()].item() - freq) <= 1.0
    # Away from the edges the amplitude is kept.
    middle = out[len(out) // 4 : 3 * len(out) // 4]
    assert abs(middle.abs().max().item() - 1.0) < 0.02


def test_configured_from_a_config_file(checkpoint: Path, tmp_path: Path) -> None:
    from omni_diffusion_rl.config import load_config
    from omni_diffusion_rl.media import MediaBatch
    from omni_diffusion_rl.reward import WeightedReward

    path = tmp_path / "reward.yaml"
    path.write_text(
        f"reward:\n  weights: {{clap: 1.0}}\n  options: {{clap: {{checkpoint: '{checkpoint}'}}}}\n"
    )
    cfg = load_config(path)
    combined = WeightedReward.from_registry(cfg.reward.weights, cfg.reward.options)
    total, parts = combined(MediaBatch(audio=_noise(2, 0.5), sample_rate=8000), ["a dog barks", "rain"])
    assert torch.equal(total, parts["clap"]) and total.shape == (2,)
