"""On-policy distillation on the tiny model: self-distillation gives loss 0 exactly, a teacher that
does not fit the student is refused at start (layout, flipped sign), a failing teacher is an error,
targets follow the student's states, and a different teacher pulls the student toward itself."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from omni_diffusion_rl.algorithms.distill import completion_velocities, endpoint_velocities, state_weights
from omni_diffusion_rl.config import ConfigError, load_config
from omni_diffusion_rl.experience.rollout import Rollout
from omni_diffusion_rl.experience.teacher_targets import (
    COMPLETED,
    STATES,
    TEACHER_V,
    TEACHER_X0,
    TeacherTargets,
    completion_starts,
    group_noise,
    noised_states,
)
from omni_diffusion_rl.models.tiny_av import TEACHER_GUIDANCE, TEACHER_WEIGHTS
from omni_diffusion_rl.registry import teachers
from omni_diffusion_rl.teacher import TeacherMismatch
from omni_diffusion_rl.trainers.distill import contrast_pairs
from omni_diffusion_rl.trainers.trainer import Trainer
from teachers.flow_policy import FlowPolicyTeacher

from .helpers import REPO, fast_overrides, step_records, tiny_model_dir

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("student"))


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("teacher"), seed=7)


def _distill(model_dir: Path, run: Path, steps: int, teacher: str, *extra: str) -> list[str]:
    return [
        *fast_overrides(model_dir, run, steps),
        "train.eval_at_start_and_end=false",
        "algorithm.name=distill",
        f"teacher.options={{family: tiny_av, pretrained: {teacher}}}",
        *extra,
    ]


@pytest.mark.parametrize("states", ["visited", "noised"])
def test_self_distillation_gives_loss_zero_exactly(model_dir: Path, tmp_path: Path, states: str) -> None:
    run = tmp_path / "run"
    Trainer(
        load_config(None, _distill(model_dir, run, 2, str(model_dir), f"algorithm.distill_states={states}"))
    ).fit()
    rows = step_records(run)
    assert [r["loss/distill"] for r in rows] == [0.0, 0.0] and [r["loss/total"] for r in rows] == [0.0, 0.0]


def test_self_distillation_of_the_conditional_direction_gives_loss_zero_exactly(
    model_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    Trainer(
        load_config(None, _distill(model_dir, run, 2, str(model_dir), "algorithm.distill_cond_coef=1"))
    ).fit()
    rows = step_records(run)
    assert [r["loss/distill_cond"] for r in rows] == [0.0, 0.0]
    assert [r["loss/total"] for r in rows] == [0.0, 0.0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "loss",
    [
        [],
        ["algorithm.distill_weighting=x0", "algorithm.distill_focus=1.0"],
        ["algorithm.distill_weighting=sde_kl"],
        ["algorithm.distill_target=endpoint", "algorithm.distill_weighting=x0"],
        ["algorithm.distill_target=completion", "algorithm.distill_weighting=x0"],
        ["algorithm.distill_cond_coef=4"],
    ],
    ids=["velocity", "x0-focus", "sde-kl", "endpoint", "completion", "conditional-direction"],
)
def test_a_different_teacher_pulls_the_student_toward_itself(
    model_dir: Path, other_dir: Path, tmp_path: Path, loss: list[str]
) -> None:
    run = tmp_path / "run"
    overrides = _distill(model_dir, run, 10, str(other_dir), "optim.lr=2e-2", "model.lora_rank=16", *loss)
    trainer = Trainer(load_config(None, overrides))
    trainer.fit()
    assert all(r["loss/distill"] > 0 for r in step_records(run))
    teacher = FlowPolicyTeacher(pretrained=str(other_dir))
    x = torch.randn(4, *trainer.policy.latent_shape, generator=torch.Generator().manual_seed(0))
    t, prompts = torch.tensor([0.9, 0.6, 0.4, 0.2]), ["a red circle"] * 4

    def gap(active: bool) -> float:
        from omni_diffusion_rl.models import lora

        context = (
            lora.using_adapter(trainer.transformer, lora.TRAINED)
            if active
            else lora.adapters_disabled(trainer.transformer)
        )
        with torch.no_grad(), context:
            cond = trainer.policy.encode_prompts(prompts)
            return float(
                ((trainer.policy.velocity(x, t, cond) - teacher.velocity(x, t, prompts)) ** 2).mean()
            )

    trained, base = gap(True), gap(False)
    assert trained < 0.9 * base, (
        f"the trained student is closer to the teacher than its base: {trained} {base}"
    )


PROMPT_STEERED = {"modulation", "text_pool", "final_modulation"}
"""The layers the prompt's pooled words and the time steer (through the blocks' modulation)."""


def test_the_distillation_recipe_trains_the_layers_the_prompt_steers(
    model_dir: Path, other_dir: Path, tmp_path: Path
) -> None:
    """tiny_t2av_distill.yaml adapts the modulation and pooled-prompt layers beside attention and
    MLP (without them the student draws one shape for every prompt), and a step from a different
    teacher moves the adapter of every one of them."""
    recipe = REPO / "recipes" / "configs" / "tiny_t2av_distill.yaml"
    run = tmp_path / "run"
    overrides = _distill(model_dir, run, 2, str(other_dir), "optim.lr=2e-2")
    cfg = load_config(recipe, [o for o in overrides if not o.startswith("model.lora_")])
    assert PROMPT_STEERED < set(cfg.model.lora_targets) and cfg.algorithm.name == "distill"
    trainer = Trainer(cfg)
    from omni_diffusion_rl.models import lora

    def adapter_b() -> dict[str, torch.Tensor]:
        suffix = f".lora_B.{lora.TRAINED}.weight"
        return {
            name[: -len(suffix)]: p.detach().clone()
            for name, p in trainer.transformer.named_parameters()
            if name.endswith(suffix)
        }

    before = adapter_b()
    adapted = {name.rsplit(".", 1)[-1] for name in before}
    assert adapted == set(cfg.model.lora_targets)
    trainer.fit()
    moved = {name.rsplit(".", 1)[-1] for name, b in adapter_b().items() if not torch.equal(b, before[name])}
    assert PROMPT_STEERED <= moved, f"adapters that did not move: {PROMPT_STEERED - moved}"


class FlippedTeacher(FlowPolicyTeacher):
    def velocity(self, x_t, t, prompts):  # noqa: ANN001, ANN201
        return -super().velocity(x_t, t, prompts)


class NaNTeacher(FlowPolicyTeacher):
    def velocity(self, x_t, t, prompts):  # noqa: ANN001, ANN201
        v = super().velocity(x_t, t, prompts)
        v[0, 0] = float("nan")
        return v


def test_a_teacher_that_does_not_fit_is_refused_at_start(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from omni_diffusion_rl.models.tiny_av import TinyAVTransformer

    monkeypatch.setitem(teachers._factories, "flipped", FlippedTeacher)  # noqa: SLF001
    flipped = [*_distill(model_dir, tmp_path / "a", 1, str(model_dir)), "teacher.name=flipped"]
    with pytest.raises(TeacherMismatch, match=r"teacher 'flipped' fails the convention probe: cos\(v\(noise"):
        Trainer(load_config(None, flipped))
    torch.manual_seed(0)
    TinyAVTransformer(dim=32, depth=1, heads=2, mlp_ratio=2, video_size=8, patch_size=4).save_pretrained(
        tmp_path / "small_video"
    )
    other = _distill(model_dir, tmp_path / "b", 1, str(tmp_path / "small_video"))
    with pytest.raises(
        TeacherMismatch,
        match="latent shape .* against the student's .*; latent layout 'TinyAVPolicy:picture 3x8x8",
    ):
        Trainer(load_config(None, other))


def test_a_teacher_answering_nan_or_the_wrong_shape_is_an_error(model_dir: Path) -> None:
    x0 = torch.randn(4, 796)
    rollout = Rollout(["a red circle"] * 4, torch.tensor([0, 0, 1, 1]), x0, {}, torch.linspace(1, 0, 4))
    with pytest.raises(ValueError, match=r"finite: False.*a teacher must give a finite velocity per state"):
        TeacherTargets(NaNTeacher(pretrained=str(model_dir)), "noised").targets(rollout)

    class Short(FlowPolicyTeacher):
        def velocity(self, x_t, t, prompts):  # noqa: ANN001, ANN202
            return super().velocity(x_t, t, prompts)[:, :10]

    with pytest.raises(ValueError, match=r"the teacher answered \(4, 10\) .* for states \(4, 796\)"):
        TeacherTargets(Short(pretrained=str(model_dir)), "noised").targets(rollout)
    # the teacher's own sampler (endpoint, completion, contrast) is checked the same way, and needs a
    # state per step
    visited = replace(rollout, extras={STATES: torch.randn(4, 3, 796)})
    short_record = replace(rollout, extras={STATES: torch.randn(4, 2, 796)})
    for target in ("endpoint", "completion", "contrast"):
        with pytest.raises(ValueError, match=r"finite: False.*a teacher must give a finite velocity"):
            TeacherTargets(NaNTeacher(pretrained=str(model_dir)), "visited", target=target).targets(visited)
        with pytest.raises(ValueError, match=r"the teacher answered \(\d, 10\) .* for states \(\d, 796\)"):
            TeacherTargets(Short(pretrained=str(model_dir)), "visited", target=target).targets(visited)
        with pytest.raises(ValueError, match="recorded 2 states for a grid of 3 steps"):
            TeacherTargets(FlowPolicyTeacher(pretrained=str(model_dir)), "visited", target=target).targets(
                short_record
            )
    with pytest.raises(ValueError, match="must be one of velocity, endpoint, completion, contrast; got .x0."):
        TeacherTargets(FlowPolicyTeacher(pretrained=str(model_dir)), "visited", target="x0")


def test_the_shipped_teacher_is_guided_by_default_and_others_are_not(model_dir: Path) -> None:
    """builtin-teacher (or its folder) without cfg_scale: its measured guidance, v = v(empty) + 3
    (v(prompt) - v(empty)); another model, or a cfg_scale given, as asked (1 is off)."""
    shipped, plain = FlowPolicyTeacher(), FlowPolicyTeacher(cfg_scale=1)
    assert (shipped.cfg_scale, plain.cfg_scale) == (TEACHER_GUIDANCE, 1.0)
    assert shipped.info().fingerprint != plain.info().fingerprint
    x = torch.randn(2, *shipped.info().latent_shape, generator=torch.Generator().manual_seed(0))
    t, prompts = torch.full((2,), 0.7), ["a red circle", "a blue square"]
    v_prompt, v_empty = plain.velocity(x, t, prompts), plain.velocity(x, t, ["", ""])
    torch.testing.assert_close(shipped.velocity(x, t, prompts), v_empty + 3 * (v_prompt - v_empty))
    assert FlowPolicyTeacher(pretrained=str(model_dir)).cfg_scale == 1.0
    assert FlowPolicyTeacher(pretrained=str(TEACHER_WEIGHTS)).cfg_scale == TEACHER_GUIDANCE  # its folder


@pytest.mark.parametrize(
    ("content", "error"),
    [
        ('{"cfg_scale": 2.0}', None),
        ('{"cfg_scale": 1e9}', r"cfg_scale 1000000000.0 is outside \[1, 20\]"),
        ('{"cfg_scale": NaN}', "must be a finite number"),
        ('{"cfg_scale": "3"}', "must be a finite number"),
        ('{"cfg_scale": 3, "url": "http://x"}', r"give exactly \{\"cfg_scale\": <number>\}"),
        ("[" * 5000, "over 1024 bytes"),
        ("[" * 1020, "not JSON"),  # under the size limit, past the parser's nesting
        ('{"cfg_scale": 1' + "0" * 400 + "}", "must be a finite number"),  # no float holds it
        ("{cfg_scale: 3", "not JSON"),
    ],
)
def test_a_model_folder_recommends_its_guidance_bounded_and_checked(
    model_dir: Path, tmp_path: Path, content: str, error: str | None
) -> None:
    """A folder's guidance.json is the teacher's default guidance; anything but one number in
    [1, 20] is refused, naming the file; a cfg_scale given wins over it."""
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    (folder / "guidance.json").write_text(content)
    if error is None:
        assert FlowPolicyTeacher(pretrained=str(folder)).cfg_scale == 2.0
    else:
        with pytest.raises(ConfigError, match=rf"guidance.json: .*{error}"):
            FlowPolicyTeacher(pretrained=str(folder))
    assert FlowPolicyTeacher(pretrained=str(folder), cfg_scale=1.5).cfg_scale == 1.5


def test_targets_are_the_teachers_velocity_at_the_students_states(model_dir: Path) -> None:
    teacher = FlowPolicyTeacher(pretrained=str(model_dir))
    x0 = torch.randn(4, *teacher.info().latent_shape, generator=torch.Generator().manual_seed(2))
    grid = torch.linspace(1, 0, 4)
    rollout = Rollout(["a red circle"] * 2 + ["a blue square"] * 2, torch.tensor([3, 3, 5, 5]), x0, {}, grid)
    extras = TeacherTargets(teacher, "noised", seed=1).targets(rollout)
    states = extras[STATES]
    assert states.shape == (4, 3, *x0.shape[1:]) and extras[TEACHER_V].shape == states.shape
    torch.testing.assert_close(states, noised_states(rollout, seed=1), rtol=0, atol=0)
    alone = noised_states(rollout.select(torch.tensor([2, 3])), seed=1)  # keyed by group, not by batch
    torch.testing.assert_close(states[2:], alone, rtol=0, atol=0)
    k = 1
    expected = teacher.velocity(states[:, k], grid[k].expand(4), rollout.prompts)
    torch.testing.assert_close(extras[TEACHER_V][:, k], expected, rtol=0, atol=0)
    torch.testing.assert_close(states[:, 0], (1 - grid[0]) * x0 + grid[0] * (states[:, 0] - 0 * x0))


def test_endpoint_targets_point_each_visited_state_at_the_teachers_own_sample(model_dir: Path) -> None:
    """distill_target=endpoint: the teacher runs Euler from the student's starting noise on the
    student's grid, and each state's target is the straight line from it to that sample."""
    teacher = FlowPolicyTeacher(pretrained=str(model_dir))
    gen = torch.Generator().manual_seed(3)
    grid = torch.tensor([1.0, 0.7, 0.3, 0.0])
    states = torch.randn(3, 3, *teacher.info().latent_shape, generator=gen)
    prompts = ["a red circle", "a blue square", "a low tone"]
    rollout = Rollout(prompts, torch.tensor([0, 1, 2]), states[:, -1], {}, grid, {STATES: states})
    x = states[:, 0]
    for k in range(3):
        x = x + (grid[k + 1] - grid[k]) * teacher.velocity(x, grid[k].expand(3), prompts)
    targets = TeacherTargets(teacher, "visited", target="endpoint").targets(rollout)[TEACHER_V]
    expected = (states - x[:, None]) / grid[:-1].view(1, 3, 1)
    torch.testing.assert_close(targets, expected, rtol=1e-5, atol=1e-5)
    assert (
        float((targets[:, 0] - teacher.velocity(states[:, 0], grid[:1].expand(3), prompts)).abs().max()) > 0.1
    )


def test_endpoint_velocities_are_constant_along_the_straight_line() -> None:
    """A student already walking the straight line from its noise to the teacher's sample gets its
    own velocity back at every state: the fixed point; off the line, the target points back to it."""
    noise, x0 = torch.randn(2, 5), torch.randn(2, 5)
    times = torch.tensor([1.0, 0.6, 0.2])
    line = (1 - times.view(1, 3, 1)) * x0[:, None] + times.view(1, 3, 1) * noise[:, None]
    targets = endpoint_velocities(line, x0, times)
    torch.testing.assert_close(targets, (noise - x0)[:, None].expand(2, 3, 5))
    off = line.clone()
    off[:, 2] += 1.0
    torch.testing.assert_close(off[:, 2] - 0.2 * endpoint_velocities(off, x0, times)[:, 2], x0)
    with pytest.raises(ValueError, match="one time > 0 per state"):
        endpoint_velocities(line, x0, torch.tensor([1.0, 0.5, 0.0]))


def test_completion_targets_point_each_chosen_state_at_the_teachers_completion_from_it(
    model_dir: Path,
) -> None:
    """distill_target=completion: for a few visited states of each sample (chosen by its group), the
    teacher runs Euler from that state to the end of the grid, and the target is the straight line
    from the state to that completion; the other states get none."""
    teacher = FlowPolicyTeacher(pretrained=str(model_dir))
    grid = torch.tensor([1.0, 0.7, 0.3, 0.0])
    states = torch.randn(4, 3, *teacher.info().latent_shape, generator=torch.Generator().manual_seed(6))
    prompts = ["a red circle", "a red circle", "a blue square", "a blue square"]
    rollout = Rollout(prompts, torch.tensor([5, 5, 9, 9]), states[:, -1], {}, grid, {STATES: states})
    extras = TeacherTargets(teacher, "visited", seed=2, target="completion", completions=2).targets(rollout)
    chosen = extras[COMPLETED]
    assert torch.equal(chosen, completion_starts(rollout, 2, 2)) and chosen.sum(1).tolist() == [2] * 4
    assert not torch.equal(chosen, completion_starts(rollout, 3, 2)) or not torch.equal(
        chosen, completion_starts(rollout, 4, 2)
    )  # keyed by the seed
    for row in range(4):
        for k in range(3):
            target = extras[TEACHER_V][row, k]
            if not chosen[row, k]:
                assert float(target.abs().max()) == 0.0
                continue
            x = states[row, k][None]
            for j in range(k, 3):
                x = x + (grid[j + 1] - grid[j]) * teacher.velocity(x, grid[j].view(1), [prompts[row]])
            torch.testing.assert_close(target, (states[row, k] - x[0]) / grid[k], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="1 to 3 states per sample"):
        completion_starts(rollout, 0, 4)
    with pytest.raises(ValueError, match="use distill_states=visited"):
        TeacherTargets(teacher, "noised", target="completion")


def test_completion_velocities_from_the_last_state_are_the_teachers_velocity() -> None:
    """From the grid's last state, one Euler step x0 = x - t v completes it: the target is v."""
    x, v = torch.randn(3, 4), torch.randn(3, 4)
    times = torch.tensor([0.1, 0.2, 0.5])
    endpoints = x - times[:, None] * v
    torch.testing.assert_close(completion_velocities(x, endpoints, times), v)
    with pytest.raises(ValueError, match="one time > 0 per start state"):
        completion_velocities(x, endpoints, torch.tensor([0.1, 0.0, 0.5]))
    with pytest.raises(ValueError, match="do not fit the states"):
        completion_velocities(x, endpoints[:2], times)


