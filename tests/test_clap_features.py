"""The batched torch CLAP front end gives the transformers extractor's features, for every padding case."""

from __future__ import annotations

import pytest
import torch
from transformers import ClapFeatureExtractor

from rewards.clap_features import clap_input_features, repeat_pad


def _extractor() -> ClapFeatureExtractor:
    return ClapFeatureExtractor(
        feature_size=16, sampling_rate=48_000, hop_length=480, max_length_s=1, fft_window_size=1024
    )


@pytest.mark.parametrize("fusion", [False, True])
@pytest.mark.parametrize("samples", [48_000, 30_001, 7_000, 480])
def test_matches_the_transformers_extractor(samples: int, fusion: bool) -> None:
    extractor = _extractor()
    gen = torch.Generator().manual_seed(samples)
    audio = 0.5 * torch.randn((3, samples), generator=gen, dtype=torch.float64)
    expected = extractor(
        list(audio.numpy()),
        sampling_rate=48_000,
        truncation="fusion" if fusion else "rand_trunc",
        padding="repeatpad",
        return_tensors="pt",
    )["input_features"]
    ours = clap_input_features(audio, extractor, fusion)
    assert ours.shape == expected.shape and ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected.float(), rtol=1e-5, atol=2e-4)


def test_repeat_pad_tiles_whole_copies_then_zeros() -> None:
    out = repeat_pad(torch.tensor([[1.0, 2.0, 3.0]]), 8)
    assert out.tolist() == [[1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 0.0, 0.0]]
    assert torch.equal(repeat_pad(torch.ones(1, 3), 2), torch.ones(1, 3))
    with pytest.raises(ValueError, match="empty"):
        repeat_pad(torch.zeros(1, 0), 2)
