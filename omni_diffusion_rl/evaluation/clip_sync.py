"""Synchrony of clips on disk: every video file with a sound track in a folder (a user's own clips,
or a generator's), read at its own frame rate and sample rate and scored by sync_metrics.py.

Reading is bounded like every clip the project reads (answer_data/clip_files.py): at most
MAX_FILES files, each file's first MAX_SECONDS, frames decoded straight to at most ANALYSIS_SIDE
pixels on their longer side (motion needs no more), sound resampled to at most ANALYSIS_RATE. A file
that cannot be read is reported with the reason, never dropped.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from ..answer_data.clip_files import (
    ClipFileError,
    ClipFormat,
    decode_sound_track,
    decode_video,
    file_timing,
)
from ..sync_metrics import DEFAULT_SYNC, SyncReport, SyncSettings, sync_report

VIDEO_SUFFIXES = (".mp4", ".mov", ".mkv", ".webm", ".m4v")
MAX_FILES = 1000
MAX_SECONDS = 60.0
ANALYSIS_SIDE = 96
ANALYSIS_RATE = 16_000


def analysis_format(path: str | Path) -> ClipFormat:
    """The clip format a file is read at: its own frame rate, its first MAX_SECONDS, frames at most
    ANALYSIS_SIDE on their longer side (aspect kept), mono sound at its own rate up to ANALYSIS_RATE."""
    timing = file_timing(path)
    if timing.sample_rate is None:
        raise ClipFileError(f"{path} has no sound track: synchrony needs one")
    shrink = min(1.0, ANALYSIS_SIDE / max(timing.height, timing.width))
    size = (max(2, round(timing.height * shrink)), max(2, round(timing.width * shrink)))
    seconds = min(MAX_SECONDS, math.floor(timing.seconds * timing.fps) / timing.fps)
    return ClipFormat(
        fps=timing.fps,
        sample_rate=min(timing.sample_rate, ANALYSIS_RATE),
        seconds=seconds,
        channels=1,
        frame_size=size,
    )


def clip_sync(path: str | Path, settings: SyncSettings = DEFAULT_SYNC) -> SyncReport:
    """One file's synchrony (a ClipFileError says why it cannot be read)."""
    clip = analysis_format(path)
    frames = decode_video(path, clip)
    wave = decode_sound_track(path, clip)
    return sync_report(frames, clip.fps, wave, clip.sample_rate, settings)


def video_files(folder: str | Path, max_files: int = MAX_FILES) -> list[Path]:
    """The folder's video files (by suffix), sorted; an error when there are none or too many."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"--clips {folder}: not a folder")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in VIDEO_SUFFIXES and p.is_file())
    if not files:
        raise ValueError(f"--clips {folder}: no video files ({', '.join(VIDEO_SUFFIXES)})")
    if len(files) > max_files:
        raise ValueError(
            f"--clips {folder}: {len(files)} video files, more than {max_files}; split the folder"
        )
    return files


def folder_sync(folder: str | Path, settings: SyncSettings = DEFAULT_SYNC) -> dict[str, Any]:
    """Every video file of `folder`: its report, or the reason it could not be read; and a summary
    (median absolute offset in ms over the clips with events in both modalities, mean IoU, mean
    event counts)."""
    clips: dict[str, dict[str, Any]] = {}
    reports: list[SyncReport] = []
    for path in video_files(folder):
        try:
            report = clip_sync(path, settings)
        except ClipFileError as e:
            clips[path.name] = {"error": str(e)}
            continue
        reports.append(report)
        clips[path.name] = report.as_dict()
    offsets = [abs(r.offset_ms) for r in reports if not math.isnan(r.offset_ms)]
    summary = {
        "clips": len(clips),
        "read": len(reports),
        "failed": len(clips) - len(reports),
        "median_abs_offset_ms": statistics.median(offsets) if offsets else math.nan,
        "mean_iou": statistics.fmean(r.iou for r in reports) if reports else math.nan,
        "mean_audio_events": statistics.fmean(r.audio_count for r in reports) if reports else math.nan,
        "mean_visual_events": statistics.fmean(r.visual_count for r in reports) if reports else math.nan,
    }
    return {"folder": str(folder), "clips": clips, "summary": summary}


def sync_table(result: dict[str, Any]) -> str:
    """One row per clip (offset, IoU, counts, or why it was not read), then the summary."""
    rows = [
        "| clip | offset (ms) | AV-Align IoU | audio events | visual events |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, clip in result["clips"].items():
        if "error" in clip:
            rows.append(f"| {name} | not read: {clip['error']} | | | |")
        else:
            rows.append(
                f"| {name} | {clip['offset_ms']:+.1f} | {clip['iou']:.2f} | {clip['audio_count']} "
                f"| {clip['visual_count']} |"
            )
    s = result["summary"]
    rows.append(
        f"{s['read']} of {s['clips']} clips read; median |offset| {s['median_abs_offset_ms']:.1f} ms, "
        f"mean IoU {s['mean_iou']:.2f}"
    )
    return "\n".join(rows)