def test_contrast_completes_each_sample_from_its_state_nearest_the_contrast_time(model_dir: Path) -> None:
    """distill_target=contrast: the teacher's Euler completion of every sample from its visited state
    at the grid time nearest distill_contrast_from; the pairs put the student's samples first, the
    teacher's after, with the same prompts and groups (so DiffusionNFT's noise is shared)."""
    teacher = FlowPolicyTeacher(pretrained=str(model_dir))
    grid = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    states = torch.randn(2, 4, *teacher.info().latent_shape, generator=torch.Generator().manual_seed(8))
    prompts = ["a red circle", "a blue square"]
    cond = {"text": torch.arange(2.0)[:, None]}
    rollout = Rollout(prompts, torch.tensor([3, 4]), states[:, -1], cond, grid, {STATES: states})
    extras = TeacherTargets(teacher, "visited", target="contrast", contrast_from=0.7).targets(rollout)
    assert set(extras) == {TEACHER_X0}
    x = states[:, 1]  # t = 0.75 is the nearest to 0.7
    for j in range(1, 4):
        x = x + (grid[j + 1] - grid[j]) * teacher.velocity(x, grid[j].expand(2), prompts)
    torch.testing.assert_close(extras[TEACHER_X0], x, rtol=1e-5, atol=1e-5)
    pairs, r = contrast_pairs(replace(rollout, extras={**rollout.extras, **extras}))
    assert r.tolist() == [0.0, 0.0, 1.0, 1.0]
    assert pairs.prompts == prompts * 2 and pairs.group_ids.tolist() == [3, 4, 3, 4]
    assert torch.equal(pairs.x0, torch.cat([states[:, -1], extras[TEACHER_X0]]))
    assert torch.equal(pairs.cond["text"], torch.cat([cond["text"], cond["text"]]))
    with pytest.raises(ValueError, match="lacks the teacher's completions"):
        contrast_pairs(rollout)


