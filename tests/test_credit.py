"""Per-modality credit (algorithm.credit=per_modality): routes, entries, losses, and the runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_diffusion_rl.algorithms.advantages import group_advantages
from omni_diffusion_rl.algorithms.credit import (
    JUDGES,
    check_entries,
    modality_routes,
    modality_weights,
    per_modality_loss,
)
from omni_diffusion_rl.algorithms.nft import nft_loss
from omni_diffusion_rl.config import REWARD_MODALITIES, ConfigError, load_config
from omni_diffusion_rl.experience.rollout import Rollout
from omni_diffusion_rl.experience.sampling import sample_sde
from omni_diffusion_rl.models.gradient_surgery import OMNINFT_LTX2_A2V_SCALES, block_scales
from omni_diffusion_rl.models.policy import modality_entries
from omni_diffusion_rl.models.tiny_av import TinyAVPolicy
from omni_diffusion_rl.models.tiny_sync import TinySyncPolicy
from omni_diffusion_rl.reward_factory import reward_from_config
from omni_diffusion_rl.trainers.skeleton import Work, trained_rows
from omni_diffusion_rl.trainers.trainer import Trainer
from omni_diffusion_rl.trainers.update_batch import UpdateBatch

from .helpers import step_records

RECIPE = "recipes/configs/tiny_sync_nft_per_modality.yaml"
DECLARED = {"sync": "audio_video", "heard": "audio", "seen": "video", "look": "video"}


def test_a_synchrony_reward_feeds_both_modalities_and_each_other_only_its_own() -> None:
    routes = modality_routes(DECLARED, ("video", "audio"))
    assert routes == {"video": ["look", "seen", "sync"], "audio": ["heard", "sync"]}
    weighted = modality_routes(DECLARED, ("video", "audio"), {"sync": 1, "heard": 1, "seen": 0, "look": 1})
    assert weighted["video"] == ["look", "sync"], "a reward of weight 0 feeds no advantage"


def test_a_reward_without_a_modality_or_a_modality_without_a_reward_is_named() -> None:
    with pytest.raises(ValueError, match=r"mine \(None\).*`modality` attribute.*reward.modalities"):
        modality_routes({**DECLARED, "mine": None}, ("video", "audio"))
    with pytest.raises(ValueError, match=r"'sound'"):
        modality_routes({"mine": "sound"}, ("video", "audio"))
    with pytest.raises(ValueError, match="no reward judges the audio"):
        modality_routes({"look": "video"}, ("video", "audio"))


def test_entries_must_split_the_latent_once_each() -> None:
    check_entries({"video": torch.arange(0, 3), "audio": torch.arange(3, 5)}, 5)
    with pytest.raises(ValueError, match="cover the latent's 5 entries once each"):
        check_entries({"video": torch.arange(0, 3), "audio": torch.arange(2, 5)}, 5)
    with pytest.raises(ValueError, match="cover"):
        check_entries({"video": torch.arange(0, 3), "audio": torch.arange(3, 4)}, 5)


def _batch(scores: dict[str, list[float]], weights: dict[str, float], groups: list[int]) -> UpdateBatch:
    parts = {name: torch.tensor(values) for name, values in scores.items()}
    total = sum(weights[n] * parts[n] for n in weights) / sum(weights.values())
    n = len(groups)
    empty = Rollout([""] * n, torch.tensor(groups), torch.zeros(n, 1), {}, torch.zeros(2))
    keep = torch.ones(n, dtype=torch.bool)
    return UpdateBatch(empty, total, torch.tensor(groups), keep, slice(0, n), 0, parts, weights, DECLARED)


def test_each_modalitys_advantage_is_that_of_the_rewards_judging_it() -> None:
    gen = torch.Generator().manual_seed(0)
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    scores = {name: torch.rand(8, generator=gen).tolist() for name in DECLARED}
    weights = {"sync": 1.0, "heard": 2.0, "seen": 0.5, "look": 1.5}
    batch = _batch(scores, weights, groups)
    got = batch.modality_advantages(["video", "audio"])
    t = {name: torch.tensor(v) for name, v in scores.items()}
    video = (1.0 * t["sync"] + 0.5 * t["seen"] + 1.5 * t["look"]) / 3.0
    audio = (1.0 * t["sync"] + 2.0 * t["heard"]) / 3.0
    assert torch.allclose(got[:, 0], group_advantages(video, torch.tensor(groups)), atol=1e-6)
    assert torch.allclose(got[:, 1], group_advantages(audio, torch.tensor(groups)), atol=1e-6)
    assert not torch.allclose(got[:, 0], got[:, 1]), "the two modalities were credited alike"


def _nft_term(v: torch.Tensor, v_old: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, t: torch.Tensor):
    def term(_: int, index: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return nft_loss(v[:, index], v_old[:, index], x_t[:, index], x0[:, index], t, r, 1.0, 5.0)

    return term


def test_a_modalitys_gradient_follows_its_own_credit_only() -> None:
    """Changing the audio's credit moves the gradient on the audio entries and leaves the video's."""
    gen = torch.Generator().manual_seed(1)
    b, d = 4, 10
    entries = {"video": torch.tensor([0, 1, 2, 7]), "audio": torch.tensor([3, 4, 5, 6, 8, 9])}
    v_old, x_t, x0 = (torch.randn(b, d, generator=gen) for _ in range(3))
    t = torch.rand(b, generator=gen)

    def gradient(r: torch.Tensor) -> torch.Tensor:
        v = (v_old + 0.1 * torch.randn(b, d, generator=torch.Generator().manual_seed(2))).requires_grad_()
        loss, _ = per_modality_loss(entries, r, _nft_term(v, v_old, x_t, x0, t))
        loss.backward()
        return v.grad

    video_r = torch.tensor([0.9, 0.1, 0.6, 0.3])
    first = gradient(torch.stack([video_r, torch.tensor([0.2, 0.8, 0.5, 0.5])], dim=1))
    second = gradient(torch.stack([video_r, torch.tensor([0.9, 0.1, 0.0, 1.0])], dim=1))
    assert torch.equal(first[:, entries["video"]], second[:, entries["video"]])
    assert not torch.allclose(first[:, entries["audio"]], second[:, entries["audio"]])


def test_the_modalities_losses_are_their_mean_or_weighted_by_their_entries() -> None:
    entries = {"video": torch.arange(0, 1), "audio": torch.arange(1, 4)}
    assert modality_weights(entries, "equal") == {"video": 0.5, "audio": 0.5}
    assert modality_weights(entries, "entries") == {"video": 0.25, "audio": 0.75}
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])

    def mean_times_credit(_: int, index: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return (a[:, None] * x[:, index]).mean(), {}

    same = torch.tensor([[2.0, 2.0]])
    by_entries, _ = per_modality_loss(entries, same, mean_times_credit, "entries")
    assert by_entries == pytest.approx(float((2.0 * x).mean())), "one credit for both: the global mean"
    equal, _ = per_modality_loss(entries, same, mean_times_credit, "equal")
    assert equal == pytest.approx(0.5 * 2.0 * 1.0 + 0.5 * 2.0 * 3.0)


def _ltx2() -> object:
    from omni_diffusion_rl.models.ltx2 import LTX2Policy

    from .ltx2_tiny import CLIP, tiny_ltx2_pipeline

    return LTX2Policy(tiny_ltx2_pipeline(), **CLIP)


def _h3() -> object:
    from omni_diffusion_rl.models.minimax_h3 import MiniMaxH3Policy

    from .h3_tiny import CLIP, tiny_h3_components

    return MiniMaxH3Policy(tiny_h3_components(), **CLIP)


POLICIES = {
    "tiny_sync": lambda: TinySyncPolicy.from_pretrained("builtin"),
    "tiny_av": lambda: TinyAVPolicy.from_pretrained("builtin"),
    "ltx2": _ltx2,
    "minimax_h3": _h3,
}


@pytest.mark.parametrize("family", sorted(POLICIES))
def test_a_models_video_entries_draw_the_picture_and_its_audio_entries_the_sound(family: str) -> None:
    """Negating one modality's entries changes that modality's decoded media and never the other's."""
    policy = POLICIES[family]()
    entries = modality_entries(policy)
    check_entries(entries, policy.latent_shape[0])
    x = torch.rand(2, *policy.latent_shape, generator=torch.Generator().manual_seed(4)) * 2 - 1
    base = policy.decode(x)
    for moved, kept in (("video", "audio"), ("audio", "video")):
        y = x.clone()
        y[:, entries[moved]] = -y[:, entries[moved]]
        media = policy.decode(y)
        assert torch.equal(getattr(media, kept), getattr(base, kept)), f"{moved} entries changed the {kept}"
        assert not torch.equal(getattr(media, moved), getattr(base, moved)), f"{moved} entries draw nothing"


