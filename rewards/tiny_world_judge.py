"""`tiny_world_judge`: the tiny world's evaluation metrics as a registered scorer (never trained on).

Its score is 1 when all four attributes (colour, shape, pitch, timing) are right; its components
are each attribute and the health signs of `omni_diffusion_rl.world.judge`. Name it in
`eval.metrics`; it reports, it does not train.
"""

from __future__ import annotations

from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.reward import RewardOutput
from omni_diffusion_rl.world import judge
from rewards.tiny_world import TINY_CLIP_LIMITS


@rewards.register("tiny_world_judge")
class TinyWorldJudge:
    """All attributes right (score), each attribute and the health signs (components)."""

    input_limits = TINY_CLIP_LIMITS
    headline = "all_correct"  # what the score is called in summaries
    components = (*judge.ATTRIBUTES, *judge.HEALTH, "diversity", *judge.PICTURE_MEASURES)

    def score(self, media: MediaBatch, prompts: list[str]) -> RewardOutput:
        if media.video is None or media.audio is None:
            raise ValueError("tiny_world_judge needs video and audio; the media batch lacks one")
        decisions = judge.judge_clips(media.video, media.audio, media.sample_rate, prompts)
        return RewardOutput(decisions["all_correct"], {k: decisions[k] for k in self.components})
