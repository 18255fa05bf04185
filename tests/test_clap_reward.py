"""The CLAP reward: the transformers backend on a tiny random-init ClapModel saved offline with its processor,
and the laion_clap backend's glue on a test double of the laion-clap model object."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import BPE
from transformers import (
    ClapFeatureExtractor,
    ClapModel,
    ClapProcessor,
    PreTrainedTokenizerFast,
    RobertaTokenizerFast,
)

from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.registry import rewards
from rewards.clap import ClapReward, int16_round_trip, repeat_pad, resample
from rewards.tiny_models import save_tiny_clap, tiny_clap_parts

PROMPTS = ["a dog barks", "rain on a window", "a violin plays a song"]


def _feature_extractor() -> ClapFeatureExtractor:
    return tiny_clap_parts()[1].feature_extractor


def _tokenizer() -> RobertaTokenizerFast:
    return tiny_clap_parts()[1].tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("clap")
    return save_tiny_clap(path)


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
    clap = combined.components["clap"]
    assert isinstance(clap, ClapReward) and clap.backend == "transformers"
    scores = clap.score(MediaBatch(audio=_noise(2, 0.5), sample_rate=8000), ["a dog barks", "rain"])
    assert scores.shape == (2,) and torch.isfinite(scores).all()


# ---------------------------------------------------------------- laion_clap backend

WINDOW = 480_000  # laion-clap's 10 s window at 48 kHz


class LaionModelDouble(torch.nn.Module):
    """Test double for the laion_clap.CLAP_Module object only.

    laion_clap cannot be installed next to the CPU torch (it imports torchvision and loads tokenizers from
    the hub), so this small real torch module stands in for the model object the backend is given: it has
    CLAP_Module's two embedding methods with the same signatures, computes embeddings with real layers over
    the real tensors it receives, and records those inputs. Everything else (preprocessing, the calls, the
    cosine) is the reward's own code. Unlike laion-clap's, its embeddings are not unit length, so the tests
    also see the reward normalise them.
    """

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.audio_proj = torch.nn.Linear(64, dim)
        self.text_table = torch.nn.EmbeddingBag(256, dim, mode="sum")
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=gen))
        self.audio_inputs: list[torch.Tensor] = []
        self.text_inputs: list[list[str]] = []
        self.use_tensor: list[bool] = []

    def get_audio_embedding_from_data(self, x: torch.Tensor, use_tensor: bool = False) -> Any:
        """Projected log energies of 64 equal frames of each clip: [N, dim]."""
        self.audio_inputs.append(x.detach().clone())
        self.use_tensor.append(use_tensor)
        energies = x.reshape(len(x), 64, -1).pow(2).mean(-1)
        emb = self.audio_proj(torch.log1p(1e3 * energies))
        return emb if use_tensor else emb.detach().cpu().numpy()

    def get_text_embedding(self, x: list[str], tokenizer: Any = None, use_tensor: bool = False) -> Any:
        """Sum of learned byte embeddings of each text: [N, dim]."""
        self.text_inputs.append(list(x))
        self.use_tensor.append(use_tensor)
        ids = [torch.tensor(list(text.encode()), dtype=torch.long) for text in x]
        offsets = torch.tensor([0] + [len(i) for i in ids[:-1]]).cumsum(0)
        emb = self.text_table(torch.cat(ids), offsets)
        return emb if use_tensor else emb.detach().cpu().numpy()


def _laion(**kwargs: Any) -> tuple[ClapReward, LaionModelDouble]:
    double = LaionModelDouble()
    return ClapReward(backend="laion_clap", model=double, **kwargs), double


def _quantised(batch: int, channels: int, samples: int, seed: int) -> torch.Tensor:
    """Random int16 levels k / 32767, which laion-clap's int16 round trip leaves unchanged."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-20_000, 20_001, (batch, channels, samples), generator=gen).float() / 32767


