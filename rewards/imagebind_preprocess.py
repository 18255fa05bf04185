"""ImageBind input preprocessing as pure torch functions (no torchaudio, torchvision or pytorchvideo).

Audio (ImageBind's `load_and_transform_audio_data`): mono, 16 kHz, up to `num_clips` clips of 2 s spread
evenly over the clip (first at the start, last at the end; a clip of 2 s or less is one clip, the whole
waveform), each turned into a Kaldi-compatible 128-bin log-mel filterbank with a 25 ms window and a
10 ms shift, zero-padded or cropped to 204 frames (a 2 s clip gives 198 frames, so 6 frames of padding
are normal), then normalised with ImageBind's AudioSet statistics (mean -4.268, std 9.138).

Vision (ImageBind's image and video transforms): frames resized so the short side is 224 (bicubic with
antialiasing, clamped to [0, 1] as an 8-bit image would be), a centre 224x224 crop (or ImageBind's
left/centre/right crops along the long side), and CLIP's mean/std normalisation. A video is cut into up
to `num_clips` windows of 2 s spread evenly like the audio clips; each window gives `frames_per_clip`
frames (the model's `video_frames`, 2 for ImageBind) at evenly spaced positions, i.e. its first and last
frame. A still image (F = 1) gives one clip of that frame repeated, as ImageBind's PadIm2Video does.

Nothing here is random: the same media always gives the same tensors.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rewards.clap import resample

SAMPLE_RATE = 16_000  # Hz, the rate ImageBind's audio encoder was trained at
NUM_MEL_BINS = 128
TARGET_FRAMES = 204  # fbank frames per clip fed to the audio encoder
FBANK_MEAN = -4.268
FBANK_STD = 9.138
CLIP_SECONDS = 2.0  # length of one audio or video clip
AUDIO_CLIPS = 3  # ImageBind's default for audio
VIDEO_CLIPS = 5  # ImageBind's default for video
IMAGE_SIZE = 224
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's RGB statistics, used by ImageBind
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
KALDI_EPSILON = torch.finfo(torch.float32).eps  # floor of the mel energies before the log, as in Kaldi

# ----------------------------------------------------------------------------------------------------------
# Kaldi-compatible log-mel filterbank
# ----------------------------------------------------------------------------------------------------------


def kaldi_window(kind: str, length: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Kaldi's window: 'hanning' (symmetric Hann), 'povey' (Hann ** 0.85), 'hamming' or 'rectangular'."""
    n = torch.arange(length, dtype=dtype)
    # Kaldi divides by (length - 1): the window is symmetric, zero at both ends for Hann.
    phase = 2.0 * math.pi * n / max(length - 1, 1)
    if kind == "hanning":
        return 0.5 - 0.5 * torch.cos(phase)
    if kind == "povey":
        return (0.5 - 0.5 * torch.cos(phase)).pow(0.85)
    if kind == "hamming":
        return 0.54 - 0.46 * torch.cos(phase)
    if kind == "rectangular":
        return torch.ones(length, dtype=dtype)
    raise ValueError(f"unknown window {kind!r}; use 'hanning', 'povey', 'hamming' or 'rectangular'")


def _mel(freq: torch.Tensor | float) -> torch.Tensor:
    """Kaldi's mel scale: 1127 ln(1 + f / 700)."""
    return 1127.0 * torch.log1p(torch.as_tensor(freq, dtype=torch.float64) / 700.0)


def kaldi_mel_banks(
    num_bins: int, fft_size: int, sample_rate: float, low_freq: float = 20.0, high_freq: float = 0.0
) -> torch.Tensor:
    """Triangular filters [num_bins, fft_size // 2 + 1], evenly spaced and triangular on the mel scale.

    high_freq <= 0 counts down from the Nyquist frequency, as in Kaldi. The Nyquist bin gets weight 0.
    """
    nyquist = 0.5 * sample_rate
    high = high_freq if high_freq > 0 else nyquist + high_freq
    if not 0.0 <= low_freq < high <= nyquist:
        raise ValueError(f"need 0 <= low_freq < high_freq <= {nyquist}; got {low_freq} and {high}")
    mel_low, mel_high = _mel(low_freq), _mel(high)
    step = (mel_high - mel_low) / (num_bins + 1)
    edges = mel_low + step * torch.arange(num_bins + 2, dtype=torch.float64)  # left/centre/right edges
    left, centre, right = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    half = fft_size // 2
    bin_mel = _mel(torch.arange(half, dtype=torch.float64) * (sample_rate / fft_size))[None, :]
    rising = (bin_mel - left) / (centre - left)
    falling = (right - bin_mel) / (right - centre)
    weights = torch.minimum(rising, falling).clamp(min=0.0)
    return F.pad(weights, (0, 1))  # the Nyquist bin is outside every filter in Kaldi


