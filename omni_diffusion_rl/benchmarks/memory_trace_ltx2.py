"""LTX-2's ltx2_av_nft recipe traced per rank without a GPU (the method of memory_trace.py): a training
micro-step and a forward without gradients through the project's LTX2Policy.velocity over the released
transformer, sharded over N fake ranks; the decode of a rank's clips (LTX2Policy.decode) through the
released VAEs and vocoder; and the prompt encoding (LTX2Policy.encode_prompts) through the released
Gemma 3 12B text encoder and connectors, which every rank holds whole.

Each runs on real tensors too (`tiny`, `fake=False`), and a test compares the two.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..precision import default_dtype
from .memory_tracing import (
    GIB,
    SEED_RANKS,
    WholeCallTracker,
    check_trace_device,
    fake_process_group,
    peak_on,
    step_report,
    traced_step,
)


@dataclass(frozen=True)
class Ltx2Case:
    """LTX-2's clip size, adapter and layout (the ltx2_av_nft recipe); `tiny`: the tiny random-init
    pipeline that really runs here, at its own clip size."""

    name: str = "ltx2_av_nft (seed layout)"
    ranks: int = SEED_RANKS
    frames: int = 121
    height: int = 512
    width: int = 768
    frame_rate: float = 24.0
    text_tokens: int = 1024  # the recipe's max_sequence_length
    lora_rank: int = 64
    gradient_checkpointing: bool = True
    tiny: bool = False
    transformer: dict[str, Any] = field(default_factory=dict)  # overrides of the released config
    vae_slicing: bool = True  # the recipe's model.options: decode a clip at a time


LTX2_RANK_CLIPS = 16
"""The clips one rank of the ltx2_av_nft recipe decodes a step (a group of 16, one group per rank)."""

TINY_LTX2 = Ltx2Case(
    name="tiny LTX-2",
    ranks=2,
    frames=9,
    height=32,
    width=32,
    frame_rate=25.0,
    text_tokens=16,
    lora_rank=4,
    tiny=True,
)


def _released_text_encoder() -> Any:
    """Gemma 3 12B as LTX-2 loads it (Gemma3ForConditionalGeneration: the language model of its
    published shape and its SigLIP vision tower, transformers' defaults), on the meta device."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from .memory import gemma3_12b_text_config

    config = Gemma3Config(text_config=gemma3_12b_text_config().to_dict())
    with torch.device("meta"), default_dtype(torch.bfloat16):
        return Gemma3ForConditionalGeneration(config).eval()


def _ltx2_policy(case: Ltx2Case, released_text_encoder: bool = False) -> Any:
    """LTX2Policy at `case`'s clip size over the released transformer (meta device, bf16), VAEs,
    connectors and vocoder (their configs only), beside the tiny Gemma text encoder and tokenizer
    (or, `released_text_encoder`, Gemma 3 12B on meta and the tiny tokenizer); or over the tiny
    pipeline."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder

    from ..models.ltx2 import LTX2Policy
    from .tiny_families import tiny_ltx2_pipeline

    tiny = tiny_ltx2_pipeline()
    clip = {
        "height": case.height,
        "width": case.width,
        "num_frames": case.frames,
        "frame_rate": case.frame_rate,
    }
    clip["vae_slicing"] = case.vae_slicing
    if case.tiny:
        return LTX2Policy(tiny, **clip, max_sequence_length=case.text_tokens)
    with torch.device("meta"), default_dtype(torch.bfloat16):  # the recipe's base_dtype, every component's
        transformer = LTX2VideoTransformer3DModel(**case.transformer)
        released = {  # the released video VAE compresses 32x in space and 8x in time (its config says
            # so; the class's defaults would report 64x and 16x): docs/research/ltx2_pipeline.md
            "vae": AutoencoderKLLTX2Video(spatial_compression_ratio=32, temporal_compression_ratio=8),
            "audio_vae": AutoencoderKLLTX2Audio(),
            "connectors": LTX2TextConnectors(),
            "vocoder": LTX2Vocoder(),
        }
    pipeline = LTX2Pipeline(
        scheduler=tiny.scheduler,
        text_encoder=_released_text_encoder() if released_text_encoder else tiny.text_encoder,
        tokenizer=tiny.tokenizer,
        transformer=transformer,
        **released,
    )
    return LTX2Policy(pipeline, **clip, max_sequence_length=case.text_tokens)


def trace_ltx2_update(
    case: Ltx2Case, fake: bool = True, train: bool = True, device: str = "cpu"
) -> dict[str, Any]:
    """Peak bytes of rank 0 over one LTX-2 micro-step (or, `train=False`, one forward without
    gradients) of one sample through LTX2Policy.velocity, sharded over `case.ranks` fake ranks
    (FSDPMemTracker's categories, GiB); `device`: where a real run computes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..models.lora import add_nft_adapters
    from ..models.ltx2 import AUDIO_CONTEXT, CONTEXT_MASK, VIDEO_CONTEXT
    from ..runtime.sharding import process_group_mesh, shard_module, shard_units

    device = check_trace_device(fake, device)
    with fake_process_group(case.ranks, "trace_ltx2_update"):
        policy = _ltx2_policy(case)
        model = policy.transformer.requires_grad_(False)
        with torch.device("meta") if not case.tiny else contextlib.nullcontext():
            add_nft_adapters(model, case.lora_rank, 2 * case.lora_rank, list(policy.lora_target_modules))
        if case.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        shard_module(
            model, shard_units(model), process_group_mesh(None, torch.device(device)), cpu_offload=False
        )
        model.to("meta")  # the tiny one's storage too: placed below, as the released one's
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.device(device):
            model.to_empty(device=device)  # the values do not matter to the bytes held
            x_t = torch.randn(1, *policy.latent_shape)
            width = int(
                model.config.caption_channels
            )  # both prompt streams, as the transformer projects them
            cond = {
                VIDEO_CONTEXT: torch.randn(1, case.text_tokens, width, dtype=policy.base_dtype),
                AUDIO_CONTEXT: torch.randn(1, case.text_tokens, width, dtype=policy.base_dtype),
                CONTEXT_MASK: torch.ones(1, case.text_tokens, dtype=torch.long),
            }

            def forward() -> Sequence[torch.Tensor]:
                return (policy.velocity(x_t, torch.full((1,), 0.5), cond),)

            peak = traced_step(model, [x_t, *cond.values()], forward, train, device)
        return step_report(case, fake, train, model, peak)


def trace_ltx2_decode(case: Ltx2Case, samples: int, fake: bool = True) -> dict[str, Any]:
    """Peak bytes of one rank over LTX2Policy.decode of `samples` clips at `case`'s size (GiB,
    MemTracker's categories): the released video and audio VAEs and vocoder in bf16 (`_ltx2_policy`:
    the recipe's base_dtype loads every component so), the float32 frames and waveforms, every
    temporary."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    policy = _ltx2_policy(case)
    pipe = policy.pipeline
    decoders = (pipe.vae, pipe.audio_vae, pipe.vocoder)
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        if not case.tiny:
            for module in decoders:
                module.to_empty(device="cpu")
        latents = torch.randn(samples, *policy.latent_shape)
        tracker = WholeCallTracker()
        tracker.track_external(*decoders, latents)
        with tracker:
            media = policy.decode(latents)
        peak = tracker.get_tracker_snapshot("peak")
    return {
        "case": asdict(case),
        "samples": samples,
        "fake_tensors": fake,
        "vae_parameters_b": sum(p.numel() for p in pipe.vae.parameters()) / 1e9,
        "frames_gib": media.video.numel() * media.video.element_size() / GIB,
        "peak_gib": {str(k): v / GIB for k, v in peak_on(peak).items()},
    }


def trace_ltx2_prompts(case: Ltx2Case, prompts: int = 1, fake: bool = True) -> dict[str, Any]:
    """Peak bytes of one rank over LTX2Policy.encode_prompts of `prompts` distinct prompts (a rollout
    encodes each once, then repeats it for its group), padded to `case.text_tokens` as the pipeline
    pads them: the text encoder (Gemma 3 12B in bf16, whole on every rank) and the connectors'
    weights, every layer's hidden states the pipeline stacks, and the two prompt streams it returns
    (GiB, MemTracker's categories)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    policy = _ltx2_policy(case, released_text_encoder=not case.tiny)
    pipe = policy.pipeline
    encoders = (pipe.text_encoder, pipe.connectors)
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        if not case.tiny:  # every component (the pipeline places its inputs where the first one is)
            for module in (*encoders, pipe.transformer, pipe.vae, pipe.audio_vae, pipe.vocoder):
                module.to_empty(device="cpu")
        tracker = WholeCallTracker()
        tracker.track_external(*encoders)
        with tracker, torch.no_grad():
            cond = policy.encode_prompts([f"a drum is struck {i} times" for i in range(prompts)])
        peak = tracker.get_tracker_snapshot("peak")
    return {
        "case": asdict(case),
        "prompts": prompts,
        "fake_tensors": fake,
        "text_encoder_parameters_b": sum(p.numel() for p in pipe.text_encoder.parameters()) / 1e9,
        "condition_gib": sum(v.numel() * v.element_size() for v in cond.values()) / GIB,
        "peak_gib": {str(k): v / GIB for k, v in peak_on(peak).items()},
    }