def test_the_recipes_rewards_declare_what_they_judge() -> None:
    cfg = load_config(RECIPE, [])
    reward = reward_from_config(cfg.reward)
    assert reward.modalities == {"sync_onsets": "audio_video", "heard_count": "audio", "seen_count": "video"}
    overridden = reward_from_config(load_config(RECIPE, ["reward.modalities={sync_onsets: audio}"]).reward)
    assert overridden.modalities["sync_onsets"] == "audio"
    with pytest.raises(ConfigError, match="reward.modalities.sync_onsets: 'sound' is not a modality"):
        load_config(RECIPE, ["reward.modalities={sync_onsets: sound}"])
    assert set(JUDGES) == set(REWARD_MODALITIES), "the config's names are the routes' names"
    with pytest.raises(ConfigError, match="reward.modalities.clap: modalities for a reward"):
        load_config(RECIPE, ["reward.modalities={clap: audio}"])


def _quick(run: Path, steps: int = 2) -> list[str]:
    return [
        f"train.output_dir={run}",
        f"train.steps={steps}",
        "data.prompts_per_step=2",
        "data.group_size=4",
        "data.eval_samples=4",
        "sampling.num_steps=4",
        "sampling.eval_num_steps=4",
        "train.preview_every=0",
        "train.checkpoint_every=0",
        "train.progress=false",
        "tracking.wandb=false",
        "model.lora_rank=4",
        "model.lora_alpha=8",
    ]