def kaldi_fbank(
    waveform: torch.Tensor,
    sample_rate: int,
    num_mel_bins: int = NUM_MEL_BINS,
    frame_length_ms: float = 25.0,
    frame_shift_ms: float = 10.0,
    window: str = "hanning",
    preemphasis: float = 0.97,
    remove_dc_offset: bool = True,
    low_freq: float = 20.0,
    high_freq: float = 0.0,
) -> torch.Tensor:
    """Log-mel filterbank [..., T, bins] of [..., S] as Kaldi (torchaudio.compliance.kaldi.fbank) computes it.

    Frames only where a whole window fits (snip_edges), no dither, per-frame DC removal, pre-emphasis
    x[t] - k x[t-1] (with x[-1] = x[0]), the window, zero padding to the next power of two, the power
    spectrum, mel filters and log(max(energy, float32 eps)). Computed in float64.
    ImageBind calls torchaudio with window_type='hanning' (the default here); Kaldi's own default is 'povey'.
    """
    window_size = int(sample_rate * frame_length_ms * 0.001)
    shift = int(sample_rate * frame_shift_ms * 0.001)
    if waveform.shape[-1] < window_size:
        raise ValueError(
            f"audio of {waveform.shape[-1]} samples is shorter than one {frame_length_ms:g} ms window "
            f"({window_size} samples at {sample_rate} Hz)"
        )
    frames = waveform.detach().to(torch.float64).unfold(-1, window_size, shift)  # [..., T, window]
    if remove_dc_offset:
        frames = frames - frames.mean(dim=-1, keepdim=True)
    if preemphasis:
        previous = torch.cat([frames[..., :1], frames[..., :-1]], dim=-1)
        frames = frames - preemphasis * previous
    frames = frames * kaldi_window(window, window_size).to(frames.device)
    fft_size = 1 << (window_size - 1).bit_length()
    power = torch.fft.rfft(frames, n=fft_size).abs().pow(2)  # [..., T, fft_size // 2 + 1]
    banks = kaldi_mel_banks(num_mel_bins, fft_size, sample_rate, low_freq, high_freq).to(power.device)
    return (power @ banks.T).clamp(min=KALDI_EPSILON).log()


# ----------------------------------------------------------------------------------------------------------
# Clips
# ----------------------------------------------------------------------------------------------------------


