"""The tiny random-init Qwen3-Omni-MoE thinker (omni_diffusion_rl/benchmarks/tiny_qwen3.py, where the
memory trace's tiny Qwen3 case builds it too), under the name the tests import."""

from omni_diffusion_rl.benchmarks.tiny_qwen3 import (
    FRAME_SIZE,
    NAMES,
    build_thinker,
    build_tokenizer,
    save_tiny_qwen3_omni,
)

__all__ = ["FRAME_SIZE", "NAMES", "build_thinker", "build_tokenizer", "save_tiny_qwen3_omni"]