AWM = "algorithm={name: awm, credit: per_modality, timestep_fraction: 1.0, awm_timesteps: 2}"
FLOW_GRPO = "algorithm={name: flow_grpo, credit: per_modality, kl_coef: 0.4}"


@pytest.mark.parametrize("algorithm", [None, AWM])
def test_a_per_modality_run_trains_and_logs_each_modalitys_credit(
    tmp_path: Path, algorithm: str | None
) -> None:
    cfg = load_config(RECIPE, [*_quick(tmp_path / "run"), *([algorithm] if algorithm else [])])
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.transformer.named_parameters() if v.requires_grad}
    trainer.fit()
    moved = [
        k
        for k, v in trainer.transformer.named_parameters()
        if v.requires_grad and not torch.equal(v, before[k])
    ]
    assert moved, "the update moved no weight"
    rows = [r for r in step_records(tmp_path / "run") if "loss/total" in r]
    assert len(rows) == 2
    for row in rows:
        assert 0 <= row["credit/agreement"] <= 1
        assert {"credit/video_mean", "credit/audio_mean"} <= set(row)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward.weights={seen_count: 1.0}"], "no reward judges the audio"),
        (
            ["reward.weights={sync_onsets: 0.0, heard_count: 0.0, seen_count: 1.0}"],
            "no reward judges the audio",
        ),
    ],
)
def test_a_per_modality_run_without_a_reward_for_a_modality_stops_before_its_first_step(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    cfg = load_config(RECIPE, [*_quick(tmp_path / "run"), *overrides, "reward.options={}"])
    with pytest.raises(ConfigError, match=message):
        Trainer(cfg)


def test_per_modality_credit_is_refused_where_it_cannot_apply(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="distillation learns from a teacher"):
        load_config("recipes/configs/tiny_t2av_distill.yaml", ["algorithm.credit=per_modality"])
    with pytest.raises(ConfigError, match="credit"):
        load_config(None, ["algorithm.name=raft", "algorithm.credit=per_modality"])


def test_each_modalitys_sde_log_probability_averages_its_own_entries() -> None:
    """Per modality, a step's log-probabilities are the means over each modality's entries: weighted
    by their entries they give back the one log-probability of the whole latent."""
    gen = torch.Generator().manual_seed(5)
    steps, d = 5, 7
    groups = (torch.tensor([0, 1, 5]), torch.tensor([2, 3, 4, 6]))
    grid = torch.linspace(1.0, 0.0, steps + 1)
    sde_steps = torch.tensor([True, True, False, True, False])
    noise, step_noise = torch.randn(3, d, generator=gen), torch.randn(3, 3, d, generator=gen)
    velocity = lambda x, t: 0.3 * x - t.view(-1, 1)  # noqa: E731
    x0, states, whole = sample_sde(velocity, noise, grid, 0.7, sde_steps, step_noise)
    x0_g, states_g, per_group = sample_sde(velocity, noise, grid, 0.7, sde_steps, step_noise, groups)
    assert torch.equal(x0, x0_g) and torch.equal(states, states_g), "the groups change only what is recorded"
    assert per_group.shape == (3, steps, 2)
    assert torch.allclose((3 * per_group[..., 0] + 4 * per_group[..., 1]) / 7, whole, atol=1e-6)
    assert not torch.allclose(per_group[..., 0], per_group[..., 1])


def test_flow_grpo_per_modality_trains_on_the_recorded_log_probabilities(tmp_path: Path) -> None:
    """Flow-GRPO per modality on the sync world: each modality's ratio starts at 1 (its recorded
    log-probability is the trained policy's), and the update moves the adapter."""
    overrides = [*_quick(tmp_path / "run"), FLOW_GRPO, "sampling.solver=euler"]
    cfg = load_config(RECIPE, overrides)
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.transformer.named_parameters() if v.requires_grad}
    trainer.fit()
    after = dict(trainer.transformer.named_parameters())
    assert any(not torch.equal(after[k], v) for k, v in before.items()), "the update moved no weight"
    rows = [r for r in step_records(tmp_path / "run") if "loss/total" in r]
    assert len(rows) == 2
    for row in rows:
        assert row["grpo/logp_gap"] < 1e-4 and row["loss/kl"] >= 0 and 0 <= row["credit/agreement"] <= 1