def test_contrast_trains_the_student_with_nfts_loss_on_teacher_and_student_samples(
    model_dir: Path, other_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    overrides = _distill(model_dir, run, 2, str(other_dir), "algorithm.distill_target=contrast")
    Trainer(load_config(None, overrides)).fit()
    rows = step_records(run)
    assert len(rows) == 2 and all("loss/distill" not in r for r in rows)
    assert all(r["loss/total"] > 0 and math.isfinite(r["loss/total"]) for r in rows)


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (["algorithm.distill_target=completion", "algorithm.distill_states=noised"], "use visited"),
        (["algorithm.distill_target=completion", "algorithm.distill_completions=11"], "at most that"),
        (["algorithm.distill_target=contrast", "algorithm.distill_states=noised"], "use visited"),
        (["algorithm.distill_target=contrast", "algorithm.nft_coef=1"], "set algorithm.nft_coef=0"),
        (["algorithm.distill_target=contrast", "algorithm.distill_contrast_from=0"], "distill_contrast_from"),
        (["algorithm.distill_target=contrast", "ROUTES"], "give that route a teacher"),
        (["algorithm.distill_target=endpoint", "algorithm.distill_cond_coef=1"], "distill_cond_coef=0"),
    ],
)
def test_completion_and_contrast_refuse_settings_that_do_not_fit(
    model_dir: Path, tmp_path: Path, overrides: list[str], problem: str
) -> None:
    base = _distill(model_dir, tmp_path / "run", 1, str(model_dir))
    routes = _routes(str(model_dir), "none")
    overrides = [*base, "sampling.num_steps=10", *(routes if o == "ROUTES" else o for o in overrides)]
    with pytest.raises(ConfigError, match=problem):  # at load, before any model is built
        load_config(None, overrides)