def test_laion_feeds_48k_repeat_padded_windows() -> None:
    reward, double = _laion()
    stereo = torch.cat([_noise(3, 1.3, seed=7), _noise(3, 1.3, seed=8)], dim=1)
    scores = reward.score(MediaBatch(audio=stereo, sample_rate=8000), PROMPTS)
    assert scores.shape == (3,) and scores.dtype == torch.float32
    x = double.audio_inputs[-1]
    assert x.shape == (3, WINDOW) and x.dtype == torch.float32 and x.device.type == "cpu"
    assert double.use_tensor == [True, True] and double.text_inputs == [PROMPTS]
    # 1.3 s at 8 kHz -> 62_400 samples at 48 kHz, repeated 7 times whole, then zeros to 480_000.
    mono = (stereo[:, 0].double() + stereo[:, 1].double()) / 2
    clip = int16_round_trip(resample(mono, 8000, 48_000))
    assert clip.shape == (3, 62_400)
    for k in range(7):
        assert torch.equal(x[:, k * 62_400 : (k + 1) * 62_400], clip)
    assert torch.equal(x[:, 7 * 62_400 :], torch.zeros(3, WINDOW - 7 * 62_400))


def test_laion_centre_crops_long_clips() -> None:
    reward, double = _laion()
    clip = _quantised(2, 1, 600_000, seed=9)  # 12.5 s at 48 kHz: the centre 10 s start at 60_000
    reward.score(MediaBatch(audio=clip, sample_rate=48_000), PROMPTS[:2])
    assert torch.equal(double.audio_inputs[-1], clip[:, 0, 60_000:540_000])
    exact = _quantised(2, 1, WINDOW, seed=10)
    reward.score(MediaBatch(audio=exact, sample_rate=48_000), PROMPTS[:2])
    assert torch.equal(double.audio_inputs[-1], exact[:, 0])


def test_laion_max_seconds() -> None:
    reward, double = _laion(max_seconds=0.7)
    clip = _quantised(1, 1, 48_000, seed=11)
    reward.score(MediaBatch(audio=clip, sample_rate=48_000), PROMPTS[:1])
    centre = clip[0, 0, 7_200:40_800]  # 33_600 samples, repeated 14 times whole
    assert torch.equal(double.audio_inputs[-1][0], repeat_pad(centre, WINDOW))
    assert torch.equal(double.audio_inputs[-1][0, : 14 * 33_600], centre.repeat(14))
    assert not double.audio_inputs[-1][0, 14 * 33_600 :].any()
    with pytest.raises(ValueError, match="max_seconds"):
        _laion(max_seconds=10.5)


def test_laion_int16_round_trip() -> None:
    values = torch.tensor([[[0.5, -0.5, 1.5, -2.0, 1e-5, 0.123456, -0.987654]]])
    # laion-clap's numpy quantisation (training/data.py float32_to_int16 / int16_to_float32), here in numpy.
    ints = (np.clip(values.numpy()[0, 0], -1.0, 1.0) * 32767.0).astype(np.int16)
    expected = torch.from_numpy((ints / 32767.0).astype(np.float32))
    for quantize, want in ((None, expected), (True, expected), (False, values[0, 0])):
        reward, double = _laion(quantize=quantize)
        reward.score(MediaBatch(audio=values, sample_rate=48_000), PROMPTS[:1])
        assert torch.equal(double.audio_inputs[-1][0, :7], want)


def test_laion_cosine_matches_hand_computation() -> None:
    reward, double = _laion()
    media = MediaBatch(audio=_noise(3, 0.5, seed=12), sample_rate=16_000)
    scores = reward.score(media, PROMPTS)
    with torch.no_grad():
        audio = double.get_audio_embedding_from_data(x=double.audio_inputs[-1], use_tensor=True)
        text = double.get_text_embedding(PROMPTS, use_tensor=True)
    assert not torch.allclose(audio.norm(dim=-1), torch.ones(3))  # the reward must normalise
    expected = torch.stack(
        [torch.dot(a, t) / (a.norm() * t.norm()) for a, t in zip(audio, text, strict=True)]
    )
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(scores, reward.score(media, PROMPTS))
    assert torch.equal(scores, _laion()[0].score(media, PROMPTS))
    swapped = reward.score(media, PROMPTS[::-1])
    assert swapped[0] != scores[0] and swapped[1] == scores[1]