def clip_starts(length: int, clip_length: int, num_clips: int) -> list[int]:
    """Start offsets of up to `num_clips` windows of `clip_length` spread evenly over `length` items.

    The first window starts at 0 and the last ends at `length`, like pytorchvideo's
    ConstantClipsPerVideoSampler that ImageBind uses; equal starts (short inputs) are kept once, which
    leaves the mean of the clip embeddings unchanged.
    """
    if num_clips < 1:
        raise ValueError(f"num_clips must be >= 1; got {num_clips}")
    room = max(length - clip_length, 0)
    if num_clips == 1:
        return [0]
    return sorted({i * room // (num_clips - 1) for i in range(num_clips)})


def audio_features(
    audio: torch.Tensor, sample_rate: int, num_clips: int = AUDIO_CLIPS, window: str = "hanning"
) -> torch.Tensor:
    """ImageBind's audio input from [B, C, S] waveforms in [-1, 1]: [B, clips, 1, 128, 204] float32."""
    if audio.ndim != 3:
        raise ValueError(f"audio must be [B, C, S]; got shape {tuple(audio.shape)}")
    mono = audio.detach().to("cpu", torch.float64).mean(dim=1)
    mono = resample(mono, int(sample_rate), SAMPLE_RATE)
    clip_length = round(CLIP_SECONDS * SAMPLE_RATE)
    starts = clip_starts(mono.shape[-1], clip_length, num_clips)
    clips = torch.stack([mono[:, s : s + clip_length] for s in starts], dim=1)  # [B, clips, <= 32000]
    # ImageBind removes each clip's mean first; the fbank's per-frame DC removal makes that a no-op but
    # for rounding, and it is kept for parity.
    clips = clips - clips.mean(dim=-1, keepdim=True)
    fbank = kaldi_fbank(clips, SAMPLE_RATE, NUM_MEL_BINS, window=window).transpose(-1, -2)  # [B, n, 128, T]
    missing = TARGET_FRAMES - fbank.shape[-1]
    # Padding is 0 in the log-mel domain, before normalisation, as in ImageBind.
    fbank = F.pad(fbank, (0, missing)) if missing > 0 else fbank[..., :TARGET_FRAMES]
    return ((fbank - FBANK_MEAN) / FBANK_STD).unsqueeze(2).float()


def video_frame_indices(
    num_frames: int,
    fps: float,
    num_clips: int = VIDEO_CLIPS,
    frames_per_clip: int = 2,
    clip_seconds: float = CLIP_SECONDS,
) -> torch.Tensor:
    """Frame indices [clips, frames_per_clip]: 2 s windows spread evenly, each sampled at even spacing.

    A window holds round(clip_seconds * fps) frames (at most the whole video); inside it the indices are
    floor(linspace(0, window - 1, frames_per_clip)), pytorchvideo's UniformTemporalSubsample, so with 2
    frames per clip a window gives its first and last frame.
    """
    if num_frames < 1:
        raise ValueError("the video has no frames")
    if fps <= 0:
        raise ValueError(f"fps must be positive; got {fps}")
    window = min(max(round(clip_seconds * fps), 1), num_frames)
    inside = torch.linspace(0, window - 1, frames_per_clip, dtype=torch.float64).floor().long()
    starts = torch.tensor(clip_starts(num_frames, window, num_clips), dtype=torch.long)
    return starts[:, None] + inside[None, :]


def resize_short_side(frames: torch.Tensor, size: int = IMAGE_SIZE) -> torch.Tensor:
    """[N, 3, H, W] -> short side `size`, long side floor(long * size / short); bicubic, antialiased."""
    height, width = frames.shape[-2:]
    if min(height, width) == size:
        return frames
    if height <= width:
        new_size = (size, max(size, int(width * size / height)))
    else:
        new_size = (max(size, int(height * size / width)), size)
    resized = F.interpolate(frames, size=new_size, mode="bicubic", align_corners=False, antialias=True)
    return resized.clamp(0.0, 1.0)


def square_crops(frames: torch.Tensor, size: int = IMAGE_SIZE, num_crops: int = 1) -> torch.Tensor:
    """[N, 3, H, W] -> [N, crops, 3, size, size]: centre crop, or (3) start/centre/end of the long side."""
    if num_crops not in (1, 3):
        raise ValueError(f"spatial crops must be 1 (centre) or 3 (ImageBind's three); got {num_crops}")
    height, width = frames.shape[-2:]
    if min(height, width) < size:
        raise ValueError(f"frames of {height}x{width} are smaller than the {size}x{size} crop")
    centre_y, centre_x = math.ceil((height - size) / 2), math.ceil((width - size) / 2)
    if num_crops == 1:
        offsets = [(centre_y, centre_x)]
    elif height > width:
        offsets = [(0, centre_x), (centre_y, centre_x), (height - size, centre_x)]
    else:
        offsets = [(centre_y, 0), (centre_y, centre_x), (centre_y, width - size)]
    return torch.stack([frames[..., y : y + size, x : x + size] for y, x in offsets], dim=1)


def normalise_pixels(frames: torch.Tensor) -> torch.Tensor:
    """(x - CLIP mean) / CLIP std over the colour axis, the third from last."""
    mean = torch.tensor(CLIP_MEAN, dtype=frames.dtype, device=frames.device)[:, None, None]
    std = torch.tensor(CLIP_STD, dtype=frames.dtype, device=frames.device)[:, None, None]
    return (frames - mean) / std


def vision_inputs(
    video: torch.Tensor,
    fps: float,
    num_clips: int = VIDEO_CLIPS,
    frames_per_clip: int = 2,
    spatial_crops: int = 1,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """ImageBind's vision input from [B, F, 3, H, W] in [0, 1]: [B, clips * crops, 3, T, 224, 224].

    T = frames_per_clip. The frames it reads are picked where the video is, and only they go to
    `device` (default: the video's), where the rest runs in float32: a batch of the H3 recipe's
    clips is 23 GiB of float32 frames, of which ImageBind reads 10 a clip (about 1.9 GiB).
    """
    if video.ndim != 5 or video.shape[2] != 3:
        raise ValueError(f"video must be [B, F, 3, H, W]; got shape {tuple(video.shape)}")
    batch, num_frames = video.shape[:2]
    index = video_frame_indices(num_frames, fps, num_clips, frames_per_clip).to(video.device)
    clips, per_clip = index.shape
    picked = video.detach()[:, index.flatten()]  # [B, clips * per_clip, 3, H, W]
    frames = picked.to(video.device if device is None else device).float()
    frames = resize_short_side(frames.flatten(0, 1))
    crops = normalise_pixels(square_crops(frames, IMAGE_SIZE, spatial_crops))  # [N, crops, 3, 224, 224]
    crops = crops.reshape(batch, clips, per_clip, spatial_crops, 3, IMAGE_SIZE, IMAGE_SIZE)
    # -> [B, clips, crops, 3, T, H, W], then clips and crops flattened into one axis of views
    crops = crops.permute(0, 1, 3, 4, 2, 5, 6)
    return crops.reshape(batch, clips * spatial_crops, 3, per_clip, IMAGE_SIZE, IMAGE_SIZE).contiguous()
