"""Reward plug-ins shipped with omni-diffusion-rl (registered through entry points)."""
