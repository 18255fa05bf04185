"""The tiny random-init Qwen2.5-Omni thinker of the tests (omni_diffusion_rl/benchmarks/tiny_qwen.py),
under the names the tests import."""

from omni_diffusion_rl.benchmarks.tiny_qwen import (
    CORPUS,
    MARKERS,
    SPECIALS,
    build_processors,
    build_thinker,
    build_tokenizer,
    save_model,
    save_tiny_qwen_omni,
)

__all__ = [
    "CORPUS",
    "MARKERS",
    "SPECIALS",
    "build_processors",
    "build_thinker",
    "build_tokenizer",
    "save_model",
    "save_tiny_qwen_omni",
]
