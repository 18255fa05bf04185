"""CLAP's audio front end as batched torch ops: the same log-mel features as transformers'
`ClapFeatureExtractor` (repeat-pad, Hann STFT, power 2, mel filters, dB), for a whole batch at once.

The extractor computes each clip with numpy in a Python loop; on a reward server that batches
requests this loop, not the model, dominates (about 3.5 ms per 1 s clip on one CPU core).
"""

from __future__ import annotations

from typing import Any

import torch

MEL_FLOOR = 1e-10  # the extractor's floor before the log


def repeat_pad(audio: torch.Tensor, length: int) -> torch.Tensor:
    """CLAP's "repeatpad" of [..., S] to `length`: whole repeats, then zeros (unchanged when S >= length).

    Both laion-clap's `get_audio_features` and transformers' `ClapFeatureExtractor` pad this way.
    """
    samples = audio.shape[-1]
    if samples == 0:
        raise ValueError("repeat_pad: the clips are empty (0 samples)")
    if samples >= length:
        return audio
    tiled = audio.repeat(*([1] * (audio.dim() - 1)), length // samples)
    return torch.nn.functional.pad(tiled, (0, length - tiled.shape[-1]))


def log_mel_db(audio: torch.Tensor, n_fft: int, hop_length: int, mel_filters: torch.Tensor) -> torch.Tensor:
    """[B, L] -> [B, frames, mels]: 10 log10(max(mel power, 1e-10)) of a centred, reflect-padded Hann STFT."""
    window = torch.hann_window(n_fft, periodic=True, dtype=audio.dtype, device=audio.device)
    stft = torch.stft(
        audio, n_fft, hop_length, window=window, center=True, pad_mode="reflect", return_complex=True
    )
    power = stft.abs().square()  # [B, freqs, frames]
    mel = torch.einsum("fm,bft->btm", mel_filters.to(power), power)
    return 10.0 * torch.log10(mel.clamp_min(MEL_FLOOR))


def clap_input_features(audio: torch.Tensor, feature_extractor: Any, fusion: bool) -> torch.Tensor:
    """Model input [B, 1, frames, mels] (4 copies for fusion models), float32, as
    `feature_extractor(..., padding="repeatpad")` gives it, for clips no longer than its window."""
    # float32 STFT: twice as fast as the extractor's float64, within 1e-3 dB of it (tested).
    x = repeat_pad(audio.to(torch.float32), int(feature_extractor.nb_max_samples))
    filters = feature_extractor.mel_filters if fusion else feature_extractor.mel_filters_slaney
    mel = log_mel_db(
        x,
        int(feature_extractor.fft_window_size),
        int(feature_extractor.hop_length),
        torch.as_tensor(filters, dtype=torch.float32),
    )
    return mel.unsqueeze(1).expand(-1, 4 if fusion else 1, -1, -1).float().contiguous()