def test_noised_endpoint_targets_are_flow_matching_on_the_teachers_samples(model_dir: Path) -> None:
    """distill_states=noised with endpoint: the teacher's sample from the student's noise, noised to
    each grid time with noise keyed by the group; the target is that noise minus the sample."""
    teacher = FlowPolicyTeacher(pretrained=str(model_dir))
    grid = torch.tensor([1.0, 0.5, 0.0])
    visited = torch.randn(2, 2, *teacher.info().latent_shape, generator=torch.Generator().manual_seed(4))
    rollout = Rollout(["a red circle"] * 2, torch.tensor([0, 0]), visited[:, -1], {}, grid, {STATES: visited})
    extras = TeacherTargets(teacher, "noised", seed=5, target="endpoint").targets(rollout)
    x = visited[:, 0]
    for k in range(2):
        x = x + (grid[k + 1] - grid[k]) * teacher.velocity(x, grid[k].expand(2), rollout.prompts)
    expected_states = noised_states(Rollout(rollout.prompts, rollout.group_ids, x, {}, grid), seed=5)
    torch.testing.assert_close(extras[STATES], expected_states, rtol=1e-5, atol=1e-5)
    noise = group_noise(rollout, seed=5)  # keyed by the group: the same whatever the sample
    torch.testing.assert_close(extras[TEACHER_V], noise - x[:, None], rtol=1e-5, atol=1e-5)
    assert float((noise[:, 0] - visited[:, 0]).abs().max()) > 0.1  # not the student's own noise
    with pytest.raises(ValueError, match="endpoint distillation need the sampler's states"):
        TeacherTargets(teacher, "noised", target="endpoint").targets(replace(rollout, extras={}))


def test_step_weights_follow_the_squared_step_and_average_one() -> None:
    grid = torch.tensor([1.0, 0.9, 0.6, 0.0])
    weights = state_weights(grid, "step")
    torch.testing.assert_close(weights, torch.tensor([0.01, 0.09, 0.36]) / 0.46 * 3)
    assert float(weights.mean()) == pytest.approx(1.0)
    assert torch.equal(state_weights(grid, "uniform"), torch.ones(3))


def test_x0_weights_are_the_x0_predictions_gap() -> None:
    """x0 weighting: t_k^2, so that w_k ||v_s - v_T||^2 is ||x0_s - x0_T||^2 (x0 = x_t - t v) up to
    the mean-one scale."""
    grid = torch.tensor([1.0, 0.75, 0.4, 0.1, 0.0])
    gen = torch.Generator().manual_seed(0)
    x, v_s, v_t = (torch.randn(4, 6, generator=gen, dtype=torch.float64) for _ in range(3))
    weights = state_weights(grid, "x0").double()
    gaps = []
    for k in range(4):
        t = grid[k].double()
        gaps.append(float((((x - t * v_s) - (x - t * v_t)) ** 2).mean() / ((v_s - v_t) ** 2).mean()))
    torch.testing.assert_close(weights, torch.tensor(gaps, dtype=torch.float64) / (sum(gaps) / 4))


