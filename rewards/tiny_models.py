"""Tiny random-init reward models saved like real checkpoints, for benchmarks and offline tests.

They run the real model code end to end (loading, preprocessing, embeddings); their scores mean
nothing. `save_tiny_clap` writes a transformers CLAP directory: a 1 s window at 48 kHz, 16 mel
bins, a byte-level BPE tokenizer trained on a handful of captions.
"""

from __future__ import annotations

from pathlib import Path

import torch

CLAP_CORPUS = [
    "a dog barks",
    "rain on a window",
    "a violin plays a song",
    "birds sing in the morning",
    "a car engine starts",
    "people talk in a room",
]
_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def tiny_clap_parts(seed: int = 0) -> tuple[object, object]:
    """(ClapModel, ClapProcessor), random-init and small enough for a CPU test."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel, ClapProcessor, RobertaTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CLAP_CORPUS * 4, vocab_size=300, min_frequency=1, special_tokens=_SPECIALS)
    tokenizer = RobertaTokenizerFast(
        tokenizer_object=bpe._tokenizer,  # noqa: SLF001 - the trained tokenizers.Tokenizer
        bos_token="<s>",
        eos_token="</s>",
        cls_token="<s>",
        sep_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
        model_max_length=32,
    )
    # 1 s window at 48 kHz, hop 480 -> 101 mel frames of 16 bins; fits spec_size 64 (width 256, height 16).
    features = ClapFeatureExtractor(
        feature_size=16, sampling_rate=48_000, hop_length=480, max_length_s=1, fft_window_size=1024
    )
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 40,
        "pad_token_id": tokenizer.pad_token_id,
    }
    audio = {
        "num_mel_bins": 16,
        "spec_size": 64,
        "window_size": 4,
        "depths": [1, 1],
        "num_attention_heads": [2, 2],
        "patch_embeds_hidden_size": 16,
        "hidden_size": 32,
    }
    torch.manual_seed(seed)
    model = ClapModel(ClapConfig(text_config=text, audio_config=audio, projection_dim=16)).eval()
    return model, ClapProcessor(feature_extractor=features, tokenizer=tokenizer)


def save_tiny_clap(path: str | Path, seed: int = 0) -> Path:
    """Write a tiny CLAP checkpoint directory (model + processor) loadable by `ClapReward(checkpoint=...)`."""
    path = Path(path)
    model, processor = tiny_clap_parts(seed)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path
