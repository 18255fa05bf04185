"""Clips on disk: video decoded by PyAV, sound by soundfile, at the clip format a run sets.

A clip format fixes the frame rate, the sample rate, the clip length and the channel count, and
the frame size a model reads when it has one. Decoding takes the clip's first `seconds`: for each
frame time k / fps the last frame shown at or before it, and the first `seconds * sample_rate`
samples. Frames are resized to the format's frame size as they are decoded, one at a time
(antialiased, bilinear or as the model resizes: `resample`, bicubic for Qwen's processor; a frame
larger than it is resized as bytes, never as a full-size float copy), so what a clip holds in
memory is bounded by the model's size, whatever the file's. The work is bounded too: a stream
holding frames faster than MAX_SOURCE_FPS (a frame-count bomb) is refused as soon as it is seen, as
is a clip taking over MAX_DECODE_S to decode, and a refused file is refused again at once for as
long as it is unchanged. Nothing is resampled in time: a file at another sample rate or channel
count is refused with what it has and what the run wants (convert it with ffmpeg or sox). Every
refusal is a `ClipFileError` whose message is the reason a line is skipped.

Writers (for the example set) use lossless codecs inside the usual containers: H.264 in 4:4:4 at
constant quality 0 in MP4, and 16-bit PCM in WAV. What remains is the rounding of RGB through YUV and
of samples to 16 bits (`VIDEO_TOLERANCE`, `AUDIO_TOLERANCE`, tested on the shipped set).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
CACHE_ITEMS = 65536  # and at most this many (a checked file's entry holds no pixels)
MAX_SOURCE_FPS = 240.0  # frames a second a video file may hold (more: a frame-count bomb)
FRAME_BURST = 8  # frames a stream may hold at once beyond that rate (its first frames may share a time)
MAX_DECODE_S = 60.0  # seconds of decoding one clip may take
MAX_REMEMBERED = 4096  # refused files remembered per process


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
    frame_size: tuple[int, int] | None = None  # (height, width) frames are decoded to; None: the file's
    resample: str = "bilinear"  # how a frame is resized to frame_size (antialiased): the model's own way

    def __post_init__(self) -> None:
        if not (self.fps > 0 and self.sample_rate > 0 and 0 < self.seconds <= MAX_CLIP_SECONDS):
            raise ValueError(
                f"clip format fps={self.fps}, sample_rate={self.sample_rate}, seconds={self.seconds}: "
                f"each must be positive, seconds at most {MAX_CLIP_SECONDS:g}"
            )
        if self.channels < 1:
            raise ValueError(f"clip format channels={self.channels}: at least 1")
        if self.frame_size is not None and not (
            len(self.frame_size) == 2 and all(0 < side <= 4096 for side in self.frame_size)
        ):
            raise ValueError(f"clip format frame_size={self.frame_size}: (height, width), each 1 to 4096")
        if self.resample not in ("bilinear", "bicubic"):
            raise ValueError(f"clip format resample={self.resample!r}: bilinear or bicubic")

    def timing(self) -> tuple[float, int, float, int]:
        """What a clip's timing is (rates, length, channels), whatever size its frames are read at."""
        return (self.fps, self.sample_rate, self.seconds, self.channels)

    @property
    def frames(self) -> int:
        return max(1, round(self.fps * self.seconds))

    @property
    def samples(self) -> int:
        return max(1, round(self.sample_rate * self.seconds))


def width_by_height(text: str, what: str) -> tuple[int, int]:
    """(height, width) of a frame size written WIDTHxHEIGHT ("84x56"), as video sizes are; a
    ValueError naming `what` otherwise."""
    width, _, height = text.lower().partition("x")
    if not (width.isdigit() and height.isdigit()):
        raise ValueError(f"{what} {text!r}: give WIDTHxHEIGHT in pixels, e.g. 84x56")
    return int(height), int(width)


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
    """Decoded media by (kind, path, file identity, format), bounded by bytes and by entries (least
    recently used dropped first): a question file's clips are decoded once while they fit."""

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
            while self.used > self.limit or len(self.items) > CACHE_ITEMS:
                _, dropped = self.items.popitem(last=False)
                self.used -= dropped.numel() * dropped.element_size()
        return value


