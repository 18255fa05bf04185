"""Generated media: a batch of video frames and audio waveforms, and writers for WAV, GIF and PNG."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import wave
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, BinaryIO

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from .sync_metrics import SyncEnvelopes, sync_envelopes


class NonFiniteSamples(RuntimeError):
    """The model generated samples that are not finite numbers: its weights cannot be sampled."""


@dataclass
class MediaBatch:
    """What a policy decodes to and what rewards score.

    video: [B, F, 3, H, W] floats in [0, 1] (a still image is F = 1), or None.
    audio: [B, C, S] floats in [-1, 1], or None.
    text: B strings, or None: a language model's answers (the media are then its inputs).
    """

    video: torch.Tensor | None = None
    audio: torch.Tensor | None = None
    fps: float = 8.0
    sample_rate: int = 8000
    text: list[str] | None = None

    def __post_init__(self) -> None:
        if self.video is None and self.audio is None:
            raise ValueError("MediaBatch needs video, audio or both; got neither")
        if self.video is not None and self.video.ndim != 5:
            raise ValueError(f"video must be [B, F, 3, H, W]; got shape {tuple(self.video.shape)}")
        if self.audio is not None and self.audio.ndim != 3:
            raise ValueError(f"audio must be [B, C, S]; got shape {tuple(self.audio.shape)}")
        if self.video is not None and self.audio is not None and len(self.video) != len(self.audio):
            raise ValueError(f"video batch {len(self.video)} != audio batch {len(self.audio)}")
        if self.text is not None and (
            len(self.text) != len(self) or not all(isinstance(t, str) for t in self.text)
        ):
            raise ValueError(f"text must be {len(self)} strings, one per sample; got {len(self.text)}")

    def __len__(self) -> int:
        return len(self.video) if self.video is not None else len(self.audio)  # type: ignore[arg-type]

    def select(self, index: torch.Tensor | slice | list[int]) -> MediaBatch:
        """The sub-batch at `index`."""
        if self.text is None:
            text = None
        elif isinstance(index, slice):
            text = self.text[index]
        else:
            text = [self.text[i] for i in (index.tolist() if isinstance(index, torch.Tensor) else index)]
        return MediaBatch(
            video=None if self.video is None else self.video[index],
            audio=None if self.audio is None else self.audio[index],
            fps=self.fps,
            sample_rate=self.sample_rate,
            text=text,
        )


# ----------------------------------------------------------------------------------------------------------
# Writing media to disk: WAV, GIF, PNG, a contact sheet, and a preview folder per batch.
# Every file is written to a temporary name in its final folder and then renamed over the target, so a
# crash mid-write leaves either the old file or none, never a truncated one.
# ----------------------------------------------------------------------------------------------------------

SHEET_GAP = 2  # pixels between tiles and around the edge of a contact sheet
SHEET_BACKGROUND = (24, 24, 24)
SHEET_TEXT = (235, 235, 235)
REFERENCE_GAP = 4 * SHEET_GAP  # pixels between a row's reference frames and its sample frames
STRIP_HEIGHT = 28  # pixels of a row's sound-against-motion strip
STRIP_MOTION, STRIP_ONSET = (120, 170, 235), (240, 90, 70)  # motion drawn as an area, onsets as bars
DEFAULT_REFERENCE_TITLE = "left: reference render of the prompt | right: generated sample"


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], None]) -> str:
    """Call `write` on a temp file beside `path`, fsync it, then rename it onto `path`; returns the path."""
    target = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(target))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(target)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp creates the file 0600; give it the old file's mode, or the usual rw-r--r--.
        os.chmod(tmp, os.stat(target).st_mode & 0o777 if os.path.exists(target) else 0o644)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def _to_uint8_hwc(image: torch.Tensor) -> np.ndarray:
    """[3, H, W] floats in [0, 1] -> [H, W, 3] uint8 array."""
    if image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"image must be [3, H, W]; got shape {tuple(image.shape)}")
    pixels = (image.detach().float().clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)
    return pixels.permute(1, 2, 0).cpu().numpy()


def _to_pil(image: torch.Tensor, scale: int = 1) -> Image.Image:
    """[3, H, W] floats in [0, 1] -> RGB PIL image, enlarged `scale` times with nearest-neighbour."""
    if scale < 1:
        raise ValueError(f"scale must be >= 1; got {scale}")
    picture = Image.fromarray(_to_uint8_hwc(image))
    if scale > 1:
        picture = picture.resize((picture.width * scale, picture.height * scale), Image.Resampling.NEAREST)
    return picture


def save_wav(path: str | os.PathLike[str], waveform: torch.Tensor, sample_rate: int) -> str:
    """Write a [C, S] (or mono [S]) waveform in [-1, 1] as 16-bit PCM WAV; values outside are clipped."""
    if waveform.ndim == 1:
        waveform = waveform.unsqueeze(0)
    if waveform.ndim != 2:
        raise ValueError(f"waveform must be [C, S]; got shape {tuple(waveform.shape)}")
    channels = waveform.shape[0]
    samples = (waveform.detach().float().clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
    # WAV interleaves channels frame by frame: [S, C], little-endian.
    frames = samples.t().contiguous().cpu().numpy().astype("<i2").tobytes()

    def write(handle: BinaryIO) -> None:
        with wave.open(handle, "wb") as wav:
            wav.setnchannels(channels)
            wav.setsampwidth(2)
            wav.setframerate(int(sample_rate))
            wav.writeframes(frames)

    return atomic_write(path, write)


def preview_scale(frames: torch.Tensor) -> int:
    """How many times a preview enlarges frames [..., H, W]: a small frame to about 256 pixels (at
    most 8 times); a frame of 256 pixels or more keeps its size."""
    return max(1, min(8, 256 // max(frames.shape[-2:])))


def save_gif(path: str | os.PathLike[str], frames: torch.Tensor, fps: float, scale: int | None = None) -> str:
    """Write [F, 3, H, W] frames as a looping animated GIF, each frame enlarged `scale` times (by
    default `preview_scale`: a real model's frame keeps its size).

    Pillow folds identical consecutive frames into one longer frame, so the playback time is kept
    but the frame count read back may be smaller than F for a static clip.
    """
    if frames.ndim != 4:
        raise ValueError(f"frames must be [F, 3, H, W]; got shape {tuple(frames.shape)}")
    if fps <= 0:
        raise ValueError(f"fps must be positive; got {fps}")
    pictures = [_to_pil(frame, preview_scale(frames) if scale is None else scale) for frame in frames]
    # GIF delays are whole hundredths of a second, and browsers slow anything under 0.02 s right down.
    duration_ms = 10 * max(2, round(100.0 / fps))

    def write(handle: BinaryIO) -> None:
        pictures[0].save(
            handle,
            format="GIF",
            save_all=True,
            append_images=pictures[1:],
            duration=duration_ms,
            loop=0,
        )

    return atomic_write(path, write)


MP4_AUDIO_RATE = 48_000  # AAC's usual rate, which every browser plays; the sound is resampled to it


def save_mp4(
    path: str | os.PathLike[str],
    frames: torch.Tensor,
    fps: float,
    waveform: torch.Tensor | None = None,
    sample_rate: int = 0,
    scale: int | None = None,
) -> str:
    """Write [F, 3, H, W] frames in [0, 1] as an MP4 a browser plays: H.264 (yuv420p, each frame
    enlarged `scale` times with nearest-neighbour, padded to even sides) at `fps`, with `waveform`
    ([C, S] or [S] in [-1, 1] at `sample_rate`, mixed to mono) as AAC at 48 kHz when given. The
    default scale enlarges a small frame to about 256 pixels (at most 8 times) and leaves a frame
    of 256 pixels or more as it is."""
    import av

    if frames.ndim != 4 or frames.shape[1] != 3:
        raise ValueError(f"frames must be [F, 3, H, W]; got shape {tuple(frames.shape)}")
    if fps <= 0 or (waveform is not None and sample_rate <= 0):
        raise ValueError(f"fps and sample_rate must be positive; got {fps} and {sample_rate}")
    if scale is None:
        scale = preview_scale(frames)
    pictures = [np.asarray(_to_pil(frame, scale)) for frame in frames]
    height, width = (
        pictures[0].shape[0] + pictures[0].shape[0] % 2,
        pictures[0].shape[1] + pictures[0].shape[1] % 2,
    )
    mono = None
    if waveform is not None:
        mono = waveform.detach().float().reshape(-1, waveform.shape[-1]).mean(0).clamp(-1, 1).cpu().numpy()

    def write(handle: BinaryIO) -> None:
        with av.open(handle, mode="w", format="mp4") as container:
            video = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
            video.width, video.height, video.pix_fmt = width, height, "yuv420p"
            video.options = {"crf": "18", "movflags": "+faststart"}
            audio = (
                container.add_stream("aac", rate=MP4_AUDIO_RATE, layout="mono") if mono is not None else None
            )
            for picture in pictures:
                padded = np.pad(
                    picture, ((0, height - picture.shape[0]), (0, width - picture.shape[1]), (0, 0))
                )
                container.mux(video.encode(av.VideoFrame.from_ndarray(padded, format="rgb24")))
            container.mux(video.encode(None))
            if audio is not None and mono is not None:
                _encode_sound(container, audio, mono, sample_rate)

    return atomic_write(path, write)


def _encode_sound(container: Any, stream: Any, mono: np.ndarray, sample_rate: int) -> None:
    """Mono float samples at `sample_rate` into the AAC `stream`, resampled to its rate."""
    import av

    frame = av.AudioFrame.from_ndarray(mono[None].astype(np.float32), format="flt", layout="mono")
    frame.sample_rate = int(sample_rate)
    resampler = av.AudioResampler(format="fltp", layout="mono", rate=stream.rate)
    start = 0
    for piece in [*resampler.resample(frame), *resampler.resample(None)]:
        # stamped from 0: the encoder then marks its priming samples (before 0) for players to skip
        piece.pts, piece.time_base, start = start, Fraction(1, stream.rate), start + piece.samples
        container.mux(stream.encode(piece))
    container.mux(stream.encode(None))


def save_png(path: str | os.PathLike[str], image: torch.Tensor, scale: int = 1) -> str:
    """Write a [3, H, W] image in [0, 1] as PNG, optionally enlarged `scale` times."""
    picture = _to_pil(image, scale)
    return atomic_write(path, lambda handle: picture.save(handle, format="PNG"))


def _check_reference(reference: torch.Tensor, batch: int, size: tuple[int, int] | None) -> None:
    """Raise ValueError unless `reference` is [batch, F', 3, H, W] with F' >= 1 and, if `size` is given,
    (H, W) == `size`."""
    if reference.ndim != 5:
        raise ValueError(f"reference must be [B, F', 3, H, W]; got shape {tuple(reference.shape)}")
    ref_batch, ref_frames, channels, height, width = reference.shape
    if ref_batch != batch:
        raise ValueError(f"reference batch {ref_batch} != video batch {batch}")
    if ref_frames < 1:
        raise ValueError(f"reference needs at least one frame per sample; got shape {tuple(reference.shape)}")
    if channels != 3:
        raise ValueError(f"reference must have 3 colour channels; got shape {tuple(reference.shape)}")
    if size is not None and (height, width) != tuple(size):
        raise ValueError(
            f"reference frames are {height}x{width} (HxW) but the video frames are {size[0]}x{size[1]}"
        )


def contact_sheet(
    video: torch.Tensor,
    labels: list[str] | None = None,
    scale: int = 8,
    reference: torch.Tensor | None = None,
    title: str | None = None,
    timelines: list[SyncEnvelopes] | None = None,
) -> Image.Image:
    """Tile [B, F, 3, H, W] into one image: a row per sample, a column per frame.

    Tiles are `scale` times the frame size, separated and framed by SHEET_GAP pixels. With labels, each
    row gets a text band above it (PIL's built-in font; labels may span several lines) and the sheet is
    widened if a label is wider than the tiles.

    `reference` ([B, F', 3, H, W]; F' may differ from F, H and W may not) is drawn in each row to the left
    of that row's sample frames, REFERENCE_GAP pixels away from them, so each row reads as two blocks.
    `title` is a text line (or several) drawn once at the top; the sheet widens to fit it too.
    `timelines` (one per sample: sync_metrics.sync_envelopes) adds a strip under each row's frames, on
    their time axis: the picture's motion as an area and the sound's onsets as bars, so that a sound
    off its strike shows at a glance.
    """
    if video.ndim != 5:
        raise ValueError(f"video must be [B, F, 3, H, W]; got shape {tuple(video.shape)}")
    batch, num_frames, channels, height, width = video.shape
    if channels != 3:
        raise ValueError(f"video must have 3 colour channels; got shape {tuple(video.shape)}")
    if scale < 1:
        raise ValueError(f"scale must be >= 1; got {scale}")
    if labels is not None and len(labels) != batch:
        raise ValueError(f"got {len(labels)} labels for {batch} samples")
    if timelines is not None and len(timelines) != batch:
        raise ValueError(f"got {len(timelines)} timelines for {batch} samples")
    ref_frames = 0
    if reference is not None:
        _check_reference(reference, batch, (height, width))
        ref_frames = reference.shape[1]
    tile_w, tile_h = width * scale, height * scale
    step = tile_w + SHEET_GAP
    # The reference block (if any) starts at the left edge; the sample block follows after REFERENCE_GAP.
    sample_left = SHEET_GAP + (ref_frames * step - SHEET_GAP + REFERENCE_GAP if ref_frames else 0)
    grid_w = sample_left + num_frames * step

    font = ImageFont.load_default()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    label_boxes = [measure.multiline_textbbox((0, 0), text, font=font) for text in labels or []]
    band_h = max((box[3] for box in label_boxes), default=0) + SHEET_GAP if labels else 0
    text_w = max((box[2] for box in label_boxes), default=0) + 2 * SHEET_GAP if labels else 0
    title_h = title_w = 0
    if title:
        title_box = measure.multiline_textbbox((0, 0), title, font=font)
        title_h = title_box[3] + 2 * SHEET_GAP
        title_w = title_box[2] + 2 * SHEET_GAP

    sheet_w = max(grid_w, text_w, title_w)
    strip_h = STRIP_HEIGHT + SHEET_GAP if timelines is not None else 0
    row_h = band_h + tile_h + SHEET_GAP + strip_h
    sheet = Image.new("RGB", (sheet_w, SHEET_GAP + title_h + batch * row_h), SHEET_BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    if title:
        draw.multiline_text((SHEET_GAP, SHEET_GAP), title, fill=SHEET_TEXT, font=font)
    for row in range(batch):
        top = SHEET_GAP + title_h + row * row_h
        if labels:
            draw.multiline_text((SHEET_GAP, top), labels[row], fill=SHEET_TEXT, font=font)
        if reference is not None:
            for col in range(ref_frames):
                sheet.paste(_to_pil(reference[row, col], scale), (SHEET_GAP + col * step, top + band_h))
        for col in range(num_frames):
            sheet.paste(_to_pil(video[row, col], scale), (sample_left + col * step, top + band_h))
        if timelines is not None:
            box = (
                sample_left,
                top + band_h + tile_h + SHEET_GAP,
                num_frames * step - SHEET_GAP,
                STRIP_HEIGHT,
            )
            _draw_timeline(draw, timelines[row], box, step)
    return sheet


def _draw_timeline(
    draw: ImageDraw.ImageDraw, env: SyncEnvelopes, box: tuple[int, ...], frame_step: int
) -> None:
    """Motion as an area and onsets as bars in `box` (left, top, width, height), time running as the
    frames above it do (`frame_step` pixels a frame, frame k's time under its middle), each envelope
    scaled to its own largest value."""
    left, top, width, height = box
    draw.rectangle((left, top, left + width - 1, top + height - 1), fill=(40, 40, 40))
    points_per_frame = env.points_per_frame
    for envelope, color, bars in ((env.visual, STRIP_MOTION, False), (env.audio, STRIP_ONSET, True)):
        peak = float(envelope.max())
        if peak <= 0:
            continue
        for i, value in enumerate((envelope / peak).tolist()):
            x = left + round((i / points_per_frame + 0.5) * frame_step)  # time k / fps under frame k's middle
            if x >= left + width or value <= 0:
                continue
            y = top + height - 1 - round(value * (height - 2))
            x_end = min(left + width - 1, x + (1 if bars else max(1, frame_step // points_per_frame)))
            draw.rectangle((x, y, x_end, top + height - 1), fill=color)


def _format_score(value: float | None, digits: int) -> str:
    """`value` to `digits` decimals, or "failed" for a sample that could not be scored (None, NaN, inf)."""
    if value is None or not math.isfinite(value):
        return "failed"
    return format(value, f".{digits}f")


def _sheet_names(names: list[str]) -> dict[str, str]:
    """Each name shortened to the part after its last "/" for the sheet, unless that part is empty or
    another name shortens to the same text (then the full name is kept, so no two columns read alike)."""
    short = {name: name.rsplit("/", 1)[-1] or name for name in names}
    counts = Counter(short.values())
    return {name: text if counts[text] == 1 else name for name, text in short.items()}


def _reward_label(
    index: int,
    prompt: str,
    rewards: dict[str, list[float | None]],
    metrics: dict[str, list[float | None]] | None = None,
    failure: str | None = None,
) -> str:
    """A row label: the sample number and prompt; then each reward to three decimals; then, with metrics,
    each metric to two decimals under its short name (see _sheet_names). A score that is None, NaN or
    inf reads "failed"; a line with nothing to show is left out."""
    lines = [f"{index:02d} {prompt}"]
    scores = "  ".join(f"{name}={_format_score(values[index], 3)}" for name, values in rewards.items())
    if scores:
        lines.append(scores)
    if metrics:
        short = _sheet_names(list(metrics))
        lines.append(
            "  ".join(f"{short[name]}={_format_score(values[index], 2)}" for name, values in metrics.items())
        )
    if failure:
        lines.append(f"failed: {failure[:80]}")
    return "\n".join(lines)


def _json_scores(
    kind: str, name: str, values: Sequence[float | None] | torch.Tensor, count: int
) -> list[float | None]:
    """One score per sample as JSON-ready floats: None, NaN and inf (a sample that could not be scored)
    become None; anything else that is not a number, or the wrong count, raises ValueError."""
    try:
        if isinstance(values, torch.Tensor):
            values = values.detach().cpu().double()
            items = values.tolist() if values.ndim == 1 else list(values)
        else:
            items = list(values)
    except TypeError as error:
        raise ValueError(f"{kind} {name!r} must be one value per sample; got {values!r}") from error
    if len(items) != count:
        raise ValueError(f"{kind} {name!r} has {len(items)} values for {count} samples")
    scores: list[float | None] = []
    for i, value in enumerate(items):
        if value is None:
            scores.append(None)
            continue
        try:
            number = float(value)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{kind} {name!r}: sample {i} is {value!r}, not a number or None") from error
        scores.append(number if math.isfinite(number) else None)
    return scores


def _write_sample(
    folder: str, i: int, media: MediaBatch, reference: torch.Tensor | None, written: dict[str, str]
) -> dict[str, object]:
    """Sample i's files (its gif, wav, mp4 with its sound and reference gif, as the batch has them),
    added to `written`; its index entry's file names."""
    entry: dict[str, object] = {}
    sound = media.audio

    def mp4(path: str, video: torch.Tensor) -> str:
        return save_mp4(path, video, media.fps, None if sound is None else sound[i], media.sample_rate)

    files = [
        ("gif", f"sample_{i:02d}.gif", media.video, lambda path, x: save_gif(path, x, media.fps)),
        ("wav", f"sample_{i:02d}.wav", media.audio, lambda path, x: save_wav(path, x, media.sample_rate)),
        ("mp4", f"sample_{i:02d}.mp4", media.video, mp4),
        ("reference_gif", f"reference_{i:02d}.gif", reference, lambda path, x: save_gif(path, x, media.fps)),
    ]
    for key, name, batch, save in files:
        if batch is not None:
            written[name] = save(os.path.join(folder, name), batch[i])
            entry[key] = name
    return entry


def _preview_sheet(
    media: MediaBatch, labels: list[str], reference: torch.Tensor | None, reference_title: str | None
) -> Image.Image:
    """The previews' contact sheet: the samples' frames under their labels, beside their reference
    when there is one, each over its sound-against-motion strip when the batch has sound."""
    assert media.video is not None
    title = None
    if reference is not None:
        title = DEFAULT_REFERENCE_TITLE if reference_title is None else reference_title
    timelines = None
    if media.audio is not None:
        pairs = zip(media.video, media.audio, strict=True)
        timelines = [sync_envelopes(v, media.fps, a, media.sample_rate) for v, a in pairs]
    return contact_sheet(media.video, labels, reference=reference, title=title, timelines=timelines)


def save_previews(
    out_dir: str | os.PathLike[str],
    media: MediaBatch,
    prompts: list[str],
    rewards: Mapping[str, Sequence[float | None] | torch.Tensor] | None = None,
    metrics: Mapping[str, Sequence[float | None] | torch.Tensor] | None = None,
    reference: torch.Tensor | None = None,
    reference_title: str | None = None,
    failures: Mapping[int, str] | None = None,
) -> dict[str, str]:
    """Write a preview folder for a batch and return {file name: path} for every file written.

    Files: `sheet.png` (contact sheet labelled with prompt, rewards and metrics; video only),
    `sample_{i:02d}.gif` and/or `sample_{i:02d}.wav` per sample, with video `sample_{i:02d}.mp4` (its
    sound muxed in, when it has one: a browser plays it), `reference_{i:02d}.gif` per sample with a
    reference, and `index.json` listing prompts, rewards, metrics and file names.

    `rewards` and `metrics` map a name to one score per sample (a list or a tensor). A score that is None,
    NaN or inf (a sample the scorer could not score) is written as JSON null and shown as "failed".
    `reference` ([B, F', 3, H, W]) is a render of each prompt to compare against: it is drawn left of the
    samples on the sheet under the title `reference_title` (DEFAULT_REFERENCE_TITLE if None; "" for no
    title). `failures` maps a sample's index to why a scorer failed on it (shown on the sheet, written
    to index.json as `failed`). Shapes are checked before anything is written.
    """
    failures = dict(failures or {})
    count = len(media)
    if len(prompts) != count:
        raise ValueError(f"got {len(prompts)} prompts for {count} samples")
    scores = {name: _json_scores("reward", name, values, count) for name, values in (rewards or {}).items()}
    measured = {name: _json_scores("metric", name, values, count) for name, values in (metrics or {}).items()}
    if reference is not None:
        size = None if media.video is None else (media.video.shape[3], media.video.shape[4])
        _check_reference(reference, count, size)

    sheet = None
    if media.video is not None:
        labels = [_reward_label(i, prompts[i], scores, measured, failures.get(i)) for i in range(count)]
        sheet = _preview_sheet(media, labels, reference, reference_title)

    folder = os.fspath(out_dir)
    os.makedirs(folder, exist_ok=True)
    written: dict[str, str] = {}
    sheet_name: str | None = None
    if sheet is not None:
        sheet_name = "sheet.png"
        path = os.path.join(folder, sheet_name)
        written[sheet_name] = atomic_write(path, lambda handle: sheet.save(handle, format="PNG"))

    samples = [
        {
            "index": i,
            "prompt": prompts[i],
            "rewards": {name: values[i] for name, values in scores.items()},
            "metrics": {name: values[i] for name, values in measured.items()},
            **({"failed": failures[i]} if i in failures else {}),
            **_write_sample(folder, i, media, reference, written),
        }
        for i in range(count)
    ]

    index = {
        "num_samples": count,
        "fps": media.fps,
        "sample_rate": media.sample_rate,
        "sheet": sheet_name,
        "prompts": list(prompts),
        "rewards": scores,
        "metrics": measured,
        "reference": reference is not None,
        "samples": samples,
    }
    text = json.dumps(index, indent=2).encode("utf-8")
    index_path = os.path.join(folder, "index.json")
    written["index.json"] = atomic_write(index_path, lambda handle: handle.write(text))
    return written
