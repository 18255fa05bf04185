"""Clips on disk: video decoded by PyAV, sound by soundfile, at the clip format a run sets.

A clip format fixes the frame rate, the sample rate, the clip length and the channel count. Decoding
takes the clip's first `seconds`: for each frame time k / fps the last frame shown at or before it,
and the first `seconds * sample_rate` samples. Nothing is resampled: a file at another sample rate or
channel count is refused with what it has and what the run wants (convert it with ffmpeg or sox).
Every refusal is a `ClipFileError` whose message is the reason a line is skipped.

Writers (for the example set) use lossless codecs inside the usual containers: H.264 in 4:4:4 at
constant quality 0 in MP4, and 16-bit PCM in WAV. What remains is the rounding of RGB through YUV and
of samples to 16 bits (`VIDEO_TOLERANCE`, `AUDIO_TOLERANCE`, tested on the shipped set).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

VIDEO_TOLERANCE = 2 / 255
"""Largest per-pixel difference (in [0, 1]) of a frame written by `write_mp4` and decoded back."""
AUDIO_TOLERANCE = 2 / 32768
"""Largest per-sample difference of a waveform written by `write_wav` and decoded back."""
MAX_CLIP_SECONDS = 600.0
MAX_FRAME_PIXELS = 4096 * 4096
MAX_CLIP_BYTES = 256 << 20  # decoded frames of one clip (uint8), and its samples (float32)
CACHE_BYTES = 512 << 20  # decoded clips kept in memory per process, least recently used dropped first


class ClipFileError(ValueError):
    """A media file that cannot be used; the message says why."""


@dataclass(frozen=True)
class ClipFormat:
    """What a clip is for a run: `fps` frames a second and `sample_rate` samples a second, `seconds`
    long, with `channels` audio channels."""

    fps: float
    sample_rate: int
    seconds: float
    channels: int = 1

    def __post_init__(self) -> None:
        if not (self.fps > 0 and self.sample_rate > 0 and 0 < self.seconds <= MAX_CLIP_SECONDS):
            raise ValueError(
                f"clip format fps={self.fps}, sample_rate={self.sample_rate}, seconds={self.seconds}: "
                f"each must be positive, seconds at most {MAX_CLIP_SECONDS:g}"
            )
        if self.channels < 1:
            raise ValueError(f"clip format channels={self.channels}: at least 1")

    @property
    def frames(self) -> int:
        return max(1, round(self.fps * self.seconds))

    @property
    def samples(self) -> int:
        return max(1, round(self.sample_rate * self.seconds))


def _checked_file(path: Path) -> None:
    if not path.exists():
        raise ClipFileError(f"{path} does not exist")
    if not path.is_file():
        raise ClipFileError(f"{path} is not a regular file")
    if path.stat().st_size == 0:
        raise ClipFileError(f"{path} is empty (zero length)")


def _identity(path: Path) -> tuple[int, ...]:
    """What tells a file's versions apart for the cache: device, inode, size and both times."""
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class _DecodedClips:
    """Decoded media by (kind, path, file identity, format), bounded by bytes (least recently used
    dropped first): a question file's clips are decoded once while they fit."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self.items: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def get(self, key: tuple, decode: Callable[[], torch.Tensor]) -> torch.Tensor:
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        value = decode()
        size = value.numel() * value.element_size()
        if size <= self.limit:
            self.items[key] = value
            self.used += size
            while self.used > self.limit:
                _, dropped = self.items.popitem(last=False)
                self.used -= dropped.numel() * dropped.element_size()
        return value


_CACHE = _DecodedClips(CACHE_BYTES)


def decode_video(path: str | Path, clip: ClipFormat) -> torch.Tensor:
    """The clip's frames [F, 3, H, W] in [0, 1] (F = clip.frames) from a video file, via PyAV."""
    path = Path(path)
    _checked_file(path)
    key = ("video", str(path), _identity(path), clip)
    frames = _CACHE.get(key, lambda: _decode_video(str(path), clip))
    return frames.float() / 255.0


