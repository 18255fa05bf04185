"""The tiny random-init MiniMax-H3 components of the tests (omni_diffusion_rl/benchmarks/tiny_families.py),
under the names the tests import."""

from omni_diffusion_rl.benchmarks.tiny_families import H3_AUDIO_CHANNELS as AUDIO_CHANNELS
from omni_diffusion_rl.benchmarks.tiny_families import H3_CLIP as CLIP
from omni_diffusion_rl.benchmarks.tiny_families import H3_TEXT_LAYERS as TEXT_LAYERS
from omni_diffusion_rl.benchmarks.tiny_families import H3_TEXT_WIDTH as TEXT_WIDTH
from omni_diffusion_rl.benchmarks.tiny_families import H3_VIDEO_CHANNELS as VIDEO_CHANNELS
from omni_diffusion_rl.benchmarks.tiny_families import save_tiny_h3, tiny_h3_components

__all__ = [
    "AUDIO_CHANNELS",
    "CLIP",
    "TEXT_LAYERS",
    "TEXT_WIDTH",
    "VIDEO_CHANNELS",
    "save_tiny_h3",
    "tiny_h3_components",
]