def test_sde_kl_weights_are_the_kl_of_the_two_samplers_steps() -> None:
    """sde_kl weighting: proportional to the closed-form KL of the student's and the teacher's
    Gaussian SDE steps per unit squared velocity gap."""
    from omni_diffusion_rl.algorithms.distill import SDE_KL_NOISE
    from omni_diffusion_rl.algorithms.flow_grpo import gaussian_step_kl, sde_step

    grid = torch.tensor([1.0, 0.75, 0.4, 0.1, 0.0], dtype=torch.float64)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    v_t = torch.randn_like(x)
    v_s = v_t + 0.1
    kls = []
    for k in range(4):
        t, t_next = grid[k].expand(3), grid[k + 1].expand(3)
        _, _, mean_s, std = sde_step(v_s, x, t, t_next, SDE_KL_NOISE, float(grid[1]), x_next=x)
        _, _, mean_t, _ = sde_step(v_t, x, t, t_next, SDE_KL_NOISE, float(grid[1]), x_next=x)
        kls.append(float(gaussian_step_kl(mean_s, mean_t, std).mean()))
    expected = torch.tensor(kls) / (sum(kls) / 4)
    torch.testing.assert_close(state_weights(grid, "sde_kl"), expected.float(), rtol=1e-5, atol=1e-6)
    assert state_weights(grid, "sde_kl").argmax() == 3  # the clean end weighs most, x0 the noisy one
    assert state_weights(grid, "x0").argmax() == 0
    with pytest.raises(ValueError, match="unknown distill weighting 'late'"):
        state_weights(grid, "late")


def test_focus_moves_the_loss_to_where_the_teacher_disagrees_most() -> None:
    from omni_diffusion_rl.algorithms.distill import distillation_loss

    v_t = torch.zeros(2, 4)
    v_s = torch.tensor([[0.1, 0.1, 0.1, 1.0], [0.2, 0.2, 0.2, 0.2]], requires_grad=True)
    weight = torch.ones(2)
    plain = distillation_loss(v_s, v_t, weight)
    assert distillation_loss(v_s, v_t, weight, focus=0.0).item() == plain.item()
    focused = distillation_loss(v_s, v_t, weight, focus=1.0)
    # sample 0: the shares 1/3.25 x (0.1, 0.1, 0.1, 1.0) give its outlier 1/1.3 of the weight
    share = torch.tensor([0.1, 0.1, 0.1, 1.0]) / 0.325
    expected0 = float((share / share.mean() * torch.tensor([0.01, 0.01, 0.01, 1.0])).mean())
    assert focused.item() == pytest.approx((expected0 + 0.04) / 2, rel=1e-6)
    assert focused.item() > plain.item()  # sample 1 (equal gaps) is unchanged, sample 0 weighs its outlier
    (grad,) = torch.autograd.grad(focused, v_s)
    torch.testing.assert_close(grad[1], torch.full((4,), 2 * 0.2 / 4 / 2))  # the weights are constants
    assert distillation_loss(v_t.clone(), v_t, weight, focus=2.0).item() == 0.0  # no gap: no loss, no NaN
    with pytest.raises(ValueError, match="focus must be >= 0"):
        distillation_loss(v_s, v_t, weight, focus=-1.0)


@pytest.mark.slow  # starts training or launcher processes
@pytest.mark.parametrize("mode", ["separate", "hybrid"])
def test_targets_travel_with_the_groups_through_the_buffer(
    model_dir: Path, other_dir: Path, tmp_path: Path, mode: str
) -> None:
    """The rollout process asks the teacher as soon as a group exists; the trainer trains on the
    targets that came with it (a different teacher: the loss is positive on every step)."""
    from .helpers import last_json_line
    from .test_separate import _launch

    run = tmp_path / "run"
    overrides = [
        *_distill(model_dir, run, 3, str(other_dir)),
        f"execution.mode={mode}",
        "execution.data_timeout_s=60",
    ]
    proc = _launch(overrides, 29661 if mode == "separate" else 29663)
    assert proc.returncode == 0, proc.stderr[-4000:]
    buffer = last_json_line(proc.stdout)["execution"]["buffer"]
    assert buffer["trained"] == 3 * 2 * 2, buffer
    rows = step_records(run)
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["loss/distill"] > 0 for r in rows), rows
    # the rollout process's teacher time reaches the trainer's metrics (cumulative, never falling)
    teacher_s = [r["rollout/teacher/seconds"] for r in rows]
    assert teacher_s[-1] > 0 and teacher_s == sorted(teacher_s), teacher_s


def test_cost_measurement_runs_the_teacher_as_part_of_rollout(
    model_dir: Path, other_dir: Path, tmp_path: Path
) -> None:
    """auto and `odrl simulate --measure` time generation with the teacher's targets included."""
    from omni_diffusion_rl.execution.planner import measure
    from omni_diffusion_rl.trainers.experience_kinds import MediaExperience

    calls = []
    original = MediaExperience.cost_rollout

    def counting(self, trainer, *args):  # noqa: ANN001, ANN002, ANN202
        rollout = original(self, trainer, *args)

        def run():  # noqa: ANN202
            out = rollout()
            calls.append(sorted(out.extras))
            return out

        return run

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MediaExperience, "cost_rollout", counting)
        costs = measure.measure_costs(
            load_config(None, _distill(model_dir, tmp_path / "m", 1, str(other_dir))), 3, 3, 1
        )
    assert calls and all(extras == [STATES, TEACHER_V] for extras in calls), calls
    assert costs is not None


@pytest.mark.slow  # starts training or launcher processes
def test_auto_measures_and_runs_distillation(model_dir: Path, other_dir: Path, tmp_path: Path) -> None:
    from .helpers import last_json_line
    from .test_separate import _launch

    run = tmp_path / "run"
    overrides = [
        *_distill(model_dir, run, 3, str(other_dir)),
        "execution.mode=auto",
        "execution.data_timeout_s=60",
    ]
    proc = _launch(overrides, 29665)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = last_json_line(proc.stdout)
    assert summary["samples"]["trained"] == 3 * 2 * 2, summary["samples"]
    assert [r["step"] for r in step_records(run)] == [1, 2, 3]
    assert all(r["loss/distill"] > 0 for r in step_records(run))


def test_pending_extras_wait_only_for_the_rows_asked() -> None:
    """Training may start on a chunk whose targets arrived while a later chunk's are still being
    made; a selection of rows (drops) keeps that, and settling gives every row its own values."""
    from concurrent.futures import Future

    from omni_diffusion_rl.experience.rollout import PendingExtras

    values = torch.arange(10.0).view(10, 1) * torch.ones(10, 3)
    first, second = Future(), Future()
    first.set_result({"v": values[:4]})
    pending = PendingExtras([(0, 4, first), (4, 10, second)])
    assert torch.equal(pending.rows(1, 4)["v"], values[1:4])  # does not wait for the second block
    assert pending.bounds() == [4] and pending.waited_s == 0.0
    chosen = pending.select(torch.tensor([0, 3, 5, 9]))
    assert chosen.bounds() == [2] and torch.equal(chosen.rows(0, 2)["v"], values[[0, 3]])
    second.set_result({"v": values[4:]})
    assert torch.equal(chosen.rows(0, 4)["v"], values[[0, 3, 5, 9]])
    assert torch.equal(pending.rows(0, 10)["v"], values)


