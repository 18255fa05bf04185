"""omni-diffusion-rl: post-train diffusion generators with reinforcement learning and distillation."""

__version__ = "0.1.0"
