"""MiniMax-H3 (text to joint audio and video) as a flow policy over diffusers' H3 components.

diffusers 0.42.1 ships H3 as a modular pipeline (`diffusers.modular_pipelines.minimax_h3`) and a
scheduler (`MiniMaxH3Scheduler`), not as a `DiffusionPipeline` with a `__call__` we could drive. This
adapter builds what its t2va blocks build, with the pipeline's own helpers where they exist:

- prompts: the prompt tokenized verbatim (no chat template, no special tokens) and read from the
  Qwen3-VL conditioner's `hidden_states[text_encoder_layer]` (50 for the released model), as
  `encoders.get_qwen3vl_prompt_embeds` does for a prompt without vision blocks; no mask, no
  negative prompt (the checkpoint is guidance-distilled). The conditioner's layers past that one
  are dropped at load, each distinct prompt is encoded once, and `offload_text_encoder` keeps the
  conditioner in host memory (about 54 GB in bf16 with its first 51 of 64 layers);
- one packed sequence per call, `[text | audio | video]` rows with their tags (text 1, audio 2,
  video 0), (t, h, w) positions and row indices from `MiniMaxH3PrepareLayoutStep.
  build_packed_sequence`, video rows from `patchify_video_latents`, audio rows channel-major
  (all latents of the left channel, then the right), row timesteps reduced to the distinct values
  by `MiniMaxH3SetTimestepsStep.build_row_timesteps` (text rows take the video timestep);
- time and velocity: H3 calls t = 1 clean and predicts v = x0 - noise. Our convention is sigma = 1
  noise and u = noise - x0, so the transformer is called at t = 1 - sigma and u = -v. Video and
  audio rows share one sigma here (the modular pipeline steps them on two grids, shift 12 and 3;
  one shared grid is a special case the transformer accepts, since it takes distinct timesteps);
- the batch axis of the H3 transformer only replicates (one set of timesteps and one text length
  per call), so samples are grouped by (sigma, prompt length) and each group is one call: a
  sampling step is one call per prompt, a training step one call per distinct (sigma, prompt);
- decoding as the decode blocks do: denormalise, the video VAE to ImageNet-normalised RGB turned
  back to [0, 1], the mono audio VAE on the two stereo channels as two batch items.

The latent of one sample is the normalised video latents [C, F', H', W'] then the audio latents
[2, C_a, T], flattened and joined. docs/research/minimax_h3.md has the derivation; tests check the
packed forward against a hand-packed call and the sampler against MiniMaxH3Scheduler.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..media import MediaBatch
from ..precision import base_weights_autocast
from ..runtime.sharding import compute_device
from .policy import Condition, split_entries
from .vae_memory import configure_vae_memory, decode_into, stored_dtype

TEXT, TEXT_LENGTH = "h3_text", "h3_text_length"
FPS = 24.0
STEREO = 2
COMPONENTS = ("transformer", "vae", "audio_vae", "text_encoder", "tokenizer")
"""The folders a local H3 directory must hold (a `scheduler` folder is optional)."""
PROMPT_CACHE = 4096
"""Encoded prompts kept (a training prompt set is encoded once)."""
LORA_MODULES = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")
"""Per main block: the shared attention projections and the SwiGLU feed-forward (the layout of the
published H3 LoRAs, without the AdaLN projections); the text refiner is left alone."""


class MiniMaxH3Policy:
    """MiniMax-H3 at a fixed clip size; see the module docstring."""

    def __init__(
        self,
        components: dict[str, Any],
        height: int = 768,
        width: int = 1344,
        num_frames: int = 124,
        text_encoder_layer: int = 50,
        max_sequence_length: int = 512,
        vae_tiling: bool | None = None,
        vae_slicing: bool = False,
        offload_text_encoder: bool = False,
    ) -> None:
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
            align_num_frames,
            audio_latent_num_frames,
            video_latent_num_frames,
        )

        self.transformer: nn.Module = components["transformer"]
        self.vae, self.audio_vae = components["vae"], components["audio_vae"]
        self.text_encoder, self.tokenizer = components["text_encoder"], components["tokenizer"]
        self.scheduler = components.get("scheduler")
        for module in (self.vae, self.audio_vae, self.text_encoder):
            module.requires_grad_(False)
        configure_vae_memory(self.vae, vae_tiling, vae_slicing)
        config = self.transformer.config
        self.patch_size = tuple(int(p) for p in config.patch_size)
        multiple = self.vae.spatial_compression_ratio * self.patch_size[2]
        if height % multiple or width % multiple:
            raise ValueError(
                f"MiniMax-H3 needs height and width divisible by {multiple}; got {height} x {width}"
            )
        per_chunk, kept = int(self.vae.config.clip_length), int(self.vae.tokens_chunk_size)
        if num_frames % per_chunk != kept or num_frames < per_chunk + kept:
            raise ValueError(
                f"MiniMax-H3 needs num_frames = {per_chunk} n + {kept} with n >= 1 (the video VAE's chunks); "
                f"got {num_frames}, the next that fits is "
                f"{align_num_frames(max(num_frames, per_chunk + kept), per_chunk, kept)}"
            )
        layers = int(self.text_encoder.config.text_config.num_hidden_layers)
        if not 0 < text_encoder_layer < layers:
            raise ValueError(
                f"text_encoder_layer={text_encoder_layer}: the conditioner has {layers} decoder layers; H3 "
                "reads an inner hidden state (50 for the released model), not the post-norm last one"
            )
        if int(config.in_channels) != int(self.vae.config.latent_channels):
            raise ValueError(
                f"the transformer takes {config.in_channels} video channels, the VAE makes "
                f"{self.vae.config.latent_channels}"
            )
        if int(config.audio_in_channels) != int(self.audio_vae.config.latent_channels):
            raise ValueError(
                f"the transformer takes {config.audio_in_channels} audio channels, the audio VAE makes "
                f"{self.audio_vae.config.latent_channels}"
            )
        ratio = self.vae.spatial_compression_ratio
        self.video_grid = (
            video_latent_num_frames(num_frames, per_chunk, kept),
            height // ratio,
            width // ratio,
        )
        self.video_channels = int(config.in_channels)
        self.audio_channels, self.audio_frames = (
            int(config.audio_in_channels),
            audio_latent_num_frames(num_frames),
        )
        self.text_encoder_layer, self.max_sequence_length = text_encoder_layer, max_sequence_length
        language_model = self.text_encoder.model.language_model
        language_model.layers = language_model.layers[: text_encoder_layer + 1]  # the rest never reach it
        self.offload_text_encoder = offload_text_encoder
        self._prompt_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.call_per_sample = False  # use_sharded_transformer() turns it on
        self.video_size = self.video_channels * int(np.prod(self.video_grid))
        self.audio_size = STEREO * self.audio_channels * self.audio_frames
        blocks = len(self.transformer.transformer_blocks)
        self.lora_target_modules = [
            f"transformer_blocks.{i}.{m}" for i in range(blocks) for m in LORA_MODULES
        ]
        self._layouts: dict[int, dict[str, torch.Tensor]] = {}
        self.base_dtype = stored_dtype(self.transformer)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (self.video_size + self.audio_size,)

    def modality_entries(self) -> dict[str, torch.Tensor]:
        """The flat latent is the video's tokens, then the audio's."""
        return split_entries({"video": self.video_size, "audio": self.audio_size})

    # ------------------------------------------------------------------ prompts
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Condition:
        """Each prompt's conditioner hidden state, zero-padded to max_sequence_length, and its length
        (each distinct prompt encoded once; the last PROMPT_CACHE are kept)."""
        device = compute_device(self.transformer)
        width = int(self.transformer.config.text_dim)
        text = torch.zeros(len(prompts), self.max_sequence_length, width, device=device)
        lengths = torch.zeros(len(prompts), dtype=torch.long, device=device)
        for i, prompt in enumerate(prompts):
            hidden = self._encode_one(prompt)
            text[i, : len(hidden)] = hidden.to(device)
            lengths[i] = len(hidden)
        return {TEXT: text, TEXT_LENGTH: lengths}

    def _encode_one(self, prompt: str) -> torch.Tensor:
        """[L, D] fp32: the prompt tokenized verbatim, hidden_states[text_encoder_layer]."""
        if prompt in self._prompt_cache:
            self._prompt_cache.move_to_end(prompt)
            return self._prompt_cache[prompt]
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not 0 < len(ids) <= self.max_sequence_length:
            raise ValueError(
                f"prompt {prompt[:60]!r} is {len(ids)} tokens; MiniMax-H3 takes 1 to "
                f"{self.max_sequence_length} here (raise model.options.max_sequence_length)"
            )
        input_ids = torch.tensor([ids], device=next(self.text_encoder.parameters()).device)
        hidden = (
            self.text_encoder.model(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                mm_token_type_ids=torch.zeros_like(input_ids),  # no vision blocks in a t2va prompt
                use_cache=False,
                output_hidden_states=True,
            )
            .hidden_states[self.text_encoder_layer][0]
            .float()
        )
        self._prompt_cache[prompt] = hidden
        while len(self._prompt_cache) > PROMPT_CACHE:
            self._prompt_cache.popitem(last=False)
        return hidden

    # ------------------------------------------------------------------ the velocity
    def use_sharded_transformer(self) -> None:
        """The transformer is sharded (runtime/sharding.py): every process must make the same number of
        transformer calls, so each sample gets its own call (how a seed-sized clip runs anyway)
        instead of one per (sigma, prompt length), whose count depends on the data."""
        self.call_per_sample = True

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat latents as video [B, C, F', H', W'] and stereo audio [B, 2, C_a, T]."""
        if x.ndim != 2 or x.shape[1] != self.video_size + self.audio_size:
            raise ValueError(
                f"MiniMax-H3 latents must be [B, {self.video_size + self.audio_size}] "
                f"(video {self.video_size} + audio {self.audio_size} for this clip size); "
                f"got {tuple(x.shape)}"
            )
        video = x[:, : self.video_size].reshape(len(x), self.video_channels, *self.video_grid)
        audio = x[:, self.video_size :].reshape(len(x), STEREO, self.audio_channels, self.audio_frames)
        return video, audio

    def layout(self, text_length: int) -> dict[str, torch.Tensor]:
        """The packed sequence's positions, tags and row indices for a prompt of `text_length`
        tokens (the modular pipeline's t2va layout), cached per length."""
        from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
            MINIMAX_H3_AUDIO_TAG,
            MINIMAX_H3_TEXT_TAG,
            MINIMAX_H3_VIDEO_TAG,
        )

        if text_length not in self._layouts:
            frames, height, width = self.video_grid
            positions, tags, video_rows, audio_rows, text_rows, _, _ = (
                MiniMaxH3PrepareLayoutStep.build_packed_sequence(
                    torch.full((text_length,), MINIMAX_H3_TEXT_TAG, dtype=torch.long),
                    frames,
                    height,
                    width,
                    self.audio_frames,
                    self.patch_size,
                    STEREO,
                    MINIMAX_H3_AUDIO_TAG,
                    MINIMAX_H3_VIDEO_TAG,
                )
            )
            self._layouts[text_length] = {
                "position_ids": positions,
                "token_tags": tags,
                "video_indices": video_rows,
                "audio_indices": audio_rows,
                "text_indices": text_rows,
            }
        return self._layouts[text_length]

    def h3_velocity(
        self, video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor, h3_time: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """H3's own velocity (x0 - noise) for samples that share one prompt length and one H3 time
        (1 = clean): video [b, C, F', H', W'], audio [b, 2, C_a, T], text [b, L, D]."""
        from diffusers.modular_pipelines.minimax_h3.before_denoise import (
            MiniMaxH3SetTimestepsStep,
            patchify_video_latents,
        )

        batch, device = len(video), video.device
        layout = {k: v.to(device) for k, v in self.layout(text.shape[1]).items()}
        timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            layout["video_indices"].cpu(), layout["audio_indices"].cpu(), 0, 0, text.shape[1], *[h3_time] * 4
        )
        features = video.shape[1] * int(np.prod(self.patch_size))
        video_rows = patchify_video_latents(video, self.patch_size).reshape(batch, -1, features)
        audio_rows = audio.permute(0, 1, 3, 2).reshape(batch, -1, self.audio_channels)
        with base_weights_autocast(self.base_dtype, device):
            video_v, audio_v = self.transformer(
                hidden_states=video_rows,
                audio_hidden_states=audio_rows,
                encoder_hidden_states=text,
                timestep=timestep.to(device),
                timestep_indices=timestep_indices.to(device),
                return_dict=False,
                **layout,
            )
        return self._unpatchify(video_v, video.shape), audio_v.reshape(
            batch, STEREO, self.audio_frames, self.audio_channels
        ).permute(0, 1, 3, 2)

    def _unpatchify(self, rows: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        pt, ph, pw = self.patch_size
        b, c, f, h, w = shape
        rows = rows.reshape(b, f // pt, h // ph, w // pw, c, pt, ph, pw)
        return rows.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(shape)

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, cond: Condition) -> torch.Tensor:
        """noise - x0 for both streams; t: [B] sigmas in [0, 1]. One transformer call per group of
        samples sharing (sigma, prompt length)."""
        video, audio = self.split(x_t)
        sigma = torch.as_tensor(t, device=x_t.device, dtype=torch.float32).reshape(-1).expand(len(x_t))
        lengths = cond[TEXT_LENGTH].tolist()
        groups: dict[tuple[float, int, int], list[int]] = {}
        for i, (s, length) in enumerate(zip(sigma.tolist(), lengths, strict=True)):
            groups.setdefault((s, length, i if self.call_per_sample else 0), []).append(i)
        out = torch.empty(len(x_t), self.video_size + self.audio_size, device=x_t.device, dtype=x_t.dtype)
        for (s, length, _), members in groups.items():
            index = torch.tensor(members, device=x_t.device)
            text = cond[TEXT][index, :length]
            video_v, audio_v = self.h3_velocity(video[index], audio[index], text, 1.0 - s)
            out[index] = -torch.cat([video_v.flatten(1), audio_v.flatten(1)], dim=1).to(x_t.dtype)
        return out

    def time_grid(self, num_steps: int, shift: float) -> torch.Tensor:
        """MiniMaxH3Scheduler's sigmas for `num_steps` model evaluations (its grid holds the final
        0): its own shift (12 for the released video schedule) unless sampling.time_shift sets one."""
        from diffusers import MiniMaxH3Scheduler

        scheduler = (
            MiniMaxH3Scheduler.from_config(self.scheduler.config) if self.scheduler else MiniMaxH3Scheduler()
        )
        if shift != 1.0:
            scheduler.set_shift(shift)
        scheduler.set_timesteps(num_steps + 1)
        if len(scheduler.sigmas) != num_steps + 1:
            raise ValueError(
                f"MiniMaxH3Scheduler merged equal sigmas at {num_steps} steps with shift {scheduler.shift}; "
                "use fewer steps or a smaller sampling.time_shift"
            )
        return scheduler.sigmas.to(torch.float32).cpu()

    # ------------------------------------------------------------------ decoding
    @torch.no_grad()
    def decode(self, x0: torch.Tensor) -> MediaBatch:
        """Frames [B, F, 3, H, W] in [0, 1] and the stereo waveform [B, 2, S] in [-1, 1]. The frames
        are held once: each decoded sample is written into them and post-processed there in place
        (with vae_slicing, each sample is decoded alone, as the VAE's own slicing decodes it)."""
        video, audio = self.split(x0.float())
        vae, audio_vae = self.vae, self.audio_vae
        mean = torch.tensor(vae.config.latents_mean, device=video.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=video.device).view(1, -1, 1, 1, 1)
        latents = (video * std + mean).to(vae.dtype)
        imagenet_mean = torch.tensor((0.485, 0.456, 0.406), device=video.device).view(1, -1, 1, 1)
        imagenet_std = torch.tensor((0.229, 0.224, 0.225), device=video.device).view(1, -1, 1, 1)

        def post_process(out: torch.Tensor, sample: torch.Tensor) -> None:
            out.copy_(sample.transpose(0, 1))  # [3, F, H, W] -> [F, 3, H, W], as float32
            out.mul_(imagenet_std).add_(imagenet_mean).clamp_(0, 1)

        frames = decode_into(lambda part: vae.decode(part, return_dict=False)[0], latents, post_process, vae)
        audio = audio.reshape(-1, self.audio_channels, self.audio_frames)
        a_mean = torch.tensor(audio_vae.config.latents_mean, device=audio.device).view(1, -1, 1)
        a_std = torch.tensor(audio_vae.config.latents_std, device=audio.device).view(1, -1, 1)
        wave = audio_vae.decode((audio * a_std + a_mean).to(audio_vae.dtype), return_dict=False)[0].float()
        wave = wave.reshape(len(x0), STEREO, -1).clamp(-1, 1)
        return MediaBatch(video=frames, audio=wave, fps=FPS, sample_rate=self.sample_rate)

    @property
    def sample_rate(self) -> int:
        return int(self.audio_vae.config.sampling_rate)

    def to(self, device: torch.device | str | None = None) -> MiniMaxH3Policy:
        """Every component on `device` (in place), the conditioner too unless offload_text_encoder
        keeps it in host memory; returns self."""
        for module in (self.transformer, self.vae, self.audio_vae):
            module.to(device)
        if not self.offload_text_encoder:
            self.text_encoder.to(device)
        return self

    @classmethod
    def from_pretrained(
        cls, source: str, dtype: torch.dtype = torch.float32, **options: Any
    ) -> MiniMaxH3Policy:
        """From a directory (or hub id) holding the component folders transformer, vae, audio_vae,
        text_encoder (Qwen3-VL), tokenizer and optionally scheduler; a local directory missing one is
        refused by name before anything loads. `dtype` (model.base_dtype) stores the transformer, the
        video VAE and the conditioner; the audio VAE stays fp32 (bf16 degrades its sound)."""
        from diffusers import (
            AutoencoderKLMiniMaxH3,
            AutoencoderKLMiniMaxH3Audio,
            MiniMaxH3Scheduler,
            MiniMaxH3Transformer3DModel,
        )
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

        from .shard_loading import load_transformer

        root = Path(source)
        if root.is_dir():
            missing = [name for name in COMPONENTS if not (root / name).is_dir()]
            if missing:
                raise ValueError(
                    f"{root} lacks the MiniMax-H3 component folder(s) {', '.join(missing)} "
                    f"(it needs {', '.join(COMPONENTS)}; scheduler is optional)"
                )
        loaded: dict[str, Any] = {
            "transformer": load_transformer(MiniMaxH3Transformer3DModel, source, "transformer", dtype),
            "vae": AutoencoderKLMiniMaxH3.from_pretrained(source, subfolder="vae", torch_dtype=dtype),
            "audio_vae": AutoencoderKLMiniMaxH3Audio.from_pretrained(source, subfolder="audio_vae"),
            "text_encoder": Qwen3VLForConditionalGeneration.from_pretrained(
                source, subfolder="text_encoder", dtype=dtype
            ),
            "tokenizer": AutoTokenizer.from_pretrained(source, subfolder="tokenizer"),
        }
        if not root.is_dir() or (root / "scheduler").is_dir():
            loaded["scheduler"] = MiniMaxH3Scheduler.from_pretrained(source, subfolder="scheduler")
        loaded["text_encoder"].eval()
        return cls(loaded, **options)