def test_omninfts_gradient_surgery_parses_blocks_and_refuses_bad_ones() -> None:
    assert block_scales({"0": 0.0, "1-3": 0.1, "7": 1}, 8) == {0: 0.0, 1: 0.1, 2: 0.1, 3: 0.1, 7: 1.0}
    assert block_scales(OMNINFT_LTX2_A2V_SCALES, 48)[45] == 0.3
    for spec, message in [
        ({"0-8": 0.1}, "outside this model's 0-7"),
        ({"0": 1.5}, r"must be in \[0, 1\]"),
        ({"a": 0.1}, "not a block or a range"),
        ({"1-3": 0.1, "3": 0.2}, "block 3 is named twice"),
    ]:
        with pytest.raises(ValueError, match=message):
            block_scales(spec, 8)


def test_gradient_surgery_keeps_ltx2s_forward_and_cuts_the_video_losss_gradient_into_the_audio_stream() -> (
    None
):
    """With every block at 0, a loss on the video alone sends nothing to the audio stream's own
    weights, while the cross-attention's weights keep their gradient; the forward is bit-equal."""
    from omni_diffusion_rl.models.ltx2 import LTX2Policy

    from .ltx2_tiny import CLIP, tiny_ltx2_pipeline

    plain, cut = (
        LTX2Policy(tiny_ltx2_pipeline(), **CLIP, a2v_gradient_scales=s) for s in (None, {"0-1": 0.0})
    )
    x = torch.randn(2, *plain.latent_shape, generator=torch.Generator().manual_seed(6))
    t = torch.tensor([0.7, 0.3])

    def video_loss_gradients(policy: LTX2Policy) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        v = policy.velocity(x, t, policy.encode_prompts(["a drum", "a bell"]))
        policy.transformer.zero_grad()
        v[:, : policy.video_size].square().sum().backward()
        named = dict(policy.transformer.named_parameters())
        return v.detach(), {k: named[k].grad for k in named if "transformer_blocks" in k}

    v_plain, plain_grads = video_loss_gradients(plain)
    v_cut, cut_grads = video_loss_gradients(cut)
    assert torch.equal(v_plain, v_cut)
    audio_own = [k for k in cut_grads if ".audio_attn1.to_q.weight" in k]
    a2v_keys = [k for k in cut_grads if ".audio_to_video_attn.to_k.weight" in k]
    assert len(audio_own) == len(a2v_keys) == 2
    for k in audio_own:
        assert plain_grads[k].abs().sum() > 0 and cut_grads[k] is not None and not cut_grads[k].any(), k
    for k in a2v_keys:
        assert torch.equal(cut_grads[k], plain_grads[k]), (
            "the cross-attention's own weights keep their gradient"
        )


