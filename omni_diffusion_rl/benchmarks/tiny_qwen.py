"""A tiny random-init Qwen2.5-Omni thinker saved as the qwen2_5_omni family reads it (the recipe of
docs/research/qwen_omni.md; the tests' model, and the tokenizer the memory trace's full-size thinker
is built around): a byte-level BPE tokenizer trained in memory with Qwen's special tokens
and chat template, a 2-layer thinker with one-layer audio and vision towers, a WhisperFeatureExtractor
and the PIL Qwen2-VL image processor. Nothing is downloaded.

The feature extractor's sampling rate is 8000 Hz (not Qwen's 16000) so that the model's clip format
is the shipped question files' (recipes/data/tiny_avqa_files: 8000 Hz mono WAVs, 8 fps MP4s, 0.5 s):
nothing resamples audio, a run refuses a clip format its model does not read. With `seven_b=True`
the same tiny thinker reads sound and frames as Qwen2.5-Omni-7B's processors do (16 kHz, 128 mels,
300 s chunks; its pixel bounds), for the real recipes' clip format and for measuring costs that grow
with those settings.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
]
CORPUS = [
    "You are a helpful assistant.",
    "system user assistant",
    "what colour is the shape ? options : red green blue yellow purple cyan",
    "which shape is shown ? options : circle square",
    "is the tone low mid or high ? does the sound start early or late ?",
]


MARKERS = {  # the tokenizer attributes naming the media markers, and Qwen2.5-Omni's names for them
    "audio_token": "<|AUDIO|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
}


QWEN3_MARKERS = {  # Qwen3-Omni's names for the media markers, by the tokenizer attribute naming each
    "audio_token": "<|audio_pad|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
}


def build_tokenizer(extra_words: tuple[str, ...] = (), markers: dict[str, str] | None = None) -> object:
    """The byte-level BPE tokenizer with the chat template; `markers` renames the media markers
    (attribute -> name; Qwen3-Omni's names differ), in the special tokens and the template alike."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ..models.qwen_omni import DEFAULT_CHAT_TEMPLATE

    names = MARKERS | (markers or {})

    def renamed(text: str) -> str:
        for attribute, old in MARKERS.items():
            text = text.replace(old, names[attribute])
        return text

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[*map(renamed, SPECIALS), *extra_words],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        chat_template=renamed(DEFAULT_CHAT_TEMPLATE),
        **names,
    )


WHISPER_7B = {  # Qwen2.5-Omni-7B's feature extractor settings
    "feature_size": 128,
    "sampling_rate": 16_000,
    "hop_length": 160,
    "chunk_length": 300,
    "n_fft": 400,
}
PIXELS_7B = {"shortest_edge": 3136, "longest_edge": 12845056}  # its image processor's pixel bounds


def build_thinker(tokenizer: object, mel_bins: int = 32) -> object:
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids  # type: ignore[attr-defined]
    hidden = 32  # head_dim 32 / 2 heads = 16: mrope sections sum to 8
    config = Qwen2_5OmniThinkerConfig(
        text_config=dict(
            vocab_size=len(tokenizer),  # type: ignore[arg-type]
            hidden_size=hidden,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
            tie_word_embeddings=False,
            eos_token_id=ids("<|im_end|>"),
            pad_token_id=ids("<|endoftext|>"),
        ),
        audio_config=dict(
            num_mel_bins=mel_bins,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=32,
            d_model=16,
            output_dim=hidden,
            n_window=50,
            max_source_positions=1500,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            in_channels=3,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            out_hidden_size=hidden,
            fullatt_block_indexes=[0],
        ),
        **thinker_token_ids(tokenizer),
    )
    return Qwen2_5OmniThinkerForConditionalGeneration(config).eval()


