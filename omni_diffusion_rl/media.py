"""Generated media: a batch of video frames and audio waveforms with their rates."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MediaBatch:
    """What a policy decodes to and what rewards score.

    video: [B, F, 3, H, W] floats in [0, 1] (a still image is F = 1), or None.
    audio: [B, C, S] floats in [-1, 1], or None.
    """

    video: torch.Tensor | None = None
    audio: torch.Tensor | None = None
    fps: float = 8.0
    sample_rate: int = 8000

    def __post_init__(self) -> None:
        if self.video is None and self.audio is None:
            raise ValueError("MediaBatch needs video, audio or both; got neither")
        if self.video is not None and self.video.ndim != 5:
            raise ValueError(f"video must be [B, F, 3, H, W]; got shape {tuple(self.video.shape)}")
        if self.audio is not None and self.audio.ndim != 3:
            raise ValueError(f"audio must be [B, C, S]; got shape {tuple(self.audio.shape)}")
        if self.video is not None and self.audio is not None and len(self.video) != len(self.audio):
            raise ValueError(f"video batch {len(self.video)} != audio batch {len(self.audio)}")

    def __len__(self) -> int:
        return len(self.video) if self.video is not None else len(self.audio)  # type: ignore[arg-type]

    def select(self, index: torch.Tensor | slice | list[int]) -> MediaBatch:
        """The sub-batch at `index`."""
        return MediaBatch(
            video=None if self.video is None else self.video[index],
            audio=None if self.audio is None else self.audio[index],
            fps=self.fps,
            sample_rate=self.sample_rate,
        )