def test_a_pending_rollout_settles_before_it_is_joined_or_sent() -> None:
    from concurrent.futures import Future

    from omni_diffusion_rl.experience.rollout import PendingExtras

    done: Future[dict[str, torch.Tensor]] = Future()
    done.set_result({TEACHER_V: torch.ones(2, 3)})
    rollout = Rollout(["a", "b"], torch.tensor([0, 0]), torch.zeros(2, 3), {}, torch.tensor([1.0, 0.0]))
    rollout.pending = PendingExtras([(0, 2, done)])
    sent = Rollout.from_named(rollout.to_named())
    assert rollout.pending is None and torch.equal(sent.extras[TEACHER_V], torch.ones(2, 3))


def test_streamed_targets_train_exactly_as_the_blocking_schedule(
    model_dir: Path, other_dir: Path, tmp_path: Path
) -> None:
    """Overlapped (training takes each chunk's targets when it reaches them) and blocking (every
    target made before generation goes on) give the same losses: only the waiting moves."""
    losses = {}
    for overlap in (True, False):
        run = tmp_path / f"overlap_{overlap}"
        schedule = f"teacher.overlap={str(overlap).lower()}"
        extra = ("sampling.rollout_chunks=2", schedule, "algorithm.nft_coef=1")
        Trainer(load_config(None, _distill(model_dir, run, 3, str(other_dir), *extra))).fit()
        rows = step_records(run)
        losses[overlap] = [r[k] for r in rows for k in ("loss/distill", "loss/total")]
        assert all("teacher/wait_s" in r for r in rows)
    assert losses[True] == pytest.approx(losses[False], rel=1e-6, abs=1e-9)
    assert all(loss > 0 for loss in losses[True])


@pytest.mark.slow
def test_one_step_off_trains_on_the_next_steps_rollouts_made_early_and_resumes_exactly(
    model_dir: Path, other_dir: Path, tmp_path: Path
) -> None:
    """teacher.one_step_off: every step but the first, one after a checkpoint and one after the last
    trains on rollouts made a step early (staleness 1); every sample made is trained; a run stopped
    at its checkpoint and resumed logs what the whole run logs, bit for bit."""
    off = ("teacher.one_step_off=true", "train.checkpoint_every=3", "sampling.rollout_chunks=2")
    whole, split = tmp_path / "whole", tmp_path / "split"
    trainer = Trainer(load_config(None, _distill(model_dir, whole, 5, str(other_dir), *off)))
    made = []
    make_step = trainer.experience.make_step
    trainer.experience.make_step = lambda step, *a: made.append(step) or make_step(step, *a)  # type: ignore[method-assign]
    summary = trainer.fit()
    assert sorted(made) == [0, 1, 2, 3, 4] and trainer.source.ahead is None, (
        "each step made once, all trained"
    )
    rows = step_records(whole)
    assert [r["experience/staleness"] for r in rows] == [0, 1, 1, 0, 1]
    assert summary["samples"]["trained"] == summary["samples"]["generated"] == 5 * 2 * 2
    assert all(r["loss/distill"] > 0 and "teacher/wait_s" in r for r in rows)
    Trainer(load_config(None, _distill(model_dir, split, 3, str(other_dir), *off))).fit()
    resumed = Trainer(load_config(None, _distill(model_dir, split, 5, str(other_dir), *off)))
    resumed.fit(resume=str(split / "checkpoints"))

    def clock_free(records: list[dict]) -> list[dict]:  # the teacher's seconds and waits are timings
        return [{k: v for k, v in r.items() if not k.startswith("teacher/")} for r in records]

    assert clock_free(step_records(split)) == clock_free(rows)
    plain = tmp_path / "plain"
    Trainer(load_config(None, _distill(model_dir, plain, 2, str(other_dir), *off[1:]))).fit()
    first, second = step_records(plain)
    assert first["loss/total"] == rows[0]["loss/total"], "the first step is made on time either way"
    assert second["loss/total"] != rows[1]["loss/total"], "the second trains on rollouts one update old"


def test_one_step_off_is_refused_outside_colocated(model_dir: Path, other_dir: Path, tmp_path: Path) -> None:
    from omni_diffusion_rl.config import ConfigError

    for refused, why in (
        ("algorithm.name=nft", "asks no teacher"),
        ("teacher.overlap=false", "needs teacher.overlap=true"),
    ):
        with pytest.raises(ConfigError, match=why):
            load_config(
                None,
                _distill(model_dir, tmp_path / "x", 1, str(other_dir), "teacher.one_step_off=true", refused),
            )
    extra = ("teacher.one_step_off=true", "execution.mode=separate")
    with pytest.raises(
        ConfigError, match="teacher.one_step_off is a colocated schedule.*execution.mode=colocated"
    ):
        load_config(None, _distill(model_dir, tmp_path / "run", 2, str(other_dir), *extra))


# ---------------------------------------------------------------------------------------------------------
# Teachers per part of the latent (teacher.routes)

VIDEO, AUDIO = ["picture", "visibility"], ["spectrum", "loudness"]


def _routes(video: str, audio: str) -> str:
    def route(parts: list[str], teacher: str) -> str:
        spec = "name: none" if teacher == "none" else f"options: {{family: tiny_av, pretrained: {teacher}}}"
        return f"{{parts: [{', '.join(parts)}], {spec}}}"

    return f"teacher.routes={{video: {route(VIDEO, video)}, audio: {route(AUDIO, audio)}}}"