def test_laion_bad_inputs_raise() -> None:
    reward, _ = _laion()
    with pytest.raises(ValueError, match="'clap' needs audio"):
        reward.score(MediaBatch(video=torch.zeros(3, 1, 3, 4, 4)), PROMPTS)
    with pytest.raises(ValueError, match="2 prompts for 3"):
        reward.score(MediaBatch(audio=_noise(3, 0.2), sample_rate=8000), PROMPTS[:2])
    with pytest.raises(NotImplementedError, match="get_text_embedding"):
        reward.tokenize(PROMPTS)


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="unknown backend 'laion'.*'transformers', 'laion_clap'"):
        ClapReward(backend="laion", checkpoint="/models/630k-best.pt")


def test_laion_configuration_errors(tmp_path: Path, checkpoint: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.pt' does not exist"):
        ClapReward(backend="laion_clap", checkpoint=tmp_path / "missing.pt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        rewards.create("clap", backend="laion_clap", checkpoint=str(tmp_path / "missing.pt"))
    with pytest.raises(ValueError, match="exactly one of checkpoint= .* or model="):
        ClapReward(backend="laion_clap")
    with pytest.raises(ValueError, match="exactly one of"):
        ClapReward(backend="laion_clap", model=LaionModelDouble(), checkpoint=tmp_path / "x.pt")
    with pytest.raises(ValueError, match="tmodel"):
        ClapReward(backend="laion_clap", model=LaionModelDouble(), tmodel="bert")
    with pytest.raises(ValueError, match="processor= is for backend='transformers'"):
        ClapReward(backend="laion_clap", model=LaionModelDouble(), processor=object())
    with pytest.raises(ValueError, match="enable_fusion must be true or false; got 'false'"):
        ClapReward(backend="laion_clap", model=LaionModelDouble(), enable_fusion="false")
    with pytest.raises(TypeError, match="get_text_embedding"):
        ClapReward(backend="laion_clap", model=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="enable_fusion, quantize only apply to backend='laion_clap'"):
        ClapReward(checkpoint=checkpoint, enable_fusion=True, quantize=False)


def _assert_install_hint(message: str) -> None:
    for text in ("'laion_clap'", "pip install laion-clap==1.1.7", "torchvision", "HF_HUB_OFFLINE", "cache"):
        assert text in message
    assert "backend='transformers'" in message


def test_laion_missing_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = tmp_path / "630k-best.pt"
    ckpt.write_bytes(b"")
    monkeypatch.setitem(sys.modules, "laion_clap", None)  # absent, also where it happens to be installed
    with pytest.raises(ImportError) as info:
        ClapReward(backend="laion_clap", checkpoint=ckpt)
    _assert_install_hint(str(info.value))
    assert isinstance(info.value.__cause__, ImportError)


def test_laion_package_that_fails_to_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = tmp_path / "630k-best.pt"
    ckpt.write_bytes(b"")
    package = tmp_path / "site" / "laion_clap"
    package.mkdir(parents=True)
    # What `import torchvision` raises next to a torch it was not built for.
    (package / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    monkeypatch.delitem(sys.modules, "laion_clap", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(ImportError, match="torchvision::nms") as info:
        ClapReward(backend="laion_clap", checkpoint=ckpt)
    _assert_install_hint(str(info.value))
    assert "laion_clap" not in sys.modules


def test_laion_tokenizer_check() -> None:
    from rewards.clap import _check_laion_tokenizer

    _check_laion_tokenizer(_tokenizer())
    # What an uncached tokenizer loads as with HF_HUB_OFFLINE=1: special tokens only.
    empty = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(BPE()), unk_token="<unk>", pad_token="<pad>")
    for tokenizer in (empty, None):
        with pytest.raises(OSError, match="tokenizer is missing or empty"):
            _check_laion_tokenizer(tokenizer)
