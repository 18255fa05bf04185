"""A tiny random-init Qwen3-Omni-MoE thinker saved as the qwen3_omni family reads it (the recipe of
docs/research/qwen_omni.md section 5, docs/research/scripts/qwen_omni/qwen3_probe.py): the tokenizer
of tests/qwen_omni_tiny.py with Qwen3-Omni's names for the media markers (`<|audio_pad|>`,
`<|vision_start|>`, ...; the tokenizer names them, the chat template uses them), its feature
extractor (8000 Hz, the shipped question files' rate), a
2-layer MoE text model (4 experts, 2 a token, q/k norm, interleaved mrope), a 2-block vision tower
with patch 16, learned position embeddings and one deepstack layer, a 1-layer audio encoder, and
the PIL Qwen2-VL image processor with patch 16. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .qwen_omni_tiny import CORPUS, SPECIALS

FRAME_SIZE = 32  # one merged 2x2 group of 16-pixel patches per temporal patch
NAMES = {  # Qwen2.5-Omni's marker -> Qwen3-Omni's, by the tokenizer attribute naming it
    "audio_token": ("<|AUDIO|>", "<|audio_pad|>"),
    "audio_bos_token": ("<|audio_bos|>", "<|audio_start|>"),
    "audio_eos_token": ("<|audio_eos|>", "<|audio_end|>"),
    "image_token": ("<|IMAGE|>", "<|image_pad|>"),
    "video_token": ("<|VIDEO|>", "<|video_pad|>"),
    "vision_bos_token": ("<|vision_bos|>", "<|vision_start|>"),
    "vision_eos_token": ("<|vision_eos|>", "<|vision_end|>"),
}


def _renamed(text: str) -> str:
    for old, new in NAMES.values():
        text = text.replace(old, new)
    return text


def build_tokenizer(extra_words: tuple[str, ...] = ()) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from omni_diffusion_rl.models.qwen_omni import DEFAULT_CHAT_TEMPLATE

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[*map(_renamed, SPECIALS), *extra_words],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        chat_template=_renamed(DEFAULT_CHAT_TEMPLATE),
        **{attribute: name for attribute, (_, name) in NAMES.items()},
    )


def build_thinker(tokenizer: object) -> object:
    from transformers import Qwen3OmniMoeThinkerConfig, Qwen3OmniMoeThinkerForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids  # type: ignore[attr-defined]
    hidden = 32
    config = Qwen3OmniMoeThinkerConfig(
        text_config=dict(
            vocab_size=len(tokenizer),  # type: ignore[arg-type]
            hidden_size=hidden,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            max_position_embeddings=1024,
            # interleaved mrope: the sections sum to head_dim / 2, each at most a third of it
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e6,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
            tie_word_embeddings=False,
            eos_token_id=ids("<|im_end|>"),
            pad_token_id=ids("<|endoftext|>"),
        ),
        audio_config=dict(
            num_mel_bins=32,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=32,
            d_model=16,
            output_dim=hidden,
            n_window=50,
            n_window_infer=100,
            downsample_hidden_size=8,
            max_source_positions=1500,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            in_channels=3,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=hidden,
            num_position_embeddings=16,  # a square count (learned, interpolated to the grid)
            deepstack_visual_indexes=[0],
        ),
        audio_token_id=ids("<|audio_pad|>"),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        audio_start_token_id=ids("<|audio_start|>"),
        audio_end_token_id=ids("<|audio_end|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        user_token_id=ids("<|im_start|>"),
        position_id_per_seconds=25,
    )
    return Qwen3OmniMoeThinkerForConditionalGeneration(config).eval()


def build_processors(sampling_rate: int = 8000) -> tuple[object, object]:
    from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor

    audio = WhisperFeatureExtractor(
        feature_size=32, sampling_rate=sampling_rate, hop_length=80, n_fft=400, chunk_length=1
    )
    image = Qwen2VLImageProcessorPil(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        size={"shortest_edge": 32 * 32, "longest_edge": 64 * 64},
    )
    return audio, image


def save_tiny_qwen3_omni(path: Path, extra_words: tuple[str, ...] = (), seed: int = 0) -> Path:
    """The tiny thinker, its tokenizer and processors in `path` (Qwen3OmniModel.save_pretrained)."""
    from omni_diffusion_rl.models.qwen_omni import Qwen3OmniModel

    torch.manual_seed(seed)
    tokenizer = build_tokenizer(extra_words)
    thinker = build_thinker(tokenizer)
    with torch.no_grad():  # an end token likely enough that some answers finish before the limit
        thinker.lm_head.weight[tokenizer.eos_token_id] *= 40.0  # type: ignore[attr-defined,index]
    audio, image = build_processors()
    Qwen3OmniModel(thinker, tokenizer, audio, image, seconds=0.5).save_pretrained(path)
    return path