def thinker_token_ids(tokenizer: object) -> dict[str, int]:
    """The thinker config's media and turn token ids in `tokenizer` (Qwen2.5-Omni's marker names),
    and its rope timing (25 positions a second, 2-second chunks)."""
    ids = tokenizer.convert_tokens_to_ids  # type: ignore[attr-defined]
    return {
        "audio_token_index": ids("<|AUDIO|>"),
        "image_token_index": ids("<|IMAGE|>"),
        "video_token_index": ids("<|VIDEO|>"),
        "audio_start_token_id": ids("<|audio_bos|>"),
        "audio_end_token_id": ids("<|audio_eos|>"),
        "vision_start_token_id": ids("<|vision_bos|>"),  # read by get_rope_index, not a declared field
        "vision_end_token_id": ids("<|vision_eos|>"),
        "user_token_id": ids("<|im_start|>"),
        "position_id_per_seconds": 25,
        "seconds_per_chunk": 2,
    }


def qwen3_thinker_token_ids(tokenizer: object) -> dict[str, int]:
    """Qwen3-Omni's thinker config's media and turn token ids in `tokenizer` (its marker names,
    QWEN3_MARKERS), and its rope timing (25 positions a second)."""
    ids = tokenizer.convert_tokens_to_ids  # type: ignore[attr-defined]
    fields = {
        "audio_token_id": "audio_token",
        "image_token_id": "image_token",
        "video_token_id": "video_token",
        "audio_start_token_id": "audio_bos_token",
        "audio_end_token_id": "audio_eos_token",
        "vision_start_token_id": "vision_bos_token",
        "vision_end_token_id": "vision_eos_token",
    }
    marks = {field: ids(QWEN3_MARKERS[attribute]) for field, attribute in fields.items()}
    return marks | {"user_token_id": ids("<|im_start|>"), "position_id_per_seconds": 25}


def build_processors(
    sampling_rate: int = 8000, patch_size: int = 14, seven_b: bool = False
) -> tuple[object, object]:
    """The feature extractor and image processor: tiny ones, or with `seven_b` Qwen2.5-Omni-7B's
    settings (WHISPER_7B, PIXELS_7B; `sampling_rate` is then the 7B's)."""
    from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor

    if seven_b:
        audio = WhisperFeatureExtractor(**WHISPER_7B)
        pixels = PIXELS_7B
    else:
        audio = WhisperFeatureExtractor(
            feature_size=32, sampling_rate=sampling_rate, hop_length=80, n_fft=400, chunk_length=1
        )
        pixels = {"shortest_edge": (2 * patch_size) ** 2, "longest_edge": (4 * patch_size) ** 2}
    image = Qwen2VLImageProcessorPil(patch_size=patch_size, temporal_patch_size=2, merge_size=2, size=pixels)
    return audio, image


def save_tiny_qwen_omni(
    path: Path, extra_words: tuple[str, ...] = (), seed: int = 0, seven_b: bool = False
) -> Path:
    """The tiny thinker, its tokenizer and processors in `path` (QwenOmniModel.save_pretrained);
    `seven_b`: the processors (and the audio tower's mel bins) of Qwen2.5-Omni-7B."""
    from ..models.qwen_omni import QwenOmniModel

    torch.manual_seed(seed)
    tokenizer = build_tokenizer(extra_words)
    mel_bins = WHISPER_7B["feature_size"] if seven_b else 32
    thinker = build_thinker(tokenizer, mel_bins)
    return save_model(path, QwenOmniModel, tokenizer, thinker, build_processors(seven_b=seven_b))


def save_model(
    path: Path, model_class: type, tokenizer: object, thinker: object, processors: tuple[object, object]
) -> Path:
    """A tiny thinker saved by its family's model class, its end token made likely enough that some
    answers finish before the limit."""
    with torch.no_grad():
        thinker.lm_head.weight[tokenizer.eos_token_id] *= 40.0  # type: ignore[attr-defined,index]
    model_class(thinker, tokenizer, *processors, seconds=0.5).save_pretrained(path)
    return path