_CACHE = _DecodedClips(CACHE_BYTES)
_CHECKED = torch.empty(0, dtype=torch.uint8)  # what a frame is when a file is only checked
_REFUSED: OrderedDict[tuple, str] = OrderedDict()  # a refused file's key -> why (the newest kept)


def _remembered(file: tuple, size: object, decode: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`decode()` through the cache, keyed by `file` (kind, path, identity, timing) and the frame
    `size` (or "checked"); a file refused before is refused again at once with the same reason, at
    any size, while it is unchanged (its identity is in the key)."""
    refused = _REFUSED.get(file)
    if refused is not None:
        raise ClipFileError(refused)
    try:
        return _CACHE.get((*file, size), decode)
    except ClipFileError as e:
        _REFUSED[file] = str(e)
        while len(_REFUSED) > MAX_REMEMBERED:
            _REFUSED.popitem(last=False)
        raise


def decode_video(path: str | Path, clip: ClipFormat) -> torch.Tensor:
    """The clip's frames [F, 3, H, W] in [0, 1] (F = clip.frames; H, W: clip.frame_size when set)
    from a video file, via PyAV."""
    path = Path(path)
    _checked_file(path)
    file = ("video", str(path), _identity(path), clip.timing())
    frames = _remembered(file, (clip.frame_size, clip.resample), lambda: _decode_video(str(path), clip))
    return frames.float() / 255.0 if frames.dtype == torch.uint8 else frames.clone()


def check_video(path: str | Path, clip: ClipFormat) -> None:
    """Everything `decode_video` checks of a video file at `clip`'s timing (a ClipFileError says
    why it cannot be used, remembered as decode_video's refusals are), with no frame converted or
    kept: what checking a file holds is the decoder's own buffers, whatever its frames' size."""
    path = Path(path)
    _checked_file(path)
    file = ("video", str(path), _identity(path), clip.timing())
    _remembered(file, "checked", lambda: _decode_video(str(path), clip, convert=False))


def _resized(image: np.ndarray, size: tuple[int, int] | None, mode: str = "bilinear") -> torch.Tensor:
    """One decoded frame [3, H, W] at `size` (antialiased `mode`): uint8 when it is the file's size
    or smaller (a large frame is resized as bytes, never as a float copy), float32 in [0, 1] when it
    is enlarged (computed from the small frame, as the models resize)."""
    frame = torch.from_numpy(image).permute(2, 0, 1)
    if size is None or tuple(frame.shape[-2:]) == size:
        return frame.contiguous()
    shrink = frame.shape[-2] >= size[0] and frame.shape[-1] >= size[1]
    source = frame[None] if shrink else frame[None].float() / 255.0
    resized = torch.nn.functional.interpolate(source, size, mode=mode, antialias=True)[0]
    return resized if shrink else resized.clamp(0, 1)  # bicubic overshoots


def _decode_video(path: str, clip: ClipFormat, convert: bool = True) -> torch.Tensor:
    """Frames [F, 3, H, W] (uint8, or float32 in [0, 1] when enlarged): for each time k / fps from the
    stream's first frame, the last frame shown at or before it. A frame is converted and resized only
    when it is the one shown at some wanted time (a source faster than the clip skips the rest), and
    not at all without `convert` (the file only checked: an empty tensor is returned)."""
    import av

    wanted = [k / clip.fps for k in range(clip.frames)]
    picked: list[torch.Tensor | None] = [None] * clip.frames
    deadline = time.monotonic() + MAX_DECODE_S

    def settle(frame: Any, shown_from: float, shown_to: float) -> None:
        """`frame` (shown from `shown_from` until the next one) becomes the picked frame of every
        wanted time in that span."""
        slots = [k for k, t in enumerate(wanted) if shown_from <= t + 1e-6 < shown_to]
        if slots:
            if convert:
                image = _resized(frame.to_ndarray(format="rgb24"), clip.frame_size, clip.resample)
            else:  # no pixels: the size alone, so that a size change is found as decoding finds it
                image = torch.empty((0, *(clip.frame_size or (frame.height, frame.width))), dtype=torch.uint8)
            for k in slots:
                picked[k] = image

    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise ClipFileError(f"{path} has no video stream")
            stream = container.streams.video[0]
            frame_s = 1 / float(stream.average_rate) if stream.average_rate else 1 / clip.fps
            first: float | None = None
            shown_until = -math.inf
            pending: tuple[Any, float] | None = None
            for index, frame in enumerate(container.decode(stream)):
                _check_frame(path, clip, frame)
                stamp = float(frame.time) if frame.time is not None else index * frame_s
                first = stamp if first is None else first
                at = stamp - first  # a stream may start after the container's time 0
                if index + 1 > FRAME_BURST + MAX_SOURCE_FPS * max(at, 0.0):
                    raise ClipFileError(
                        f"{path} holds {index + 1} frames in its first {at:.3g} s, more than "
                        f"{MAX_SOURCE_FPS:g} a second: re-encode it at a usual frame rate"
                    )
                if time.monotonic() > deadline:
                    raise ClipFileError(
                        f"{path} took over {MAX_DECODE_S:g} s to decode ({index + 1} frames): shorten or "
                        "downscale it"
                    )
                shown_until = max(shown_until, at + frame_s)
                if pending is not None:
                    settle(*pending, at)
                if at > wanted[-1] and picked[-1] is not None:
                    pending = None
                    break
                pending = (frame, at)
            if pending is not None:
                settle(*pending, math.inf)
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
    frames = [p for p in picked if p is not None]
    if len({tuple(f.shape[-2:]) for f in frames}) > 1:
        raise ClipFileError(f"{path} changes its frame size within the clip; re-encode it at one size")
    if not convert:
        return _CHECKED
    if any(f.dtype != torch.uint8 for f in frames):
        frames = [f if f.dtype != torch.uint8 else f.float() / 255.0 for f in frames]
    return torch.stack(frames)


def _check_frame(path: str, clip: ClipFormat, frame: Any) -> None:
    """A decoded frame within the pixel bound, and the clip it makes within the byte bound (at the
    format's frame size, or the file's when it has none)."""
    if frame.width * frame.height > MAX_FRAME_PIXELS:
        raise ClipFileError(f"{path}: frames of {frame.width}x{frame.height} are too large")
    height, width = clip.frame_size or (frame.height, frame.width)
    if clip.frames * width * height * 3 > MAX_CLIP_BYTES:
        raise ClipFileError(
            f"{path}: {clip.frames} frames of {width}x{height} are over "
            f"{MAX_CLIP_BYTES >> 20} MiB; lower data.clip_fps or clip_seconds, or downscale it"
        )


VIDEO_SUFFIXES = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi")
"""Files whose sound is a video container's track (decoded by PyAV), not a sound file's samples."""


def decode_audio(path: str | Path, clip: ClipFormat) -> torch.Tensor:
    """The clip's first `clip.samples` samples [C, S] in [-1, 1] from a sound file, via soundfile, or
    from a video file's own sound track (by its suffix: VIDEO_SUFFIXES; `decode_sound_track`)."""
    path = Path(path)
    if path.suffix.lower() in VIDEO_SUFFIXES:
        return decode_sound_track(path, clip)
    _checked_file(path)
    file = ("audio", str(path), _identity(path), clip.timing())
    return _remembered(file, None, lambda: _decode_audio(str(path), clip)).clone()


def _check_sample_bytes(clip: ClipFormat) -> None:
    """A clip's samples (float32) within MAX_CLIP_BYTES, before any is decoded."""
    if clip.samples * clip.channels * 4 > MAX_CLIP_BYTES:
        raise ClipFileError(
            f"{clip.samples} samples of {clip.channels} channels are over {MAX_CLIP_BYTES >> 20} MiB"
        )


def _decode_audio(path: str, clip: ClipFormat) -> torch.Tensor:
    import soundfile

    _check_sample_bytes(clip)
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


def decode_sound_track(path: str | Path, clip: ClipFormat) -> torch.Tensor:
    """The first `clip.samples` samples [C, S] in [-1, 1] of a video file's own sound track (AAC in
    an MP4, say), via PyAV, converted to the clip's rate and channel count by its resampler."""
    path = Path(path)
    _checked_file(path)
    file = ("track", str(path), _identity(path), clip.timing())
    return _remembered(file, None, lambda: _decode_sound_track(str(path), clip)).clone()


def _decode_sound_track(path: str, clip: ClipFormat) -> torch.Tensor:
    import av

    _check_sample_bytes(clip)
    layout = "mono" if clip.channels == 1 else "stereo" if clip.channels == 2 else None
    if layout is None:
        raise ClipFileError(f"a sound track is read as 1 or 2 channels; the run reads {clip.channels}")
    deadline = time.monotonic() + MAX_DECODE_S
    pieces: list[np.ndarray] = []
    have = 0
    try:
        with av.open(path) as container:
            if not container.streams.audio:
                raise ClipFileError(f"{path} has no sound track")
            resampler = av.AudioResampler(format="fltp", layout=layout, rate=clip.sample_rate)
            for frame in container.decode(container.streams.audio[0]):
                for piece in resampler.resample(frame):
                    pieces.append(piece.to_ndarray())
                    have += pieces[-1].shape[1]
                if have >= clip.samples:
                    break
                if time.monotonic() > deadline:
                    raise ClipFileError(f"{path}: its sound track took over {MAX_DECODE_S:g} s to decode")
            else:
                pieces += [piece.to_ndarray() for piece in resampler.resample(None)]
    except ClipFileError:
        raise
    except (av.error.FFmpegError, ValueError, OSError) as e:
        raise ClipFileError(f"{path}: its sound track cannot be decoded ({type(e).__name__}: {e})") from e
    data = np.concatenate(pieces, axis=1)[:, : clip.samples] if pieces else np.zeros((clip.channels, 0))
    if data.shape[1] < clip.samples:
        raise ClipFileError(
            f"{path}: its sound track is too short: {data.shape[1]} samples of the {clip.samples} of a "
            f"{clip.seconds:g} s clip at {clip.sample_rate} Hz"
        )
    if not np.isfinite(data).all():
        raise ClipFileError(f"{path}: its sound track has samples that are not finite numbers")
    return torch.from_numpy(np.ascontiguousarray(np.clip(data, -1, 1), dtype=np.float32))


@dataclass(frozen=True)
class FileTiming:
    """What a video file holds, read from its headers: frame rate, frame size, its sound track's
    sample rate (None without one) and its length in seconds."""

    fps: float
    height: int
    width: int
    sample_rate: int | None
    seconds: float


def file_timing(path: str | Path) -> FileTiming:
    """A video file's own timing and frame size (FileTiming), via PyAV, without decoding."""
    import av

    path = Path(path)
    _checked_file(path)
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ClipFileError(f"{path} has no video stream")
            video = container.streams.video[0]
            timing = FileTiming(
                fps=float(video.average_rate or video.guessed_rate or 0),
                height=int(video.height),
                width=int(video.width),
                sample_rate=int(container.streams.audio[0].rate) if container.streams.audio else None,
                seconds=float(container.duration / av.time_base) if container.duration else 0.0,
            )
    except ClipFileError:
        raise
    except (av.error.FFmpegError, ValueError, OSError) as e:
        raise ClipFileError(f"{path} cannot be opened as video ({type(e).__name__}: {e})") from e
    if not 0 < timing.fps <= MAX_SOURCE_FPS or timing.seconds <= 0:
        raise ClipFileError(
            f"{path}: a frame rate of {timing.fps:g} and a length of {timing.seconds:g} s cannot be read"
        )
    if not 0 < timing.width * timing.height <= MAX_FRAME_PIXELS:
        raise ClipFileError(f"{path}: frames of {timing.width}x{timing.height} are too large")
    return timing


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
