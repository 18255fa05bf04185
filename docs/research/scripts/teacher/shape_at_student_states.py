"""Where in the student's trajectory does the teacher still decide the shape?

For held-out prompts the base student samples (10 Euler steps, its own states recorded). At each
visited state x_k (time t_k) the teacher's clean-sample prediction x_k - t_k v_T(x_k) is judged:
its shape against the prompt's, and against the shape the student ends with. If the teacher names
the prompt's shape only at the noisiest states, the velocity loss can teach the shape only there.
Run: python docs/research/scripts/teacher/shape_at_student_states.py TEACHER_DIR CFG_SCALE
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from omni_diffusion_rl.experience.rollout import generate
from omni_diffusion_rl.models.tiny_av import TinyAVPolicy
from omni_diffusion_rl.prompts import load_prompts
from omni_diffusion_rl.world import tiny_world as world
from omni_diffusion_rl.world.judge import judge_video
from teachers.flow_policy import FlowPolicyTeacher


def shapes(policy: TinyAVPolicy, x0: torch.Tensor, scenes: list[world.Scene]) -> tuple[torch.Tensor, ...]:
    media = policy.decode(x0)
    judged = judge_video(media.video, scenes)
    return judged["shape"], judged["recognisable_shape"]


def main() -> None:
    torch.set_num_threads(1)
    teacher = FlowPolicyTeacher(pretrained=sys.argv[1], cfg_scale=float(sys.argv[2]))
    student = TinyAVPolicy.from_pretrained("builtin")
    prompts = load_prompts("builtin:tiny_world_heldout")[:16]
    group = 16
    noise = torch.randn(len(prompts) * group, *student.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        rollout = generate(student, prompts, list(range(len(prompts))), noise, 10, 1.0, "euler", record_states=True)
    scenes = [world.parse_prompt(p) for p in rollout.prompts]
    wrong = [dataclasses.replace(s, shape=next(x for x in world.SHAPES if x != s.shape)) for s in scenes]
    student_right, _ = shapes(student, rollout.x0, scenes)
    student_wrong, _ = shapes(student, rollout.x0, wrong)
    rows = []
    states = rollout.extras["states"]
    for k, t in enumerate(rollout.grid[:-1].tolist()):
        x_k = states[:, k]
        tt = torch.full((len(x_k),), t)
        v_t = teacher.velocity(x_k, tt, rollout.prompts)
        with torch.no_grad():
            v_s = student.velocity(x_k, tt, student.encode_prompts(rollout.prompts))
        teacher_right, recognisable = shapes(student, x_k - t * v_t, scenes)
        student_pred_right, _ = shapes(student, x_k - t * v_s, scenes)
        rows.append(
            {
                "t": round(t, 2),
                "teacher_x0_shape_right": float(teacher_right.float().mean()),
                "teacher_x0_recognisable": float(recognisable.float().mean()),
                "teacher_right_where_student_ends_wrong": float(teacher_right[student_wrong].float().mean()),
                "student_x0_shape_right": float(student_pred_right.float().mean()),
            }
        )
    report = {
        "student_final_shape_right": float(student_right.float().mean()),
        "student_final_shape_wrong": float(student_wrong.float().mean()),
        "per_state": rows,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
