"""The tiny random-init LTX2Pipeline of the tests (omni_diffusion_rl/benchmarks/tiny_families.py),
under the names the tests import."""

from omni_diffusion_rl.benchmarks.tiny_families import LTX2_AUDIO_CHANNELS as AUDIO_CHANNELS
from omni_diffusion_rl.benchmarks.tiny_families import LTX2_AUDIO_TOKEN as AUDIO_TOKEN
from omni_diffusion_rl.benchmarks.tiny_families import LTX2_CLIP as CLIP
from omni_diffusion_rl.benchmarks.tiny_families import LTX2_GUIDANCE_OFF as GUIDANCE_OFF
from omni_diffusion_rl.benchmarks.tiny_families import LTX2_MEL_BINS as MEL_BINS
from omni_diffusion_rl.benchmarks.tiny_families import LTX2_TEXT_LAYERS as TEXT_LAYERS
from omni_diffusion_rl.benchmarks.tiny_families import LTX2_TEXT_WIDTH as TEXT_WIDTH
from omni_diffusion_rl.benchmarks.tiny_families import LTX2_VIDEO_CHANNELS as VIDEO_CHANNELS
from omni_diffusion_rl.benchmarks.tiny_families import tiny_ltx2_pipeline

__all__ = [
    "AUDIO_CHANNELS",
    "AUDIO_TOKEN",
    "CLIP",
    "GUIDANCE_OFF",
    "MEL_BINS",
    "TEXT_LAYERS",
    "TEXT_WIDTH",
    "VIDEO_CHANNELS",
    "tiny_ltx2_pipeline",
]
