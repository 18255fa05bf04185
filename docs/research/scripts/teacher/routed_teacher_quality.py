"""How good is a routed teacher as a generator, against the single full teacher?

The held-out prompts (16 x 16 samples, fixed noise) are sampled with each teacher's own velocity
(20 Euler steps, each teacher at its folder's recommended guidance) and judged by the tiny world's
judge: all four attributes right, and each attribute. "routed": the video teacher answers for the
picture and visibility entries, the audio teacher for the spectrum and loudness entries
(teacher.routes); "video only": the video teacher answers for every entry (its audio untrained).
Run: python docs/research/scripts/teacher/routed_teacher_quality.py FULL_DIR VIDEO_DIR AUDIO_DIR
"""

from __future__ import annotations

import json
import sys

import torch

from omni_diffusion_rl.experience.teacher_routes import RoutedTeacher, route_entries
from omni_diffusion_rl.models.tiny_av import TinyAVPolicy
from omni_diffusion_rl.prompts import load_prompts
from omni_diffusion_rl.world.judge import ATTRIBUTES, judge_clips
from teachers.flow_policy import FlowPolicyTeacher

ROUTES = {"video": {"parts": ["picture", "visibility"]}, "audio": {"parts": ["spectrum", "loudness"]}}


def sample(teacher: FlowPolicyTeacher | RoutedTeacher, prompts: list[str], noise: torch.Tensor) -> torch.Tensor:
    """Euler from noise (t = 1) to the clean sample (t = 0) on the uniform 20-step grid."""
    grid, x = torch.linspace(1, 0, 21), noise.clone()
    for t_now, t_next in zip(grid[:-1].tolist(), grid[1:].tolist(), strict=True):
        x = x + (t_next - t_now) * teacher.velocity(x, torch.full((len(x),), t_now), prompts)
    return x


def main() -> None:
    torch.set_num_threads(1)
    full_dir, video_dir, audio_dir = sys.argv[1:4]
    decoder = TinyAVPolicy.from_pretrained(full_dir)
    entries = route_entries(decoder.transformer.layout.parts(), ROUTES, tuple(decoder.latent_shape))
    full = FlowPolicyTeacher(pretrained=full_dir)
    video, audio = FlowPolicyTeacher(pretrained=video_dir), FlowPolicyTeacher(pretrained=audio_dir)
    teachers = {
        "full": full,
        "routed": RoutedTeacher({"video": video, "audio": audio}, entries, torch.Size(decoder.latent_shape).numel()),
        "video only": video,
    }
    prompts = [p for p in load_prompts("builtin:tiny_world_heldout")[:16] for _ in range(16)]
    noise = torch.randn(len(prompts), *decoder.latent_shape, generator=torch.Generator().manual_seed(0))
    report = {"guidance": {"full": full.cfg_scale, "video": video.cfg_scale, "audio": audio.cfg_scale}}
    for name, teacher in teachers.items():
        media = decoder.decode(sample(teacher, prompts, noise))
        judged = judge_clips(media.video, media.audio, media.sample_rate, prompts)
        report[name] = {k: round(float(judged[k].mean()), 4) for k in ("all_correct", *ATTRIBUTES)}
        print(name, report[name], flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
