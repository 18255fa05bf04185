"""Qwen2.5-Omni's *thinker* (transformers' `Qwen2_5OmniThinkerForConditionalGeneration`, text out) as
an answering policy: `model.family=qwen2_5_omni`, the interface of the tiny omni model (tiny_omni.py),
so rollouts, the GSPO update and the held-out evaluation run it unchanged.

A prompt is the model's chat template (the folder's own, else DEFAULT_CHAT_TEMPLATE, Qwen's layout)
around one user turn: the clip's video, its sound, then the question;
`<|vision_bos|><|VIDEO|>*n<|vision_eos|><|audio_bos|><|AUDIO|>*m<|audio_eos|>question`. The video
goes in as a *video* (pixel_values_videos / video_grid_thw, temporal patches of two frames, the
time per grid from the clip's fps), not as a list of images: that is the input the pretrained model
read, with its temporal rope positions. The frames are patched with the PIL Qwen2-VL image processor
(torchvision, which transformers' video processor needs, is not required), laid out exactly as the
video processor lays them out (docs/research/qwen_omni.md). The sound goes through the folder's
WhisperFeatureExtractor (mono, at its sampling rate: a clip at another rate is refused by the run's
clip-format check, nothing is resampled).

The media features are scattered into the input embeddings here, and the 3D (mrope) positions are
the thinker's own `get_rope_index` over the prompt; sampling and the teacher-forced recompute both
run the thinker on `inputs_embeds` with those positions (3 rows [t; h; w], the text model's
documented shape; an answer token's three rows are equal, continuing after the prompt's largest
position), so the recompute equals the sampler's log-probs. The tokenizer's special tokens other
than the end token (`<|im_end|>`) and the embedding rows past the tokenizer are never sampled, in
both.

Saved layout: the thinker (config.json, model.safetensors), the tokenizer files, one
preprocessor_config.json holding the feature extractor's and the image processor's settings (as
Qwen's own folders do) and chat_template.jinja.

Qwen3-Omni-MoE's thinker (`Qwen3OmniMoeThinkerForConditionalGeneration`, `model.family=qwen3_omni`)
is read the same way by `Qwen3OmniModel`, a subclass differing only where the thinker does: its
class, its audio token count (`_get_feat_extract_output_lengths(mel frames, n_window)`, a module
function, not the tower's method), the image processor's patch (16, read from its settings), and
its vision tower's *deepstack* features (one per `deepstack_visual_indexes` entry), which the text
model adds to the hidden states at the video positions after its first layers. Those cannot go in
through the thinker's own forward with `inputs_embeds` (it would set them from pixel values), so
the policies' `lm` (`ThinkerHead`) runs the thinker's text model and head directly,
with the deepstack features on the prompt's forward (`sample_answers(prompt_inputs=...)`) and on
the teacher-forced recompute; answer tokens get none. Its 3D positions are the thinker's own
`get_rope_index` (floats: a temporal patch of 0.25 s is 6.25 position ids at the config's
`position_id_per_seconds` of the tiny test thinker, 25; the answers continue from the largest, as
the thinker's own generation does).

LoRA (Qwen3): the language model's attention projections (q/k/v/o_proj) only. The MoE experts are
*not* adapted: they are fused 3D parameters (`mlp.experts.gate_up_proj` / `down_proj`, not
nn.Linear), which peft reaches only through `target_parameters`; this project's adapter handling
(two named adapters copied into each other, their state in checkpoints, the peft export, vLLM's
LoRA) is written for LoRA on linear modules, and nothing here tests LoRA on parameters. The router
(`mlp.gate`, a bare weight) is not adapted either.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch
import torch.utils.checkpoint
from torch import nn

from ..answer_data.clip_files import ClipFormat, width_by_height
from ..answer_data.questions import AskedQuestion
from ..runtime.deadline import call_with_deadline
from .tiny_omni import vocabulary_fingerprint

T = TypeVar("T")

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2.5-Omni's chat layout (a default system turn, one bos/eos pair around each placeholder), used
when the model's folder has no template of its own."""
QUESTION = "\x00question\x00"  # where the question's own tokens go in the rendered template
PROCESSOR_CONFIG = "preprocessor_config.json"
MAX_TEMPLATE_BYTES = 1 << 20
TEMPLATE_RENDER_S = 10.0  # a model folder's chat template renders within this (nested loops hung loading)
TEMPLATE_FILE = "chat_template.jinja"
MARKERS = ("audio", "video", "image", "audio_bos", "audio_eos", "vision_bos", "vision_eos")
"""The tokenizer attributes (`<name>_token`) naming its media placeholders and their brackets."""
OPTIONS = ("fps", "seconds", "frame_size")
"""model.options of the family: the clip's frame rate, length in seconds and square frame size."""


def _public(value: Any) -> Any:
    """A config dict without its private and version entries (they move with the install)."""
    if isinstance(value, dict):
        return {
            k: _public(v)
            for k, v in value.items()
            if not str(k).startswith("_") and k != "transformers_version"
        }
    return value