def test_each_route_answers_for_its_parts_of_the_latent(model_dir: Path, other_dir: Path) -> None:
    from omni_diffusion_rl.experience.teacher_routes import RoutedTeacher, route_entries
    from omni_diffusion_rl.models.tiny_av import TinyAVPolicy

    parts = TinyAVPolicy.from_pretrained(str(model_dir)).transformer.layout.parts()
    routes = {"video": {"parts": VIDEO}, "audio": {"parts": AUDIO}}
    entries = route_entries(parts, routes, (sum(b - a for a, b in parts.values()),))
    a, b = FlowPolicyTeacher(pretrained=str(model_dir)), FlowPolicyTeacher(pretrained=str(other_dir))
    dim = a.info().latent_shape[0]
    assert sorted(torch.cat(list(entries.values())).tolist()) == list(range(dim)), "every entry once"
    routed = RoutedTeacher({"video": a, "audio": b}, entries, dim)
    x = torch.randn(3, dim, generator=torch.Generator().manual_seed(0))
    t, prompts = torch.full((3,), 0.5), ["a red circle with a low tone at the start"] * 3
    v, va, vb = routed.velocity(x, t, prompts), a.velocity(x, t, prompts), b.velocity(x, t, prompts)
    assert torch.equal(v[:, entries["video"]], va[:, entries["video"]])
    assert torch.equal(v[:, entries["audio"]], vb[:, entries["audio"]]) and bool(routed.answered.all())
    half = RoutedTeacher({"video": a, "audio": None}, entries, dim)
    assert torch.equal(
        half.velocity(x, t, prompts)[:, entries["audio"]], torch.zeros(3, len(entries["audio"]))
    )
    assert half.answered.sum() == len(entries["video"])


@pytest.mark.parametrize(
    ("routes", "error"),
    [
        ({"video": {"parts": VIDEO}}, r"no route for \['spectrum', 'loudness'\].*name: none"),
        ({"v": {"parts": [*VIDEO, *AUDIO, "depth"]}}, r"no part \['depth'\]"),
    ],
)
def test_routes_that_leave_out_or_invent_a_part_are_refused(
    model_dir: Path, routes: dict, error: str
) -> None:
    from omni_diffusion_rl.config import ConfigError
    from omni_diffusion_rl.experience.teacher_routes import route_entries
    from omni_diffusion_rl.models.tiny_av import TinyAVPolicy

    with pytest.raises(ConfigError, match=error):
        route_entries(TinyAVPolicy.from_pretrained(str(model_dir)).transformer.layout.parts(), routes, (796,))
    with pytest.raises(ConfigError, match="names no parts to route"):
        route_entries(None, routes, (796,))


@pytest.mark.parametrize(
    ("override", "error"),
    [
        (
            "teacher.routes={a: {parts: [picture]}, b: {parts: [picture, spectrum]}}",
            "part 'picture' is in routes 'a' and 'b'",
        ),
        ("teacher.routes={a: {parts: []}}", "non-empty list"),
        ("teacher.routes={a: {parts: [picture], teacher: policy}}", r"unknown keys \['teacher'\]"),
        (  # the options of a served route were ignored without a word
            "teacher.routes={a: {parts: [picture], urls: ['http://127.0.0.1:9'], options: {cfg_scale: 2}}}",
            "teacher.routes.a: options and urls both given",
        ),
    ],
)
def test_bad_routes_are_refused_at_config_load(
    model_dir: Path, tmp_path: Path, override: str, error: str
) -> None:
    from omni_diffusion_rl.config import ConfigError

    with pytest.raises(ConfigError, match=error):
        load_config(None, _distill(model_dir, tmp_path / "run", 1, str(model_dir), override))


def test_routed_distillation_trains_only_what_a_route_teaches(
    model_dir: Path, other_dir: Path, tmp_path: Path
) -> None:
    """Both routes to one teacher train exactly as that teacher alone; with the audio route `none`
    the loss is the video's entries' alone (the loss's own test: below)."""
    losses = {}
    for name, extra in (
        ("whole", ()),
        ("both", (_routes(str(other_dir), str(other_dir)), "teacher.options={}")),
        ("video", (_routes(str(other_dir), "none"), "teacher.options={}")),
    ):
        Trainer(load_config(None, _distill(model_dir, tmp_path / name, 2, str(other_dir), *extra))).fit()
        losses[name] = [r["loss/distill"] for r in step_records(tmp_path / name)]
    assert losses["both"] == losses["whole"]
    assert 0 < losses["video"][0] != losses["whole"][0]


def test_a_none_routes_entries_of_a_completion_follow_the_students_states(model_dir: Path) -> None:
    """Completions through routes, the audio one `none`: the video entries are the teacher's Euler
    completion, the audio entries the student's own (its last state stepped to its sample); asked at
    every grid time (a sharded teacher's same forwards) or only once started, the same completions."""
    from omni_diffusion_rl.experience.teacher_routes import RoutedTeacher, route_entries
    from omni_diffusion_rl.models.tiny_av import TinyAVPolicy

    parts = TinyAVPolicy.from_pretrained(str(model_dir)).transformer.layout.parts()
    routes = {"video": {"parts": VIDEO}, "audio": {"parts": AUDIO}}
    entries = route_entries(parts, routes, (796,))
    teacher = FlowPolicyTeacher(pretrained=str(model_dir))
    half = RoutedTeacher({"video": teacher, "audio": None}, entries, 796)
    grid = torch.tensor([1.0, 0.6, 0.3, 0.0])
    states = torch.randn(4, 3, 796, generator=torch.Generator().manual_seed(9))
    x0 = torch.randn(4, 796, generator=torch.Generator().manual_seed(10))
    rollout = Rollout(["a red circle"] * 4, torch.tensor([1, 1, 2, 2]), x0, {}, grid, {STATES: states})
    made = TeacherTargets(half, "visited", target="completion", completions=2).targets(rollout)
    same = TeacherTargets(half, "visited", target="completion", completions=2, same_forwards=True)
    torch.testing.assert_close(same.targets(rollout)[TEACHER_V], made[TEACHER_V], rtol=1e-5, atol=1e-6)
    audio, video = entries["audio"], entries["video"]
    for row, k in made[COMPLETED].nonzero().tolist():
        target = made[TEACHER_V][row, k]
        # the audio entries land on the student's sample: target (x_k - x0) / t_k there
        torch.testing.assert_close(target[audio], (states[row, k, audio] - x0[row, audio]) / grid[k])
        x = states[row, k][None].clone()
        for j in range(k, 3):
            x = x + (grid[j + 1] - grid[j]) * teacher.velocity(x, grid[j].view(1), ["a red circle"])
            x[0, audio] = states[row, j + 1, audio] if j + 1 < 3 else x0[row, audio]
        expected = (states[row, k, video] - x[0, video]) / grid[k]
        torch.testing.assert_close(target[video], expected, rtol=1e-4, atol=1e-4)


