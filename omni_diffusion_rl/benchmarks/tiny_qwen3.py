"""A tiny random-init Qwen3-Omni-MoE thinker saved as the qwen3_omni family reads it (the recipe of
docs/research/qwen_omni.md section 5, docs/research/scripts/qwen_omni/qwen3_probe.py; the tests'
model and the memory trace's tiny Qwen3 case): the tokenizer of tiny_qwen.py with Qwen3-Omni's
names for the media markers (`<|audio_pad|>`, `<|vision_start|>`, ...; the tokenizer names them,
the chat template uses them), its feature extractor (8000 Hz, the shipped question files' rate), a
2-layer MoE text model (4 experts, 2 a token, q/k norm, interleaved mrope), a 2-block vision tower
with patch 16, learned position embeddings and one deepstack layer, a 1-layer audio encoder, and
the PIL Qwen2-VL image processor with patch 16. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import tiny_qwen
from .tiny_qwen import QWEN3_MARKERS, qwen3_thinker_token_ids

FRAME_SIZE = 32  # one merged 2x2 group of 16-pixel patches per temporal patch
NAMES = QWEN3_MARKERS  # Qwen3-Omni's names for the media markers, by the tokenizer attribute naming each


def build_tokenizer(extra_words: tuple[str, ...] = ()) -> object:
    """tiny_qwen.py's tokenizer with Qwen3-Omni's marker names."""
    return tiny_qwen.build_tokenizer(extra_words, NAMES)


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
        **qwen3_thinker_token_ids(tokenizer),
    )
    return Qwen3OmniMoeThinkerForConditionalGeneration(config).eval()


def save_tiny_qwen3_omni(path: Path, extra_words: tuple[str, ...] = (), seed: int = 0) -> Path:
    """The tiny thinker, its tokenizer and processors in `path` (Qwen3OmniModel.save_pretrained)."""
    from ..models.qwen_omni import Qwen3OmniModel

    torch.manual_seed(seed)
    tokenizer = build_tokenizer(extra_words)
    processors = tiny_qwen.build_processors(patch_size=16)
    return tiny_qwen.save_model(path, Qwen3OmniModel, tokenizer, build_thinker(tokenizer), processors)
