"""`tiny_sync_judge`: the tiny sync world's judge as a registered scorer (never trained on).

Its score is 1 when every fact of the prompt is right for every object (colour, size, count, in
sync); its components are each fact, the measures (strikes matched within a frame, the offset in
frames, strikes seen and heard), the health signs and the diversity within a prompt of
`omni_diffusion_rl.world.sync_judge`. Name it in `eval.metrics`; it reports, it does not train.
"""

from __future__ import annotations

from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.reward import InputLimits, RewardOutput
from omni_diffusion_rl.world import sync_judge as judge
from omni_diffusion_rl.world import tiny_sync as world

SYNC_WORLD_LIMITS = InputLimits(
    frames=world.FRAMES,
    frame_height=world.SIZE,
    frame_width=world.SIZE,
    audio_samples=2 * round(world.SAMPLE_RATE * world.DURATION_S),
    meant_for=(
        f"the tiny sync world's clips: {world.FRAMES} frames of {world.SIZE} x {world.SIZE}, "
        f"{world.DURATION_S:g} s of audio at {world.SAMPLE_RATE} Hz"
    ),
)


@rewards.register("tiny_sync_judge")
class TinySyncJudge:
    """Every fact right (score), each fact, the measures, the health signs and the diversity (components)."""

    input_limits = SYNC_WORLD_LIMITS
    headline = "all_correct"
    components = (*judge.ATTRIBUTES, *judge.MEASURES, *judge.HEALTH, *judge.DIVERSITY)

    def score(self, media: MediaBatch, prompts: list[str]) -> RewardOutput:
        if media.video is None or media.audio is None:
            raise ValueError("tiny_sync_judge needs video and audio; the media batch lacks one")
        if media.sample_rate != world.SAMPLE_RATE or media.video.shape[1:] != (
            world.FRAMES,
            3,
            world.SIZE,
            world.SIZE,
        ):
            raise ValueError(
                f"tiny_sync_judge reads the tiny sync world's clips ({SYNC_WORLD_LIMITS.meant_for}); "
                f"got video {tuple(media.video.shape[1:])} at {media.sample_rate} Hz"
            )
        verdicts = judge.judge_clips(media.video, media.audio, prompts)
        return RewardOutput(verdicts["all_correct"], {k: verdicts[k] for k in self.components})