def processor_settings(feature_extractor: Any, image_processor: Any) -> dict[str, Any]:
    """The feature extractor's and the image processor's settings as one dict (what is saved)."""
    merged = {**feature_extractor.to_dict(), **image_processor.to_dict()}
    return json.loads(json.dumps(_public(merged), sort_keys=True, default=_jsonable))


def _jsonable(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else str(value)


@dataclass
class QwenPrompted:
    """Left-padded prompts: embeddings [B, P, H] (media features in), mask [B, P], the thinker's 3D
    rope positions [3, B, P] and each row's next text position [B]; for Qwen3-Omni the video
    positions [B, P] and the deepstack features at them (one [n, H] per deepstack layer)."""

    embeds: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    next_positions: torch.Tensor
    visual_mask: torch.Tensor | None = None
    deepstack: tuple[torch.Tensor, ...] = ()

    def repeated(self, k: int) -> QwenPrompted:
        """Each prompt k times in a row (a group's answers to one question about one clip): the
        towers' work done once per clip, not once per answer."""
        return self.rows(torch.arange(len(self.embeds)).repeat_interleave(k))

    def rows(self, index: torch.Tensor) -> QwenPrompted:
        """The prompts `index` names (repeats allowed), gradients flowing through the selection."""
        at = index.to(self.embeds.device)
        deepstack = self.deepstack
        if deepstack and self.visual_mask is not None:  # rows of each prompt's video positions, in order
            counts = self.visual_mask.sum(1).tolist()
            picked = index.tolist()
            deepstack = tuple(torch.cat([level.split(counts)[i] for i in picked]) for level in deepstack)
        return QwenPrompted(
            self.embeds[at],
            self.mask[at],
            self.positions[:, at],
            self.next_positions[at],
            None if self.visual_mask is None else self.visual_mask[at],
            deepstack,
        )


class QwenOmniModel(nn.Module):
    """The thinker, with its tokenizer, feature extractor and image processor attached."""

    peft_base = "thinker"  # `odrl export --format peft` writes the adapter for the bare thinker
    answer_batch = 16  # held-out questions answered at a time: full-vocabulary logits are large
    family: ClassVar[str] = "qwen2_5_omni"
    thinker_class: ClassVar[str] = "Qwen2_5OmniThinkerForConditionalGeneration"  # in transformers

    def __init__(
        self,
        thinker: nn.Module,
        tokenizer: Any,
        feature_extractor: Any,
        image_processor: Any,
        chat_template: str | None = None,
        fps: float = 2.0,
        seconds: float = 4.0,
        frame_size: int | str = 224,
    ) -> None:
        super().__init__()
        self.thinker = thinker
        self.tokenizer = tokenizer
        self.feature_extractor, self.image_processor = feature_extractor, image_processor
        template = chat_template or getattr(tokenizer, "chat_template", None)
        self.chat_template = template or DEFAULT_CHAT_TEMPLATE
        self.fps, self.seconds = float(fps), float(seconds)
        self.frame_hw = frame_height_width(frame_size)  # (height, width) the frames are resized to
        self.frame_size = frame_size if isinstance(frame_size, str) else int(frame_size)
        ClipFormat(self.fps, int(feature_extractor.sampling_rate), self.seconds)  # refuses a bad one now
        chunk = getattr(feature_extractor, "chunk_length", None)
        if chunk is not None and self.seconds > float(chunk):
            raise ValueError(
                f"seconds={self.seconds:g}: the feature extractor reads at most {chunk} s of sound a clip "
                "(its chunk_length); a longer clip would be cut. Use seconds <= chunk_length"
            )
        text = thinker.config.get_text_config()
        if len(tokenizer) > text.vocab_size:
            raise ValueError(
                f"the tokenizer has {len(tokenizer)} tokens, the thinker {text.vocab_size} embeddings"
            )
        self._vocabulary = vocabulary_fingerprint(tokenizer)
        self.system_prompt: str | None = None  # data.system_prompt (use_system_prompt); None: the template's
        self._head, self._tail = self._template_ids()
        special = {int(i) for i in tokenizer.all_special_ids} | set(self._placeholder_ids())
        special |= {int(i) for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        special.discard(self.eos_id)
        never = special | set(range(len(tokenizer), text.vocab_size))
        self.register_buffer("suppressed", torch.tensor(sorted(never), dtype=torch.long), persistent=False)
        self._special_set = frozenset(never | {self.eos_id})  # what a question may not hold
        self._media_tokens: int | None = None
        self._checkpointing = False

    # ---- memory -------------------------------------------------------------------------------
    def enable_gradient_checkpointing(self) -> None:
        """model.gradient_checkpointing: the language model's decoder layers recompute their
        activations in the backward pass (torch's non-reentrant checkpoint) instead of keeping them.
        transformers recomputes only a layer in training mode, so these layers stay in it whatever
        train() or eval() says; they hold no dropout (checked), so that changes nothing else. The
        frozen towers are left as they are."""
        text = self.thinker.config.get_text_config()
        if float(getattr(text, "attention_dropout", 0.0) or 0.0) != 0.0:
            raise ValueError(
                f"its language model has attention_dropout={text.attention_dropout}: a recompute would "
                "draw other dropout masks"
            )
        checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        for layer in self._decoder_layers():
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = checkpoint
        self._checkpointing = True
        self.train(self.training)

    def _decoder_layers(self) -> list[nn.Module]:
        return list(self.thinker.model.language_model.layers)

    def train(self, mode: bool = True) -> QwenOmniModel:
        super().train(mode)
        for layer in self._decoder_layers() if self._checkpointing else ():
            layer.training = True  # recomputed in the backward pass (enable_gradient_checkpointing)
        return self

    # ---- identity -----------------------------------------------------------------------------
    @property
    def lm(self) -> ThinkerHead:
        """What samples: the thinker's text model and head (inputs_embeds, attention_mask, 2D or 3D
        position_ids, a cache, logits_to_keep; Qwen3's deepstack features on the prompt)."""
        return ThinkerHead(self.thinker)

    @property
    def config(self) -> dict[str, Any]:
        """The model's identity for checkpoint fingerprints: the thinker's config, a hash of the
        tokenizer's vocabulary, a hash of the processors' settings and chat template, the clip."""
        settings = processor_settings(self.feature_extractor, self.image_processor)
        processor = json.dumps([settings, self.chat_template], sort_keys=True)
        return {
            "thinker": _public(self.thinker.config.to_dict()),
            "vocabulary": self._vocabulary,
            "processor": hashlib.sha256(processor.encode()).hexdigest(),
            "clip": {"fps": self.fps, "seconds": self.seconds, "frame_size": self.frame_size},
        }

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.convert_tokens_to_ids("<|endoftext|>"))

    def _token(self, name: str) -> int:
        fallback = {"audio": "<|AUDIO|>", "video": "<|VIDEO|>", "image": "<|IMAGE|>"}[name]
        token = getattr(self.tokenizer, f"{name}_token", None) or fallback
        return int(self.tokenizer.convert_tokens_to_ids(token))

    def _placeholder_ids(self) -> list[int]:
        """The media and turn markers: Qwen2.5-Omni's names and those the tokenizer names itself
        (Qwen3-Omni's `<|audio_pad|>`, `<|vision_start|>`, ...)."""
        names = ("<|AUDIO|>", "<|VIDEO|>", "<|IMAGE|>", "<|audio_bos|>", "<|audio_eos|>")
        names += ("<|vision_bos|>", "<|vision_eos|>", "<|im_start|>")
        own = (getattr(self.tokenizer, f"{k}_token", None) for k in MARKERS)
        names += tuple(t for t in own if isinstance(t, str))
        unk = self.tokenizer.unk_token_id
        return [i for i in self.tokenizer.convert_tokens_to_ids(list(names)) if i is not None and i != unk]

    # ---- text ---------------------------------------------------------------------------------
    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each question (no specials); a question holding a special token is refused."""
        out = []
        for text in texts:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if any(i in self._special_set for i in ids):
                raise ValueError(f"the question {text!r} holds a special token of the Qwen tokenizer")
            out.append(ids)
        return out

    def use_system_prompt(self, text: str | None) -> None:
        """Every prompt from now on opens with `text` as its system turn (data.system_prompt; None:
        the template's own default). A text holding a special token is a ValueError."""
        if text is not None:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if QUESTION in text or any(i in self._special_set for i in ids):
                raise ValueError("data.system_prompt holds a special token of the Qwen tokenizer")
        self.system_prompt = text
        self._head, self._tail = self._template_ids()
        self._media_tokens = None

    def _template_ids(self) -> tuple[list[int], list[int]]:
        """The chat template's token ids before and after the question, one placeholder each (a
        system turn first when one is set). The template is the model folder's (untrusted): rendered
        within TEMPLATE_RENDER_S seconds and MAX_TEMPLATE_BYTES characters, and whatever fails in it
        or in the tokenizer is a ValueError."""
        content = [{"type": "video"}, {"type": "audio"}, {"type": "text", "text": QUESTION}]
        system = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]

        def render() -> str:
            return self.tokenizer.apply_chat_template(
                [*system, {"role": "user", "content": content}],
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=True,
            )

        text = loaded("chat template", lambda: call_with_deadline(render, TEMPLATE_RENDER_S, "rendering it"))
        if not isinstance(text, str) or len(text) > MAX_TEMPLATE_BYTES:
            raise ValueError(f"the chat template rendered more than {MAX_TEMPLATE_BYTES} characters")
        if text.count(QUESTION) != 1:
            raise ValueError("the chat template does not place a user turn's text exactly once")
        head, tail = text.split(QUESTION)
        ids = loaded(
            "tokenizer",
            lambda: [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in (head, tail)],
        )
        video, audio = self._token("video"), self._token("audio")
        if ids[0].count(video) != 1 or ids[0].count(audio) != 1 or video in ids[1] or audio in ids[1]:
            raise ValueError(
                "the chat template must put one video and one audio placeholder before the question"
            )
        return ids[0], ids[1]

    def _prompt_ids(self, question: list[int], n_video: int, n_audio: int) -> list[int]:
        video, audio = self._token("video"), self._token("audio")
        head: list[int] = []
        for i in self._head:
            head += [i] * (n_video if i == video else n_audio if i == audio else 1)
        return head + list(question) + self._tail

    # ---- clips --------------------------------------------------------------------------------
    @property
    def clip_format(self) -> ClipFormat:
        """The clips the model reads: model.options' fps, seconds and frame size, the feature
        extractor's rate, mono."""
        rate = int(self.feature_extractor.sampling_rate)
        return ClipFormat(self.fps, rate, self.seconds, 1, self.frame_hw, resample=self.resample)

    @property
    def resample(self) -> str:
        """How frames are resized, as the image processor's `resample` says (PIL's 2 bilinear, 3
        bicubic: Qwen's); another filter is read as bicubic, the nearest torch has."""
        return "bilinear" if getattr(self.image_processor, "resample", 3) == 2 else "bicubic"

    def clip_tensors(self, asked: list[AskedQuestion]) -> tuple[torch.Tensor, torch.Tensor]:
        """Video [B, F, 3, H, W] (frames resized to frame_size, antialiased, as the image processor's
        `resample` says: bicubic for Qwen's) and waveforms [B, 1, samples]; a missing picture or
        sound is black frames or silence. A clip of another length (frames or samples) is refused:
        it was made at another format."""
        clip, size = self.clip_format, self.frame_hw
        videos, sounds = [], []
        for q in asked:
            frames = clip.frames if q.video is None else q.video.shape[0]
            samples = clip.samples if q.audio is None else q.audio.shape[-1]
            if (frames, samples) != (clip.frames, clip.samples):  # e.g. a tiny AVQA clip, made at its own
                raise ValueError(
                    f"a clip of {frames} frames and {samples} samples: the model reads {clip.frames} "
                    f"frames and {clip.samples} samples ({clip.fps:g} fps, {clip.sample_rate} Hz, "
                    f"{clip.seconds:g} s; model.options and data.clip_*); nothing is resampled"
                )
            video = torch.zeros(clip.frames, 3, *size) if q.video is None else q.video.float()
            if tuple(video.shape[-2:]) != size:
                video = torch.nn.functional.interpolate(video, size, mode=clip.resample, antialias=True)
            videos.append(video.clamp(0, 1))
            sounds.append(torch.zeros(1, clip.samples) if q.audio is None else q.audio[:1].float())
        return torch.stack(videos), torch.stack(sounds)

    @staticmethod
    def stored_video(video: torch.Tensor) -> torch.Tensor:
        """Frames as the image processor reads them, bytes (uint8 in [0, 255]; float frames in [0, 1]
        rounded): what a rollout keeps and the replay buffer carries, a quarter of float32's size
        and the same pixels the model reads."""
        if video.dtype == torch.uint8:
            return video
        return (video.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)

    def _video_inputs(self, video: torch.Tensor) -> dict[str, torch.Tensor]:
        """pixel_values_videos [sum t*h*w, C*tps*p*p], video_grid_thw [B, 3], video_second_per_grid [B]
        as Qwen2VLVideoProcessor makes them, from frames in [0, 1] via the image processor."""
        ip = self.image_processor
        tps, p = int(ip.temporal_patch_size), int(ip.patch_size)
        frames = self.stored_video(video).cpu()
        patches, grids = [], []
        for clip in frames:
            pictures = [f.permute(1, 2, 0).numpy() for f in clip]
            pictures += [pictures[-1]] * (-len(pictures) % tps)  # the last frame repeated, as patchify does
            out = ip(images=pictures, temporal_patch_size=1, return_tensors="np")
            _, gh, gw = (int(x) for x in out["image_grid_thw"][0])
            t = len(pictures) // tps
            pv = out["pixel_values"].reshape(t, tps, gh * gw, 3, p * p).transpose(0, 2, 3, 1, 4)
            patches.append(pv.reshape(t * gh * gw, 3 * tps * p * p))
            grids.append([t, gh, gw])
        return {
            "pixel_values_videos": torch.from_numpy(np.concatenate(patches)).to(video.device),
            "video_grid_thw": torch.tensor(grids, dtype=torch.long, device=video.device),
            "video_second_per_grid": torch.full((len(grids),), tps / self.fps, device=video.device),
        }

    def _audio_inputs(self, waveform: torch.Tensor) -> dict[str, torch.Tensor]:
        """input_features [B, mels, T] and feature_attention_mask [B, T]: the Qwen processor's call,
        padded to the longest clip of the batch (and half an FFT window of silence, which the last real
        frames' windows reach into) rather than to the extractor's chunk_length: 300 s for the 7B
        model, 30,000 mel frames a clip. The frames the mask keeps, all the towers read, are the same
        bit for bit (the extractor's per-clip maximum is a real frame's either way)."""
        features, mask = sound_features(self.feature_extractor, waveform)
        return {
            "input_features": features.to(waveform.device, self.thinker.dtype),
            "feature_attention_mask": mask.to(waveform.device),
        }

    @property
    def media_tokens(self) -> int:
        """Tokens a prompt takes besides its question (template and media placeholders)."""
        if self._media_tokens is None:
            clip = self.clip_format
            video = torch.zeros(1, clip.frames, 3, *self.frame_hw)
            n_video, n_audio = self._media_counts(
                self._video_inputs(video), self._audio_inputs(torch.zeros(1, 1, clip.samples))
            )
            self._media_tokens = len(self._prompt_ids([], n_video[0], n_audio[0]))
        return self._media_tokens

    @torch.no_grad()
    def prompt_length(self, question: list[int]) -> int:
        """The positions a prompt with this question takes: the next text position after it, which
        the 3D rope's time positions can push past the prompt's token count."""
        clip = self.clip_format
        device = next(self.parameters()).device
        video = torch.zeros(1, clip.frames, 3, *self.frame_hw, device=device)
        prompted = self.prompt(video, torch.zeros(1, clip.channels, clip.samples, device=device), [question])
        return max(math.ceil(float(prompted.next_positions.max())), self.media_tokens + len(question))

    def _media_counts(
        self, vis: dict[str, torch.Tensor], aud: dict[str, torch.Tensor]
    ) -> tuple[list[int], list[int]]:
        merge = int(self.thinker.config.vision_config.spatial_merge_size)
        n_video = (vis["video_grid_thw"].prod(-1) // merge**2).tolist()
        n_audio = self._audio_tokens(aud["feature_attention_mask"].sum(-1)).tolist()
        return [int(n) for n in n_video], [int(n) for n in n_audio]

    def _audio_tokens(self, frames: torch.Tensor) -> torch.Tensor:
        """The audio tower's output length for each clip's mel frames [B]."""
        return self.thinker.model.audio_tower._get_feat_extract_output_lengths(frames)[1]

    def _video_features(self, vis: dict[str, torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The video tower's merged features [sum n_video, H] (no deepstack features: Qwen2.5)."""
        out = self.thinker.model.get_video_features(
            vis["pixel_values_videos"], vis["video_grid_thw"], return_dict=True
        )
        return torch.cat(out.pooler_output), ()

    # ---- prompts and log-probs ----------------------------------------------------------------
    def prompt(self, video: torch.Tensor, waveform: torch.Tensor, questions: list[list[int]]) -> QwenPrompted:
        """The chat prompts of a batch, left-padded: embeddings with the media features scattered in
        and the thinker's 3D rope positions."""
        vis, aud = self._video_inputs(video), self._audio_inputs(waveform)
        n_video, n_audio = self._media_counts(vis, aud)
        rows = [self._prompt_ids(q, v, a) for q, v, a in zip(questions, n_video, n_audio, strict=True)]
        width = max(map(len, rows))
        device = video.device
        ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        inner = self.thinker.model
        embeds = self.thinker.get_input_embeddings()(ids)
        sound = inner.get_audio_features(
            aud["input_features"], aud["feature_attention_mask"], return_dict=True
        ).last_hidden_state
        pictures, deepstack = self._video_features(vis)
        for token, features in ((self._token("audio"), sound), (self._token("video"), pictures)):
            where = (ids == token).unsqueeze(-1)
            embeds = embeds.masked_scatter(where, features.to(embeds.dtype))
        positions, _ = inner.get_rope_index(
            ids,
            None,
            vis["video_grid_thw"],
            mask,
            False,
            aud["feature_attention_mask"].sum(-1),
            vis["video_second_per_grid"],
        )
        next_positions = positions.amax(0).masked_fill(mask == 0, -1).amax(-1) + 1
        visual = (ids == self._token("video")) if deepstack else None
        deep = tuple(f.to(embeds.dtype) for f in deepstack)
        return QwenPrompted(embeds, mask, positions.to(device), next_positions.to(device), visual, deep)

    def sampling_options(self, prompted: QwenPrompted) -> dict[str, Any]:
        """What `text_sampling.sample_answers` takes besides the embeddings for this model."""
        options = {
            "positions": prompted.positions,
            "next_positions": prompted.next_positions,
            "suppress_ids": self.suppressed,
        }
        if prompted.deepstack:  # Qwen3-Omni: the prompt's forward adds them at the video positions
            options["prompt_inputs"] = {
                "visual_pos_masks": prompted.visual_mask,
                "deepstack_visual_embeds": list(prompted.deepstack),
            }
        return options

    def answer_log_probs(
        self,
        prompted: QwenPrompted,
        answers: torch.Tensor,
        answer_mask: torch.Tensor,
        temperature: float = 1.0,
        min_new_tokens: int = 0,
    ) -> torch.Tensor:
        """[B, L] log pi(answer token | clip, question, answer so far), teacher-forced in one pass at
        the sampler's positions, under the sampler's distribution (the suppressed tokens and, before
        `min_new_tokens`, the end token excluded); 0 on padding."""
        from ..experience.text_sampling import token_log_probs

        length = answers.shape[1]
        embeds = torch.cat([prompted.embeds, self.thinker.get_input_embeddings()(answers)], dim=1)
        mask = torch.cat([prompted.mask, answer_mask.long()], dim=1)
        steps = torch.arange(length, device=answers.device)
        after = (prompted.next_positions[:, None] + steps).unsqueeze(0).expand(3, -1, -1)
        positions = torch.cat([prompted.positions, after.to(prompted.positions.dtype)], dim=2)
        extra: dict[str, Any] = {}
        if prompted.deepstack:  # the answer tokens are no video positions
            visual = torch.cat([prompted.visual_mask, torch.zeros_like(answer_mask, dtype=torch.bool)], 1)
            extra = {"visual_pos_masks": visual, "deepstack_visual_embeds": list(prompted.deepstack)}
        logits = self.lm(  # the head on the answer's positions only (and the prompt's last)
            inputs_embeds=embeds,
            attention_mask=mask,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=length + 1,
            **extra,
        ).logits
        logits = logits[:, :-1].float()
        logits[..., self.suppressed] = float("-inf")
        if min_new_tokens > 0:
            logits[:, :min_new_tokens, self.eos_id] = float("-inf")
        logp = token_log_probs(logits, answers, temperature)
        # 0 after the answer, as the sampler records it (the padding token is a suppressed one: -inf)
        return torch.where(answer_mask.bool(), logp, torch.zeros_like(logp))

    # ---- saving and loading -------------------------------------------------------------------
    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.thinker.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        settings = processor_settings(self.feature_extractor, self.image_processor)
        (path / PROCESSOR_CONFIG).write_text(json.dumps(settings, indent=1, sort_keys=True))
        (path / TEMPLATE_FILE).write_text(self.chat_template)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, **options: Any
    ) -> QwenOmniModel:
        """A folder (or hub id) with the thinker, its tokenizer and preprocessor_config.json;
        `options` are model.options (fps, seconds, frame_size)."""
        import transformers
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, WhisperFeatureExtractor

        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"unknown options {unknown} for {cls.family}; it takes {', '.join(OPTIONS)}")
        source = str(path)
        check_preprocessor_config(source)  # before any library reads its numbers
        tokenizer = loaded("tokenizer", lambda: AutoTokenizer.from_pretrained(source))
        feature_extractor = loaded(
            "feature extractor", lambda: WhisperFeatureExtractor.from_pretrained(source)
        )
        image_processor = loaded("image processor", lambda: Qwen2VLImageProcessorPil.from_pretrained(source))
        thinker_class = getattr(transformers, cls.thinker_class)
        thinker = thinker_class.from_pretrained(
            source,
            dtype=dtype,
            use_safetensors=True,  # never unpickles weights
        ).eval()
        template = _chat_template(source)
        return cls(thinker, tokenizer, feature_extractor, image_processor, template, **options)


def loaded(what: str, load: Callable[[], T]) -> T:
    """`load()` of a part of an untrusted model folder; whatever it raises (a library's own error, a
    MemoryError, a Rust panic of the tokenizers library, which is a BaseException) is a ValueError
    naming the part, which the model loader turns into a sentence naming the folder."""
    try:
        return load()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - pyo3's PanicException derives from BaseException
        raise ValueError(f"its {what} cannot be used ({type(e).__name__}: {str(e)[:300]})") from None


# preprocessor_config.json's numbers, each a whole number in its range, checked before a library
# computes anything from them (a huge n_fft allocated terabytes, a hop_length of 0 divided by zero)
PROCESSOR_BOUNDS = {
    "sampling_rate": (1, 192_000),
    "hop_length": (1, 1 << 16),
    "n_fft": (1, 1 << 16),
    "feature_size": (1, 1024),
    "chunk_length": (1, 3600),
    "n_samples": (1, 192_000 * 3600),
    "nb_max_frames": (1, 1 << 24),
    "patch_size": (1, 1024),
    "temporal_patch_size": (1, 64),
    "merge_size": (1, 64),
    "min_pixels": (1, 1 << 28),
    "max_pixels": (1, 1 << 28),
}
MAX_PROCESSOR_CONFIG_BYTES = 1 << 20


def frame_height_width(frame_size: int | str) -> tuple[int, int]:
    """model.options.frame_size as (height, width): a number is a square side, "WIDTHxHEIGHT" (text)
    keeps a clip's aspect ratio (the size Qwen's processor reads it at: `processor_frame_size`)."""
    if isinstance(frame_size, str):
        size = width_by_height(frame_size, "frame_size (a number of pixels, or WIDTHxHEIGHT)")
    elif (
        isinstance(frame_size, bool)
        or not isinstance(frame_size, int | float)
        or frame_size != int(frame_size)
    ):
        raise ValueError(
            f"frame_size={frame_size!r}: a whole number of pixels, or WIDTHxHEIGHT such as 84x56"
        )
    else:
        size = (int(frame_size), int(frame_size))
    if not all(1 <= side <= 4096 for side in size):
        raise ValueError(f"frame_size={frame_size!r}: each side 1 to 4096 pixels")
    return size


def processor_frame_size(height: int, width: int, image_processor: Any) -> tuple[int, int]:
    """The (height, width) Qwen's image processor resizes a height x width frame to: each side
    rounded to a multiple of its patch times its merge size, the area then brought within its
    min_pixels and max_pixels (shortest_edge / longest_edge) keeping the aspect ratio."""
    factor = int(image_processor.patch_size) * int(image_processor.merge_size)
    size = image_processor.size
    least = (
        getattr(size, "shortest_edge", None)
        or getattr(image_processor, "min_pixels", None)
        or factor * factor
    )
    most = getattr(size, "longest_edge", None) or getattr(image_processor, "max_pixels", None) or 1 << 28
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > most:
        shrink = math.sqrt(height * width / most)
        h = max(factor, math.floor(height / shrink / factor) * factor)
        w = max(factor, math.floor(width / shrink / factor) * factor)
    elif h * w < least:
        grow = math.sqrt(least / (height * width))
        h, w = math.ceil(height * grow / factor) * factor, math.ceil(width * grow / factor) * factor
    return h, w


def sound_features(feature_extractor: Any, waveform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whisper features [B, mels, T] of waveforms [B, C, S] (channels mixed) and their mask [B, T],
    padded to the longest clip plus half an FFT window of silence (QwenOmniModel._audio_inputs)."""
    fe = feature_extractor
    sounds = [w.detach().float().mean(0).cpu().numpy() for w in waveform]
    silence = int(fe.n_fft) // 2
    with torch.autocast("cpu", enabled=False):  # the extractor's own torch STFT, in fp32
        out = fe(
            [np.pad(s, (0, silence)) for s in sounds],
            sampling_rate=fe.sampling_rate,
            padding="longest",
            return_tensors="pt",
        )
    hop = int(fe.hop_length)
    frames = torch.tensor([-(-len(s) // hop) for s in sounds])  # as the extractor's own mask counts
    mask = (torch.arange(int(frames.max()))[None] < frames[:, None]).long()
    return out["input_features"][..., : mask.shape[1]], mask


def declared_clip_format(source: str, options: dict[str, Any]) -> ClipFormat | None:
    """The clips the model in `source` will read, from model.options (or the model's defaults) and
    preprocessor_config.json's sampling rate, without loading it; None when the file is not there
    (the loaders then name what is missing). A ValueError when the file is out of bounds."""
    import inspect

    settings = check_preprocessor_config(source)
    if settings is None or "sampling_rate" not in settings:
        return None
    defaults = {k: p.default for k, p in inspect.signature(QwenOmniModel.__init__).parameters.items()}
    fps, seconds, size = (options.get(k, defaults[k]) for k in OPTIONS)
    rate = int(settings["sampling_rate"])
    return ClipFormat(float(fps), rate, float(seconds), 1, frame_height_width(size))


def check_preprocessor_config(source: str) -> dict[str, Any] | None:
    """A ValueError naming the first of preprocessor_config.json's numbers out of PROCESSOR_BOUNDS
    (its size's edges included); a folder without the file is left to the loaders' own error (None).
    The checked settings otherwise."""
    from ..bounded_json import loads_bounded
    from ..checkpoint import read_bounded

    path = _folder_file(source, PROCESSOR_CONFIG)
    if path is None:
        return None
    raw = loads_bounded(read_bounded(path, MAX_PROCESSOR_CONFIG_BYTES), 8, f"{PROCESSOR_CONFIG}")
    if not isinstance(raw, dict):
        raise ValueError(f"{PROCESSOR_CONFIG} is not a JSON object")
    size = raw.get("size") if isinstance(raw.get("size"), dict) else {}
    numbers = {
        **{k: raw[k] for k in PROCESSOR_BOUNDS if k in raw},
        **{f"size.{k}": v for k, v in size.items()},
    }
    for key, value in numbers.items():
        low, high = PROCESSOR_BOUNDS.get(key, (1, 1 << 28))
        if type(value) is not int or not low <= value <= high:
            raise ValueError(
                f"{PROCESSOR_CONFIG}: {key}={str(value)[:40]} must be a whole number from {low} to {high}"
            )
    return raw


def _folder_file(source: str, name: str) -> Path | None:
    """`name` in a model folder, or in a hub id's files (the local cache when offline); None if absent."""
    if Path(source).exists():
        return Path(source) / name if (Path(source) / name).is_file() else None
    from transformers.utils import cached_file

    try:
        found = cached_file(source, name, _raise_exceptions_for_missing_entries=False)
    except OSError:
        return None
    return Path(found) if found else None


def _chat_template(source: str) -> str | None:
    """The model's own chat template (chat_template.jinja, else chat_template.json's), read with a
    size bound, from a folder or a hub id; None when it has none (DEFAULT_CHAT_TEMPLATE is used)."""
    from ..checkpoint import read_bounded

    jinja = _folder_file(source, TEMPLATE_FILE)
    if jinja is not None:
        return read_bounded(jinja, MAX_TEMPLATE_BYTES).decode("utf-8")
    packed = _folder_file(source, "chat_template.json")
    if packed is None:
        return None
    raw = json.loads(read_bounded(packed, MAX_TEMPLATE_BYTES))
    template = raw.get("chat_template") if isinstance(raw, dict) else None
    return template if isinstance(template, str) else None


LM_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_PROJECTIONS = LM_PROJECTIONS[:4]


def language_model_targets(thinker: nn.Module, names: tuple[str, ...] = LM_PROJECTIONS) -> tuple[str, ...]:
    """LoRA targets naming each attention and MLP projection of the language model's layers by its
    path under the thinker (so they match under this wrapper and on the bare thinker, where peft
    loads an export), and nothing in the audio or vision towers, whose layers share those names."""
    out = []
    for name, module in thinker.named_modules():
        in_language_model = name.startswith("model.language_model.layers.")
        if in_language_model and name.rsplit(".", 1)[-1] in names and isinstance(module, nn.Linear):
            out.append(name)
    return tuple(out)


class QwenOmniPolicy:
    """The thinker as the trainer's policy: LoRA on the language model's attention and MLP
    projections only (the audio and vision towers stay frozen and unadapted)."""

    kind = "answers"
    model_class: ClassVar[type[QwenOmniModel]] = QwenOmniModel
    lora_names: ClassVar[tuple[str, ...]] = LM_PROJECTIONS

    def __init__(self, model: QwenOmniModel) -> None:
        self.model = model.requires_grad_(False)
        self.transformer = model  # what LoRA, the fingerprint and the optimizer see
        self.tokenizer = model.tokenizer
        self.lora_targets = language_model_targets(model.thinker, self.lora_names)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, **options: Any
    ) -> QwenOmniPolicy:
        return cls(cls.model_class.from_pretrained(path, dtype, **options))

    def to(self, device: torch.device | str) -> QwenOmniPolicy:
        self.model.to(device)
        return self


class ThinkerHead:
    """A Qwen thinker as the sampler and the recompute call it: its text model on `inputs_embeds` (or
    answer token ids), with Qwen3-Omni's deepstack features at the video positions when given (the
    prompt's forward), a KV cache, and `.logits` / `.cache` out; the head (full-vocabulary logits)
    only on the last `logits_to_keep` positions when that is given (the sampler needs the prompt's
    last, the recompute the answer's). Not a module of its own: the thinker's parameters stay the
    thinker's (LoRA, checkpoints, export see them there)."""

    def __init__(self, thinker: nn.Module) -> None:
        self.thinker = thinker

    @property
    def config(self) -> Any:
        return self.thinker.config

    def __call__(self, **inputs: Any) -> SimpleNamespace:
        return self.forward(**inputs)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cache: Any = None,
        visual_pos_masks: torch.Tensor | None = None,
        deepstack_visual_embeds: list[torch.Tensor] | None = None,
        logits_to_keep: int = 0,
    ) -> SimpleNamespace:
        extra = {}
        if deepstack_visual_embeds is not None:
            extra = {"visual_pos_masks": visual_pos_masks, "deepstack_visual_embeds": deepstack_visual_embeds}
        out = self.thinker.model.language_model(
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            cache=cache,
            **extra,
        )
        hidden = out.last_hidden_state
        return SimpleNamespace(logits=self.thinker.lm_head(hidden[:, -logits_to_keep:]), cache=out.cache)


class Qwen3OmniModel(QwenOmniModel):
    """Qwen3-Omni-MoE's thinker (`model.family=qwen3_omni`): as QwenOmniModel, with its own audio
    token count and the vision tower's deepstack features (module docstring)."""

    family: ClassVar[str] = "qwen3_omni"
    thinker_class: ClassVar[str] = "Qwen3OmniMoeThinkerForConditionalGeneration"

    def _audio_tokens(self, frames: torch.Tensor) -> torch.Tensor:
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            _get_feat_extract_output_lengths,
        )

        return _get_feat_extract_output_lengths(frames, int(self.thinker.config.audio_config.n_window))

    def _video_features(self, vis: dict[str, torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The merged features [sum n_video, H] and one deepstack feature [sum n_video, H] per
        deepstack layer, rows in the order of the video positions over the batch."""
        out = self.thinker.model.get_video_features(
            vis["pixel_values_videos"], vis["video_grid_thw"], return_dict=True
        )
        deepstack = tuple(torch.cat(level) for level in out.deepstack_features)
        return torch.cat(out.pooler_output), deepstack


class Qwen3OmniPolicy(QwenOmniPolicy):
    """Qwen3-Omni-MoE's thinker as the trainer's policy: LoRA on the language model's attention
    projections only (the MoE experts, the router and the towers stay frozen and unadapted)."""

    model_class: ClassVar[type[QwenOmniModel]] = Qwen3OmniModel
    lora_names: ClassVar[tuple[str, ...]] = ATTENTION_PROJECTIONS