@pytest.mark.parametrize("algorithm", [None, AWM, FLOW_GRPO])
def test_an_algorithms_loss_sends_each_modalitys_credit_to_its_own_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algorithm: str | None
) -> None:
    """The same step scored twice, the sound's own reward (heard_count) redrawn: through the
    algorithm's real plan and loss, the gradient reaching the velocity's video entries is the same
    and the audio entries' is not."""
    cfg = load_config(RECIPE, [*_quick(tmp_path / "run"), *([algorithm] if algorithm else [])])
    trainer = Trainer(cfg)
    prompts, ids = trainer.prompts_for_step(0)
    rollout, scored = trainer.experience.make_step(0, prompts, ids)
    n, keep = len(rollout), torch.ones(len(rollout), dtype=torch.bool)
    redrawn = dict(scored.parts)
    redrawn["heard_count"] = torch.rand(n, generator=torch.Generator().manual_seed(7))
    policy, captured = trainer.policy, []
    velocity = policy.velocity

    def recorded(x: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        v = velocity(x, t, cond)
        if v.requires_grad:
            v.retain_grad()
            captured.append(v)
        return v

    monkeypatch.setattr(policy, "velocity", recorded)
    grads = []
    for parts in (scored.parts, redrawn):
        batch = UpdateBatch.scored(
            rollout, scored.total, rollout.group_ids, keep, slice(0, n), 0, parts, trainer.reward
        )
        plan = trainer.algorithm.plan(batch)
        plan.data.pop("trainable", None)
        work = Work.of(rollout, plan, trained_rows(plan.trained, n, False))
        loss, _ = trainer.algorithm.loss(next(iter(trainer.algorithm.sweep(work))))
        loss.backward()
        grads.append(captured[-1].grad)
    entries = trainer.algorithm.entries
    assert torch.equal(grads[0][:, entries["video"]], grads[1][:, entries["video"]])
    assert not torch.allclose(grads[0][:, entries["audio"]], grads[1][:, entries["audio"]])


def test_a_model_of_one_modality_or_imagebinds_mixed_mode_is_refused_before_any_step(tmp_path: Path) -> None:
    from .helpers import tiny_sd3

    tiny_sd3().save_pretrained(tmp_path / "sd3" / "transformer")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a bright sky at dawn\na dark room at night\n", encoding="utf-8")
    overrides = [
        "model.family=sd3",
        f"model.pretrained={tmp_path / 'sd3'}",
        f"data.prompts={prompts}",
        f"data.eval_prompts={prompts}",
        "eval.metrics=[]",
        "reward.weights={color_match: 1.0}",
        "reward.modalities={color_match: audio_video}",
        "algorithm.credit=per_modality",
        *_quick(tmp_path / "run"),
    ]
    with pytest.raises(ConfigError, match="does not say where its video and its audio lie"):
        Trainer(load_config(None, overrides))
    from rewards.imagebind import JUDGED_BY_MODE

    assert JUDGED_BY_MODE["all"] is None and JUDGED_BY_MODE["text_audio"] == "audio"
