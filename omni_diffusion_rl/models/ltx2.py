"""LTX-2 (joint audio and video) as a flow policy, through the components of diffusers' LTX2Pipeline.

The pipeline's own pieces do the work: its text encoder and connectors encode prompts (as
`LTX2Pipeline.encode_prompt` and `connectors` do), its transformer predicts both velocities in one
pass, and its VAEs and vocoder decode. What the pipeline's `__call__` does around them is replaced
by our sampler, so that the same transformer can be sampled with the rollout adapter and trained:

- the latent of one sample is the pipeline's packed video tokens [F'·H'·W', C] and packed audio
  tokens [L, C_a·M] (`_pack_latents`, `_pack_audio_latents`), flattened and concatenated;
- time is the pipeline's sigma (x_t = (1 - t) x0 + t noise, the transformer called at t·1000 and
  predicting noise - x0), on its grid: linspace(1, 1/N, N) shifted by the scheduler with mu from
  the packed video length (`calculate_shift`), then 0;
- guidance is off (one transformer pass per step; the RL rewards steer instead of CFG);
- decoding: unpack, denormalise, the video VAE and the pipeline's video post-processing to frames in
  [0, 1]; the audio VAE to a mel spectrogram and the vocoder to a stereo waveform.

docs/research/ltx2_pipeline.md has the derivation; a test checks that this sampler reproduces
`LTX2Pipeline(...)`'s output latents for the same noise with guidance off.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from ..media import MediaBatch
from ..precision import base_weights_autocast
from .gradient_surgery import OMNINFT_LTX2_A2V_SCALES, block_scales, scale_a2v_gradients
from .policy import Condition, split_entries
from .vae_memory import configure_vae_memory, decode_into, stored_dtype

VIDEO_CONTEXT, AUDIO_CONTEXT, CONTEXT_MASK = "video_context", "audio_context", "context_mask"
MAX_INDEX_BYTES = 64 << 10


class LTX2Policy:
    """LTX-2 at a fixed clip size (height, width, frames, frame rate); see the module docstring.
    vae_tiling / vae_slicing: decode large frames tile by tile / a batch one clip at a time (None
    keeps the VAE's default). a2v_gradient_scales: OmniNFT's gradient surgery, {blocks: scale} for
    the gradient the audio-to-video cross-attention sends back into the audio stream ("omninft":
    its released LTX-2 setting; models/gradient_surgery.py)."""

    # the q/k/v/out projections of all six attention modules of every block (video and audio self-
    # attention, their prompt cross-attention, and the audio<->video cross-modal attention)
    lora_target_modules: ClassVar[list[str]] = ["to_q", "to_k", "to_v", "to_out.0"]

    def __init__(
        self,
        pipeline: Any,
        height: int = 512,
        width: int = 768,
        num_frames: int = 121,
        frame_rate: float = 24.0,
        max_sequence_length: int = 1024,
        vae_tiling: bool | None = None,
        vae_slicing: bool = False,
        a2v_gradient_scales: dict[str, float] | str | None = None,
    ) -> None:
        if height % 32 or width % 32:
            raise ValueError(f"LTX-2 needs height and width divisible by 32; got {height} x {width}")
        self.pipeline = pipeline
        self.transformer: nn.Module = pipeline.transformer
        self.surgery: list[Any] = []  # the gradient surgery's hooks (a2v_gradient_scales)
        if a2v_gradient_scales:
            spec = OMNINFT_LTX2_A2V_SCALES if a2v_gradient_scales == "omninft" else a2v_gradient_scales
            if not isinstance(spec, dict):
                raise ValueError(
                    f"a2v_gradient_scales: {a2v_gradient_scales!r} is neither 'omninft' nor a mapping of "
                    "blocks to scales like {'0': 0.0, '1-10': 0.1}"
                )
            blocks = self.transformer.transformer_blocks
            self.surgery = scale_a2v_gradients(blocks, block_scales(spec, len(blocks)))
        for module in (pipeline.vae, pipeline.audio_vae, pipeline.vocoder, pipeline.text_encoder):
            module.requires_grad_(False)
        pipeline.connectors.requires_grad_(False)
        configure_vae_memory(pipeline.vae, vae_tiling, vae_slicing)
        self.frame_rate, self.max_sequence_length = float(frame_rate), max_sequence_length
        config = self.transformer.config
        self.video_grid = (
            (num_frames - 1) // pipeline.vae_temporal_compression_ratio + 1,
            height // pipeline.vae_spatial_compression_ratio,
            width // pipeline.vae_spatial_compression_ratio,
        )
        audio_vae = pipeline.audio_vae
        per_second = (
            pipeline.audio_sampling_rate
            / pipeline.audio_hop_length
            / pipeline.audio_vae_temporal_compression_ratio
        )
        self.audio_frames = round(num_frames / frame_rate * per_second)
        self.audio_mel_bins = audio_vae.config.mel_bins // pipeline.audio_vae_mel_compression_ratio
        self.video_channels, self.audio_channels = int(config.in_channels), int(config.audio_in_channels)
        if audio_vae.config.latent_channels * self.audio_mel_bins != self.audio_channels:
            raise ValueError(
                f"the audio VAE packs {audio_vae.config.latent_channels} x {self.audio_mel_bins} features "
                f"per audio token, the transformer expects {self.audio_channels} (audio_in_channels)"
            )
        self.video_size = int(np.prod(self.video_grid)) * self.video_channels
        self.base_dtype = stored_dtype(self.transformer)
        self.audio_size = self.audio_frames * self.audio_channels

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (self.video_size + self.audio_size,)

    def modality_entries(self) -> dict[str, torch.Tensor]:
        """The flat latent is the video's tokens, then the audio's."""
        return split_entries({"video": self.video_size, "audio": self.audio_size})

    # ------------------------------------------------------------------ prompts
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Condition:
        """The connectors' video and audio prompt embeddings and their mask (guidance off)."""
        pipe = self.pipeline
        embeds, mask, _, _ = pipe.encode_prompt(
            list(prompts), do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length
        )
        video, audio, context_mask = pipe.connectors(embeds, mask, padding_side=pipe.tokenizer.padding_side)
        return {VIDEO_CONTEXT: video, AUDIO_CONTEXT: audio, CONTEXT_MASK: context_mask}

    # ------------------------------------------------------------------ the velocity
    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of flat latents as packed video [B, F'H'W', C] and audio [B, L, C_a M] tokens."""
        if x.ndim != 2 or x.shape[1] != self.video_size + self.audio_size:
            raise ValueError(
                f"LTX-2 latents must be [B, {self.video_size + self.audio_size}] (video {self.video_size} + "
                f"audio {self.audio_size} for this clip size); got {tuple(x.shape)}"
            )
        video = x[:, : self.video_size].reshape(len(x), -1, self.video_channels)
        audio = x[:, self.video_size :].reshape(len(x), self.audio_frames, self.audio_channels)
        return video, audio

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, cond: Condition) -> torch.Tensor:
        """noise - x0 for both streams in one transformer pass; t: [B] sigmas in [0, 1]."""
        batch = len(x_t)
        video, audio = self.split(x_t)
        dtype = cond[VIDEO_CONTEXT].dtype
        timestep = (
            (torch.as_tensor(t, device=x_t.device, dtype=torch.float32) * 1000).reshape(-1).expand(batch)
        )
        frames, height, width = self.video_grid
        rope = self.transformer.rope
        video_coords = rope.prepare_video_coords(
            batch, frames, height, width, x_t.device, fps=self.frame_rate
        )
        audio_coords = self.transformer.audio_rope.prepare_audio_coords(batch, self.audio_frames, x_t.device)
        with base_weights_autocast(self.base_dtype, x_t.device):
            video_v, audio_v = self.transformer(
                hidden_states=video.to(dtype),
                audio_hidden_states=audio.to(dtype),
                encoder_hidden_states=cond[VIDEO_CONTEXT],
                audio_encoder_hidden_states=cond[AUDIO_CONTEXT],
                timestep=timestep,
                sigma=timestep,
                encoder_attention_mask=cond[CONTEXT_MASK],
                audio_encoder_attention_mask=cond[CONTEXT_MASK],
                num_frames=frames,
                height=height,
                width=width,
                fps=self.frame_rate,
                audio_num_frames=self.audio_frames,
                video_coords=video_coords,
                audio_coords=audio_coords,
                use_cross_timestep=True,
                return_dict=False,
            )
        return torch.cat([video_v.flatten(1), audio_v.flatten(1)], dim=1).to(x_t.dtype)

    def time_grid(self, num_steps: int, shift: float) -> torch.Tensor:
        """The pipeline's sigmas for `num_steps` (mu from the packed video length), then 0. The
        scheduler's own shifting applies; `shift` (sampling.time_shift) must be 1 or its static shift."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

        scheduler = copy.deepcopy(self.pipeline.scheduler)
        config = scheduler.config
        if not config.get("use_dynamic_shifting", False) and shift != 1.0:
            scheduler = type(scheduler).from_config(config, shift=shift)
        mu = calculate_shift(
            int(np.prod(self.video_grid)),
            config.get("base_image_seq_len", 1024),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.95),
            config.get("max_shift", 2.05),
        )
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
        return scheduler.sigmas.to(torch.float32).cpu()

    # ------------------------------------------------------------------ decoding
    @torch.no_grad()
    def decode(self, x0: torch.Tensor) -> MediaBatch:
        """Frames [B, F, 3, H, W] in [0, 1] and the stereo waveform [B, 2, S] in [-1, 1]."""
        pipe = self.pipeline
        vae, audio_vae = pipe.vae, pipe.audio_vae
        video, audio = self.split(x0.float())
        frames, height, width = self.video_grid
        config = self.transformer.config
        latents = pipe._unpack_latents(video, frames, height, width, config.patch_size, config.patch_size_t)
        latents = pipe._denormalize_latents(
            latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor
        )

        def post_process(out: torch.Tensor, sample: torch.Tensor) -> None:
            out.copy_(pipe.video_processor.postprocess_video(sample[None], output_type="pt")[0])

        def decode(part: torch.Tensor) -> torch.Tensor:
            return vae.decode(part, None, return_dict=False)[0]

        frames_out = decode_into(decode, latents.to(vae.dtype), post_process, vae)
        audio = pipe._denormalize_audio_latents(audio, audio_vae.latents_mean, audio_vae.latents_std)
        audio = pipe._unpack_audio_latents(audio, self.audio_frames, self.audio_mel_bins)
        mel = audio_vae.decode(audio.to(audio_vae.dtype), return_dict=False)[0]
        waveform = pipe.vocoder(mel).float().clamp(-1, 1)
        return MediaBatch(video=frames_out, audio=waveform, fps=self.frame_rate, sample_rate=self.sample_rate)

    def to(self, device: torch.device | str | None = None) -> LTX2Policy:
        """Every component of the pipeline on `device` (in place); returns self."""
        self.pipeline.to(device)
        return self

    @property
    def sample_rate(self) -> int:
        """The vocoder's real output rate: 100 mel frames per second times its upsampling."""
        return int(round(100 * float(np.prod(self.pipeline.vocoder.config.upsample_factors))))

    @classmethod
    def from_pretrained(cls, source: str, dtype: torch.dtype = torch.float32, **clip: Any) -> LTX2Policy:
        """From a saved LTX2Pipeline directory or a hub id (in the local cache when offline). A local
        directory must hold every component folder its model_index.json lists (a ValueError names the
        missing ones)."""
        from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel

        from .shard_loading import load_transformer

        check_pipeline_dir(Path(source))
        transformer = load_transformer(LTX2VideoTransformer3DModel, source, "transformer", dtype)
        return cls(LTX2Pipeline.from_pretrained(source, torch_dtype=dtype, transformer=transformer), **clip)


def check_pipeline_dir(path: Path) -> None:
    """A local pipeline directory: its model_index.json (bounded read) and every component folder it
    lists; a hub id (not a directory) is left to diffusers."""
    if not path.is_dir():
        return
    index = path / "model_index.json"
    if not index.is_file():
        raise ValueError(
            f"{path} has no model_index.json: not a saved pipeline (write one with save_pretrained)"
        )
    with open(index, "rb") as f:
        data = f.read(MAX_INDEX_BYTES + 1)
    if len(data) > MAX_INDEX_BYTES:
        raise ValueError(f"{index} is larger than {MAX_INDEX_BYTES >> 10} KiB")
    spec = json.loads(data.decode("utf-8"))
    if not isinstance(spec, dict):
        raise ValueError(f"{index} is not a JSON object")
    listed = [
        k for k, v in spec.items() if not k.startswith("_") and isinstance(v, list) and v[0] is not None
    ]
    missing = [name for name in listed if not (path / name).is_dir()]
    if missing:
        raise ValueError(
            f"{path} lacks the component folder(s) {', '.join(missing)} that model_index.json lists"
        )