def test_contrast_pairs_share_nfts_noise_and_times_and_take_r_from_who_made_them(
    model_dir: Path, tmp_path: Path
) -> None:
    """Each student sample and its teacher completion are trained on the same noise and time, the
    student's with r = 0, the teacher's with r = 1; counts that do not fit distill_completions are
    an error."""
    from omni_diffusion_rl.trainers.distill import completed_order
    from omni_diffusion_rl.trainers.skeleton import noised_inputs

    cfg = load_config(None, [*_distill(model_dir, tmp_path / "run", 1, str(model_dir)), "data.group_size=2"])
    grid = torch.linspace(1, 0, 5)
    rollout = Rollout(
        ["a red circle"] * 2 + ["a blue square"] * 2,
        torch.tensor([7, 7, 9, 9]),
        torch.randn(4, 796),
        {},
        grid,
    )
    pairs, r = contrast_pairs(replace(rollout, extras={TEACHER_X0: torch.randn(4, 796)}))
    assert r.tolist() == [0.0] * 4 + [1.0] * 4
    for t, noise, _ in noised_inputs(cfg, pairs, step=3):
        assert torch.equal(t[:4], t[4:]) and torch.equal(noise[:4], noise[4:])
    assert not torch.equal(noised_inputs(cfg, pairs, 3)[0][1][0], noised_inputs(cfg, pairs, 3)[0][1][1])
    completed = torch.tensor([[True, False, True], [False, True, True]])
    assert completed_order(completed, 2).tolist() == [[0, 2], [1, 2]]
    with pytest.raises(ValueError, match=r"made for \[2\] states per sample, not .*=3"):
        completed_order(completed, 3)


@pytest.mark.parametrize("focus", [0.0, 1.0])
def test_the_loss_of_a_none_route_is_the_loss_without_its_entries(focus: float) -> None:
    from omni_diffusion_rl.algorithms.distill import distillation_loss

    gen = torch.Generator().manual_seed(0)
    v_student, v_teacher = torch.randn(3, 10, generator=gen), torch.randn(3, 10, generator=gen)
    answered = torch.zeros(3, 10, dtype=torch.bool)
    answered[:, :6] = True
    weight = torch.tensor([1.0, 0.5, 2.0])
    routed = distillation_loss(v_student, v_teacher * answered, weight, focus, answered)
    alone = distillation_loss(v_student[:, :6], v_teacher[:, :6], weight, focus)
    torch.testing.assert_close(routed, alone, rtol=1e-6, atol=0)


def test_the_shipped_per_modality_teachers_route_together(model_dir: Path, tmp_path: Path) -> None:
    """builtin-teacher-video and builtin-teacher-audio: guided by their folders' recommendation, and
    routed over a student (video teacher on the video's parts, audio on the audio's) they pass the
    start checks and train; swapped, their trained parts refuse them (the probe would not)."""
    for name in ("builtin-teacher-video", "builtin-teacher-audio"):
        assert FlowPolicyTeacher(pretrained=name).cfg_scale == TEACHER_GUIDANCE
    routed = (_routes("builtin-teacher-video", "builtin-teacher-audio"), "teacher.options={}")
    run = tmp_path / "routed"
    Trainer(load_config(None, _distill(model_dir, run, 1, "builtin-teacher", *routed))).fit()
    assert step_records(run)[0]["loss/distill"] > 0
    swapped = (_routes("builtin-teacher-audio", "builtin-teacher-video"), "teacher.options={}")
    cfg = load_config(None, _distill(model_dir, tmp_path / "swapped", 1, "builtin-teacher", *swapped))
    with pytest.raises(TeacherMismatch, match=r"route 'video' .* trained on spectrum, loudness only"):
        Trainer(cfg)


def test_a_teacher_of_some_parts_is_refused_for_the_others(model_dir: Path, tmp_path: Path) -> None:
    """A folder's trained_parts.json (odrl pretrain --parts) marks the other parts' heads untrained:
    such a teacher is refused as the whole latent's teacher and for a route with other parts, though
    the convention probe passes it; bad files are refused naming the file; the parts cross /info."""
    from omni_diffusion_rl.teacher import TeacherInfo, check_trained_parts

    folder = tmp_path / "video_teacher"
    shutil.copytree(model_dir, folder)
    (folder / "trained_parts.json").write_text('{"parts": ["picture", "visibility"]}')
    assert FlowPolicyTeacher(pretrained=str(folder)).info().trained_parts == ("picture", "visibility")
    alone = load_config(None, _distill(model_dir, tmp_path / "alone", 1, str(folder)))
    with pytest.raises(TeacherMismatch, match=r"trained on picture, visibility only, not spectrum, loudness"):
        Trainer(alone)
    wrong_route = (_routes(str(model_dir), str(folder)), "teacher.options={}")
    with pytest.raises(TeacherMismatch, match=r"route 'audio' .* only, not spectrum, loudness"):
        Trainer(load_config(None, _distill(model_dir, tmp_path / "r", 1, str(model_dir), *wrong_route)))
    info = FlowPolicyTeacher(pretrained=str(folder)).info()
    assert TeacherInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info
    with pytest.raises(TeacherMismatch, match="names no parts to route"):  # a latent without parts
        check_trained_parts(info, [], "teacher 'policy'")
    with pytest.raises(TeacherMismatch, match="trained_parts"):
        TeacherInfo.from_dict({**info.to_dict(), "trained_parts": ["x"] * 1000})
    for bad in ('{"parts": []}', '{"parts": ["Picture!"]}', '{"parts": "picture"}', '{"parts": ["a", "a"]}'):
        (folder / "trained_parts.json").write_text(bad)
        with pytest.raises(ConfigError, match=r"trained_parts.json: parts must be 1 to 32 distinct names"):
            FlowPolicyTeacher(pretrained=str(folder))


def test_a_route_whose_teacher_fails_the_probe_is_refused_by_name(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The convention probe runs on each route's own entries: a flipped audio teacher is caught
    though the picture (most of the latent) would carry a probe of the whole."""

    class Flipped(FlowPolicyTeacher):
        def velocity(self, x_t: torch.Tensor, t: torch.Tensor, prompts: list[str]) -> torch.Tensor:
            return -super().velocity(x_t, t, prompts)

    monkeypatch.setitem(teachers._factories, "flipped", Flipped)  # noqa: SLF001
    routes = (
        f"teacher.routes={{video: {{parts: [{', '.join(VIDEO)}], options: {{pretrained: {model_dir}}}}}, "
        f"audio: {{parts: [{', '.join(AUDIO)}], name: flipped, options: {{pretrained: {model_dir}}}}}}}"
    )
    cfg = load_config(
        None, _distill(model_dir, tmp_path / "run", 1, str(model_dir), routes, "teacher.options={}")
    )
    with pytest.raises(TeacherMismatch, match="teacher of route 'audio' \\(spectrum, loudness\\) fails"):
        Trainer(cfg)