def _decode_video(path: str, clip: ClipFormat) -> torch.Tensor:
    """uint8 frames [F, 3, H, W]: for each time k / fps from the stream's first frame, the last frame
    shown at or before it."""
    import av

    wanted = [k / clip.fps for k in range(clip.frames)]
    picked: list[np.ndarray | None] = [None] * clip.frames
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise ClipFileError(f"{path} has no video stream")
            stream = container.streams.video[0]
            frame_s = 1 / float(stream.average_rate) if stream.average_rate else 1 / clip.fps
            first: float | None = None
            shown_until = -math.inf
            for index, frame in enumerate(container.decode(stream)):
                if frame.width * frame.height > MAX_FRAME_PIXELS:
                    raise ClipFileError(f"{path}: frames of {frame.width}x{frame.height} are too large")
                if clip.frames * frame.width * frame.height * 3 > MAX_CLIP_BYTES:
                    raise ClipFileError(
                        f"{path}: {clip.frames} frames of {frame.width}x{frame.height} are over "
                        f"{MAX_CLIP_BYTES >> 20} MiB; lower data.clip_fps or clip_seconds, or downscale it"
                    )
                stamp = float(frame.time) if frame.time is not None else index * frame_s
                first = stamp if first is None else first
                time = stamp - first  # a stream may start after the container's time 0
                shown_until = max(shown_until, time + frame_s)
                if time > wanted[-1] and picked[-1] is not None:
                    break
                image = frame.to_ndarray(format="rgb24")
                for k, t in enumerate(wanted):
                    if time <= t + 1e-6:  # the last frame shown at or before t
                        picked[k] = image
    except ClipFileError:
        raise
    except (av.error.FFmpegError, ValueError, OSError) as e:
        raise ClipFileError(f"{path} cannot be decoded as video ({type(e).__name__}: {e})") from e
    if picked[0] is None:
        raise ClipFileError(f"{path} has no video frames (zero length)")
    if any(p is None for p in picked) or shown_until <= wanted[-1] + 1e-6:
        shown = sum(p is not None and t < shown_until for p, t in zip(picked, wanted, strict=True))
        raise ClipFileError(
            f"{path} is too short: {shown} of the {clip.frames} frames of a {clip.seconds:g} s clip at "
            f"{clip.fps:g} fps"
        )
    return torch.from_numpy(np.stack(picked)).permute(0, 3, 1, 2).contiguous()  # type: ignore[arg-type]


def decode_audio(path: str | Path, clip: ClipFormat) -> torch.Tensor:
    """The clip's first `clip.samples` samples [C, S] in [-1, 1] from a sound file, via soundfile."""
    path = Path(path)
    _checked_file(path)
    key = ("audio", str(path), _identity(path), clip)
    return _CACHE.get(key, lambda: _decode_audio(str(path), clip)).clone()


def _decode_audio(path: str, clip: ClipFormat) -> torch.Tensor:
    import soundfile

    if clip.samples * clip.channels * 4 > MAX_CLIP_BYTES:
        raise ClipFileError(
            f"{clip.samples} samples of {clip.channels} channels are over {MAX_CLIP_BYTES >> 20} MiB"
        )
    try:
        with soundfile.SoundFile(path) as f:
            if f.samplerate != clip.sample_rate:
                raise ClipFileError(
                    f"{path} is at {f.samplerate} Hz; the run reads {clip.sample_rate} Hz "
                    "(data.clip_sample_rate), resample it (e.g. ffmpeg -ar)"
                )
            if f.channels != clip.channels:
                raise ClipFileError(
                    f"{path} has {f.channels} channels; the run reads {clip.channels} (data.clip_channels)"
                )
            if f.frames == 0:
                raise ClipFileError(f"{path} has no samples (zero length)")
            data = f.read(frames=clip.samples, dtype="float32", always_2d=True)
    except ClipFileError:
        raise
    except (soundfile.LibsndfileError, RuntimeError, ValueError, OSError) as e:
        raise ClipFileError(f"{path} cannot be decoded as sound ({type(e).__name__}: {e})") from e
    if len(data) < clip.samples:
        raise ClipFileError(
            f"{path} is too short: {len(data)} samples of the {clip.samples} of a {clip.seconds:g} s clip "
            f"at {clip.sample_rate} Hz"
        )
    if not np.isfinite(data).all():
        raise ClipFileError(f"{path} has samples that are not finite numbers (NaN or infinity)")
    peak = float(np.abs(data).max())
    if peak > 1.0:
        raise ClipFileError(f"{path} has samples outside [-1, 1] (peak {peak:.3g}); normalise it")
    return torch.from_numpy(np.ascontiguousarray(data.T))


def write_mp4(path: str | Path, frames: torch.Tensor, fps: float) -> None:
    """Frames [F, 3, H, W] in [0, 1] as lossless H.264 (4:4:4, constant quality 0) in an MP4."""
    import av

    if frames.ndim != 4 or frames.shape[1] != 3:
        raise ValueError(f"frames must be [F, 3, H, W]; got {tuple(frames.shape)}")
    rgb = (frames.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=round(fps))
        stream.width, stream.height = int(rgb.shape[2]), int(rgb.shape[1])
        stream.pix_fmt = "yuv444p"
        stream.options = {"crf": "0", "preset": "medium"}
        for image in rgb:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode(None))


def write_wav(path: str | Path, wave: torch.Tensor, sample_rate: int) -> None:
    """A waveform [C, S] in [-1, 1] as 16-bit PCM WAV."""
    import soundfile

    if wave.ndim != 2:
        raise ValueError(f"wave must be [C, S]; got {tuple(wave.shape)}")
    soundfile.write(str(path), wave.clamp(-1, 1).T.numpy(), sample_rate, subtype="PCM_16", format="WAV")
