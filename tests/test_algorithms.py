"""DiffusionNFT math: group advantages, optimality probability, the NFT loss, decay schedules, soft updates.

Expected numbers are worked out with plain Python floats from the formulas in ALGORITHMS.md, never by
calling the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from omni_diffusion_rl.algorithms.advantages import (
    ADV_MODES,
    group_advantages,
    optimality_probability,
    per_reward_advantages,
)
from omni_diffusion_rl.algorithms.nft import flow_matching_loss, nft_loss
from omni_diffusion_rl.algorithms.soft_update import DECAY_SCHEDULES, old_adapter_decay
from omni_diffusion_rl.models import lora

EPS = 1e-4

# ---------------------------------------------------------------------------------------------------------
# Group advantages


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _pop_std(xs: list[float]) -> float:
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


# Two interleaved groups with different spreads, identified by arbitrary (non-contiguous) ids.
REWARDS = [1.0, 10.0, 2.0, 14.0, 3.0, 12.0]
GROUPS = [7, 3, 7, 3, 7, 3]


def _hand_advantages(per_group_std: bool) -> list[float]:
    by_group: dict[int, list[float]] = {}
    for r, g in zip(REWARDS, GROUPS, strict=True):
        by_group.setdefault(g, []).append(r)
    global_std = _pop_std(REWARDS)
    out = []
    for r, g in zip(REWARDS, GROUPS, strict=True):
        std = _pop_std(by_group[g]) if per_group_std else global_std
        out.append((r - _mean(by_group[g])) / (std + EPS))
    return out


def test_group_advantages_global_std_matches_hand_computation() -> None:
    # group 7: mean 2, group 3: mean 12; batch std = population std of all six rewards.
    expected = _hand_advantages(per_group_std=False)
    got = group_advantages(torch.tensor(REWARDS), torch.tensor(GROUPS))
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    # Sanity of the hand numbers themselves: the batch std is about 5.19, so |A| stays below 0.5.
    assert max(abs(a) for a in expected) < 0.5


def test_group_advantages_per_group_std_matches_hand_computation() -> None:
    expected = _hand_advantages(per_group_std=True)
    got = group_advantages(torch.tensor(REWARDS), torch.tensor(GROUPS), per_group_std=True)
    assert got.tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    # Group 7 has std sqrt(2/3), group 3 std sqrt(8/3): the per-group advantages are +-sqrt(3/2) and 0.
    assert got[0].item() == pytest.approx(-1.0 / (math.sqrt(2 / 3) + EPS), rel=1e-6)
    assert got[3].item() == pytest.approx(2.0 / (math.sqrt(8 / 3) + EPS), rel=1e-6)
    global_adv = group_advantages(torch.tensor(REWARDS), torch.tensor(GROUPS))
    assert not torch.allclose(got, global_adv)


def test_group_advantages_eps_is_1e_4() -> None:
    # A group of equal rewards next to one with spread 1: with a per-group std the constant group's
    # std is 0, and 0 / (0 + eps) = 0 rather than NaN; the other group's A = 1 / (1 + 1e-4).
    rewards = torch.tensor([5.0, 5.0, 0.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1])
    got = group_advantages(rewards, groups, per_group_std=True)
    assert got.tolist() == pytest.approx([0.0, 0.0, -1 / (1 + 1e-4), 1 / (1 + 1e-4)], rel=1e-7)
    # The default eps is visible on a tiny spread: rewards +-1e-4 around the mean give A = 1e-4 / 2e-4.
    tiny = group_advantages(torch.tensor([0.0, 2e-4], dtype=torch.float64), torch.tensor([0, 0]))
    assert tiny.tolist() == pytest.approx([-0.5, 0.5], rel=1e-6)


def test_group_advantages_accepts_a_custom_eps() -> None:
    got = group_advantages(torch.tensor([0.0, 2.0]), torch.tensor([0, 0]), eps=1.0)
    assert got.tolist() == pytest.approx([-0.5, 0.5], rel=1e-7)


def test_group_of_size_one_raises() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 1]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rewards_raise(bad: float) -> None:
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([1.0, bad, 0.5, 0.2]), torch.tensor([0, 0, 1, 1]))


def _hand_per_reward(parts: list[list[float]], weights: list[float], groups: list[int]) -> list[float]:
    summed = [0.0] * len(groups)
    for scores, w in zip(parts, weights, strict=True):
        by_group: dict[int, list[float]] = {}
        for r, g in zip(scores, groups, strict=True):
            by_group.setdefault(g, []).append(r)
        std = _pop_std(scores)
        if std == 0:
            continue
        for i, (r, g) in enumerate(zip(scores, groups, strict=True)):
            summed[i] += w * (r - _mean(by_group[g])) / (std + EPS)
    total_std = _pop_std(summed)
    return [s / (total_std + EPS) for s in summed]


# Reward 1 spreads widely, reward 2 (think of the shape's IoU margin) by 1e-3 and in the opposite
# order inside group 7, reward 3 is the same for every sample.
PARTS = [REWARDS, [0.503, 0.5, 0.502, 0.5, 0.501, 0.5], [1.0] * 6]
WEIGHTS = [1.0, 1.0, 0.5]


def test_per_reward_advantages_match_hand_computation() -> None:
    parts = torch.tensor(PARTS, dtype=torch.float64)
    got = per_reward_advantages(parts, torch.tensor(WEIGHTS), torch.tensor(GROUPS))
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(_hand_per_reward(PARTS, WEIGHTS, GROUPS), rel=1e-6, abs=1e-7)


def test_a_reward_with_a_small_spread_ranks_as_much_as_a_wide_one() -> None:
    groups = torch.tensor(GROUPS)
    parts = torch.tensor(PARTS, dtype=torch.float64)
    got = per_reward_advantages(parts, torch.tensor(WEIGHTS), groups)
    # Summed first, the small reward is invisible: group 7 ranks by reward 1 alone (1 < 2 < 3).
    summed = group_advantages(parts.T @ torch.tensor(WEIGHTS, dtype=torch.float64), groups)
    assert summed[0] < summed[2] < summed[4]
    # Each scaled by its own batch std, reward 2 decides group 7 (3 > 2 > 1 in its order: reward 1's
    # std mostly measures the gap between the groups); group 3, where reward 2 is flat, ranks by reward 1.
    assert got[0] > got[2] > got[4] and got[1] < got[5] < got[3]
    # Scaling or shifting a reward changes nothing while its spread is far above eps (1e-4)...
    rescaled = parts.clone()
    rescaled[0] = rescaled[0] * 3 - 7
    again = per_reward_advantages(rescaled, torch.tensor(WEIGHTS), groups)
    assert torch.allclose(again, got, atol=1e-5)
    # ...and eps bounds how far a spread near it is scaled up: reward 2 (std 1e-3) gains weight at x1000.
    rescaled[1] = rescaled[1] * 1000
    amplified = per_reward_advantages(rescaled, torch.tensor(WEIGHTS), groups)
    assert amplified[0] - amplified[4] > got[0] - got[4] + 0.01
    # The constant reward adds nothing, and the result has unit std over the batch.
    without = per_reward_advantages(parts[:2], torch.tensor(WEIGHTS[:2]), groups)
    assert torch.allclose(without, got, atol=1e-6)
    assert got.double().std(correction=0).item() == pytest.approx(1.0, abs=1e-3)


def test_per_reward_advantages_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match=r"\[K, N\]"):
        per_reward_advantages(torch.ones(6), torch.ones(1), torch.tensor(GROUPS))
    with pytest.raises(ValueError, match=r"\[K, N\]"):
        per_reward_advantages(torch.ones(2, 6), torch.ones(3), torch.tensor(GROUPS))
    with pytest.raises(ValueError, match="NaN"):  # each reward is checked as group_advantages does
        per_reward_advantages(
            torch.tensor([[1.0, float("nan"), 0.5, 0.2]]), torch.ones(1), torch.tensor([0, 0, 1, 1])
        )


def test_group_advantages_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.ones(2, 2), torch.zeros(2, 2))


# ---------------------------------------------------------------------------------------------------------
# Optimality probability

A_VALUES = [-7.0, -5.0, -2.5, 0.0, 1.0, 5.0, 8.0]


def _hand_r(mode: str, clip: float = 5.0) -> list[float]:
    out = []
    for a in A_VALUES:
        a = min(max(a, -clip), clip)
        if mode == "positive_only":
            a = max(a, 0.0)
        elif mode == "negative_only":
            a = min(a, 0.0)
        elif mode == "one_only":
            a = 1.0 if a > 0 else 0.0
        elif mode == "binary":
            a = (a > 0) - (a < 0)
        out.append(min(max(a / clip / 2 + 0.5, 0.0), 1.0))
    return out


EXPECTED_R = {
    "continuous": [0.0, 0.0, 0.25, 0.5, 0.6, 1.0, 1.0],
    "positive_only": [0.5, 0.5, 0.5, 0.5, 0.6, 1.0, 1.0],
    "negative_only": [0.0, 0.0, 0.25, 0.5, 0.5, 0.5, 0.5],
    "one_only": [0.5, 0.5, 0.5, 0.5, 0.6, 0.6, 0.6],
    "binary": [0.4, 0.4, 0.4, 0.5, 0.6, 0.6, 0.6],
}


def test_expected_r_table_covers_every_mode() -> None:
    assert set(EXPECTED_R) == set(ADV_MODES)
    for mode, values in EXPECTED_R.items():
        assert _hand_r(mode) == pytest.approx(values)


@pytest.mark.parametrize("mode", list(EXPECTED_R))
def test_optimality_probability_modes(mode: str) -> None:
    got = optimality_probability(torch.tensor(A_VALUES), adv_clip_max=5.0, mode=mode)
    assert got.tolist() == pytest.approx(EXPECTED_R[mode], abs=1e-7)
    assert float(got.min()) >= 0.0 and float(got.max()) <= 1.0


def test_optimality_probability_other_clip() -> None:
    got = optimality_probability(torch.tensor(A_VALUES), adv_clip_max=2.0)
    assert got.tolist() == pytest.approx(_hand_r("continuous", clip=2.0), abs=1e-7)
    assert got.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.5, 0.75, 1.0, 1.0], abs=1e-7)


def test_optimality_probability_unknown_mode_raises() -> None:
    with pytest.raises(ValueError, match="continuous"):
        optimality_probability(torch.zeros(3), mode="sign")


# ---------------------------------------------------------------------------------------------------------
# NFT loss

V_THETA = [[0.5, -1.0], [2.0, 0.25]]
V_OLD = [[0.1, 0.3], [-0.4, 1.0]]
X_T = [[0.2, -0.6], [1.0, 0.5]]
X0 = [[0.0, 0.4], [-1.0, 0.3]]
V_REF = [[0.0, 0.0], [1.0, -1.0]]
T = [0.3, 0.8]
R = [0.75, 0.2]


def _adaptive(err: list[float]) -> float:
    return _mean([e * e for e in err]) / max(_mean([abs(e) for e in err]), 1e-5)


def _errors(b: int, beta: float) -> tuple[list[float], list[float]]:
    """x0+- - x0 of sample b, with v+- = (1 -+ beta) v_old +- beta v_theta and x0+- = x_t - t v+-."""
    pairs = list(zip(V_OLD[b], V_THETA[b], strict=True))
    v_pos = [(1 - beta) * o + beta * th for o, th in pairs]
    v_neg = [(1 + beta) * o - beta * th for o, th in pairs]
    err_pos = [x - T[b] * v - y for x, v, y in zip(X_T[b], v_pos, X0[b], strict=True)]
    err_neg = [x - T[b] * v - y for x, v, y in zip(X_T[b], v_neg, X0[b], strict=True)]
    return err_pos, err_neg


def _hand_nft(beta: float, clip: float, kl_coef: float = 0.0) -> float:
    per_sample = []
    for b in range(2):
        err_pos, err_neg = _errors(b, beta)
        per_sample.append((R[b] * _adaptive(err_pos) + (1 - R[b]) * _adaptive(err_neg)) / beta)
    loss = clip * _mean(per_sample)
    pairs = zip(V_THETA, V_REF, strict=True)
    kl = _mean([_mean([(a - b) ** 2 for a, b in zip(th, rf, strict=True)]) for th, rf in pairs])
    return loss + kl_coef * kl


def _tensors(dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    return {
        "v_theta": torch.tensor(V_THETA, dtype=dtype, requires_grad=True),
        "v_old": torch.tensor(V_OLD, dtype=dtype, requires_grad=True),
        "x_t": torch.tensor(X_T, dtype=dtype),
        "x0": torch.tensor(X0, dtype=dtype),
        "t": torch.tensor(T, dtype=dtype),
        "r": torch.tensor(R, dtype=dtype),
    }


@pytest.mark.parametrize("beta", [1.0, 0.5, 0.1])
def test_nft_loss_matches_hand_computation(beta: float) -> None:
    loss, metrics = nft_loss(**_tensors(), beta=beta, adv_clip_max=5.0)
    assert loss.item() == pytest.approx(_hand_nft(beta, 5.0), rel=1e-12)
    assert "loss/kl" not in metrics
    assert metrics["loss/policy"].item() == pytest.approx(loss.item(), rel=1e-12)


def test_nft_loss_float32_close_to_hand_computation() -> None:
    loss, _ = nft_loss(**_tensors(torch.float32), beta=0.5, adv_clip_max=3.0)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(_hand_nft(0.5, 3.0), rel=1e-5)


def test_nft_loss_with_kl_matches_hand_computation() -> None:
    v_ref = torch.tensor(V_REF, dtype=torch.float64, requires_grad=True)
    loss, metrics = nft_loss(**_tensors(), beta=0.5, adv_clip_max=5.0, v_ref=v_ref, kl_coef=0.1)
    assert loss.item() == pytest.approx(_hand_nft(0.5, 5.0, kl_coef=0.1), rel=1e-12)
    # kl = mean over samples of mean over dims of (v_theta - v_ref)^2 = (1.25/2 + 1.5625/2) / 2
    assert metrics["loss/kl"].item() == pytest.approx((1.25 / 2 + (1.0 + 1.5625) / 2) / 2, rel=1e-12)
    loss.backward()
    assert v_ref.grad is None


def test_nft_loss_gradient_only_through_v_theta_and_weight_is_constant() -> None:
    beta, clip = 0.5, 5.0
    tensors = _tensors()
    loss, _ = nft_loss(**tensors, beta=beta, adv_clip_max=clip)
    loss.backward()
    assert tensors["v_old"].grad is None
    # d/dv_theta with the adaptive weight w held constant:
    # L+_b = mean(e+^2) / w+, de+/dv_theta = -t beta  ->  dL+_b/dv_j = 2 e+_j / D * (-t beta) / w+
    # L-_b likewise with de-/dv_theta = +t beta; total scaled by clip / (B beta).
    expected = []
    for b in range(2):
        e_pos, e_neg = _errors(b, beta)
        w_pos = _mean([abs(e) for e in e_pos])
        w_neg = _mean([abs(e) for e in e_neg])
        row = []
        for j in range(2):
            d_pos = 2 * e_pos[j] / 2 * (-T[b] * beta) / w_pos
            d_neg = 2 * e_neg[j] / 2 * (T[b] * beta) / w_neg
            row.append(clip / (2 * beta) * (R[b] * d_pos + (1 - R[b]) * d_neg))
        expected.append(row)
    got = tensors["v_theta"].grad
    assert got is not None
    for b in range(2):
        assert got[b].tolist() == pytest.approx(expected[b], rel=1e-10)


def test_nft_loss_adaptive_weight_floor() -> None:
    # err = 1e-7 everywhere: mean err^2 = 1e-14, the weight mean|err| = 1e-7 is floored to 1e-5.
    zeros = torch.zeros(1, 4, dtype=torch.float64)
    loss, metrics = nft_loss(
        v_theta=zeros.clone().requires_grad_(True),
        v_old=zeros,
        x_t=torch.full((1, 4), 1e-7, dtype=torch.float64),
        x0=zeros,
        t=torch.ones(1, dtype=torch.float64),
        r=torch.ones(1, dtype=torch.float64),
        beta=1.0,
        adv_clip_max=5.0,
    )
    assert loss.item() == pytest.approx(5.0 * 1e-14 / 1e-5, rel=1e-9)
    assert metrics["loss/positive"].item() == pytest.approx(1e-9, rel=1e-9)


def test_nft_loss_kl_absent_unless_kl_coef_positive() -> None:
    v_ref = torch.tensor(V_REF, dtype=torch.float64)
    without_ref, m1 = nft_loss(**_tensors(), beta=0.5, adv_clip_max=5.0)
    with_ref_zero_coef, m2 = nft_loss(**_tensors(), beta=0.5, adv_clip_max=5.0, v_ref=v_ref, kl_coef=0.0)
    assert with_ref_zero_coef.item() == without_ref.item()
    assert "loss/kl" not in m1 and "loss/kl" not in m2
    with_kl, m3 = nft_loss(**_tensors(), beta=0.5, adv_clip_max=5.0, v_ref=v_ref, kl_coef=1e-4)
    assert "loss/kl" in m3
    assert with_kl.item() > without_ref.item()


def test_nft_loss_kl_without_reference_raises() -> None:
    with pytest.raises(ValueError, match="v_ref"):
        nft_loss(**_tensors(), beta=0.5, adv_clip_max=5.0, kl_coef=1e-4)


@pytest.mark.parametrize("beta", [0.0, -0.1])
def test_nft_loss_non_positive_beta_raises(beta: float) -> None:
    with pytest.raises(ValueError, match="beta"):
        nft_loss(**_tensors(), beta=beta, adv_clip_max=5.0)


def test_nft_loss_with_r_one_and_beta_one_is_the_adaptive_loss_of_v_theta() -> None:
    gen = torch.Generator().manual_seed(0)
    shape = (3, 2, 5)  # a non-flat latent: the per-sample mean covers every non-batch dim
    v_theta, x_t, x0 = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3))
    t = torch.tensor([0.2, 0.5, 0.9], dtype=torch.float64)
    err = x_t - t.view(-1, 1, 1) * v_theta - x0
    adaptive = ((err**2).mean(dim=(1, 2)) / err.abs().mean(dim=(1, 2))).mean()
    for seed in (1, 2):  # v_old drops out entirely
        v_old = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        loss, _ = nft_loss(v_theta, v_old, x_t, x0, t, torch.ones(3, dtype=torch.float64), 1.0, 4.0)
        assert loss.item() == pytest.approx(4.0 * adaptive.item(), rel=1e-12)


def test_flow_matching_loss_matches_hand_computation() -> None:
    # target = noise - x0 = [[-1, -1], [-2, -4]]; v - target = [[2, 2], [3, 5]]: squares 4, 4, 9, 25.
    # The sign matters: against x0 - noise the residual would be [[0, 0], [-1, -3]] (mean square 2.5).
    x0 = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    noise = torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    v = torch.ones(2, 2, dtype=torch.float64)
    assert flow_matching_loss(v, noise, x0).item() == pytest.approx((4 + 4 + 9 + 25) / 4, rel=1e-12)
    # per sample: 4 and 17; weighted, mean over the batch of w_i times each
    weighted = flow_matching_loss(v, noise, x0, torch.tensor([0.5, 1.5], dtype=torch.float64))
    assert weighted.item() == pytest.approx((0.5 * 4 + 1.5 * 17) / 2, rel=1e-12)


def test_flow_matching_loss_is_zero_at_the_velocity_of_the_noising_path() -> None:
    # x_t = (1 - t) x0 + t eps (the sampler's convention, t = 1 is noise): dx_t/dt, by central differences
    gen = torch.Generator().manual_seed(0)
    x0, noise = (torch.randn(4, 3, generator=gen, dtype=torch.float64) for _ in range(2))
    t, h = 0.3, 1e-4

    def x_at(tt: float) -> torch.Tensor:
        return (1 - tt) * x0 + tt * noise

    velocity = (x_at(t + h) - x_at(t - h)) / (2 * h)
    assert flow_matching_loss(velocity, noise, x0).item() < 1e-16
    assert flow_matching_loss(-velocity, noise, x0).item() > 1.0


# ---------------------------------------------------------------------------------------------------------
# Decay schedules

STEPS = [0, 1, 74, 75, 76, 500, 10000]


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ("copy", [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
        ("linear_to_0_5", [0.0, 0.001, 0.074, 0.075, 0.076, 0.5, 0.5]),
        ("delayed_linear_to_0_999", [0.0, 0.0, 0.0, 0.0, 0.0075, 0.999, 0.999]),
    ],
)
def test_old_adapter_decay_schedules(schedule: str, expected: list[float]) -> None:
    got = [old_adapter_decay(schedule, step) for step in STEPS]
    assert got == pytest.approx(expected, rel=1e-12, abs=0)


def test_old_adapter_decay_ramp_points() -> None:
    assert old_adapter_decay("linear_to_0_5", 499) == pytest.approx(0.499, rel=1e-12)
    assert old_adapter_decay("delayed_linear_to_0_999", 175) == pytest.approx(0.75, rel=1e-12)
    assert old_adapter_decay("delayed_linear_to_0_999", 208) == pytest.approx(0.9975, rel=1e-12)
    assert old_adapter_decay("delayed_linear_to_0_999", 209) == 0.999  # 1.005 capped


def test_old_adapter_decay_unknown_schedule_raises() -> None:
    assert "copy" in DECAY_SCHEDULES
    with pytest.raises(ValueError, match="linear_to_0_5"):
        old_adapter_decay("ema", 3)


# ---------------------------------------------------------------------------------------------------------
# Two adapters: soft update, copy, reference policy


def _tiny_model() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    with torch.no_grad():
        base_out = model(x)
    lora.add_nft_adapters(model, rank=2, alpha=4.0, target_modules=["0", "2"])
    return model, x, base_out


def _perturb(params: dict[str, nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params.values():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype))


def _output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def test_adapters_start_equal_and_disabled_is_the_base_model() -> None:
    model, x, base_out = _tiny_model()
    default = lora.adapter_parameters(model, lora.TRAINED)
    old = lora.adapter_parameters(model, lora.OLD)
    assert len(default) == len(old) == 4  # lora_A and lora_B of two layers
    for key, p in default.items():
        assert torch.equal(p, old[key.replace(".default.", ".old.")])
    assert all(not p.requires_grad for p in old.values())
    _perturb(default, seed=1)
    with lora.adapters_disabled(model):
        assert torch.equal(_output(model, x), base_out)
    assert not torch.allclose(_output(model, x), base_out)  # back on the perturbed default adapter
    with lora.using_adapter(model, lora.OLD):
        torch.testing.assert_close(_output(model, x), base_out, rtol=0, atol=1e-12)


@pytest.mark.parametrize("decay", [0.0, 0.3, 0.9, 1.0])
def test_soft_update_old(decay: float) -> None:
    model, x, _ = _tiny_model()
    default = lora.adapter_parameters(model, lora.TRAINED)
    old = lora.adapter_parameters(model, lora.OLD)
    _perturb(default, seed=1)
    _perturb(old, seed=2)
    before_old = {k: p.detach().clone() for k, p in old.items()}
    before_default = {k: p.detach().clone() for k, p in default.items()}
    base = {k: p.detach().clone() for k, p in model.named_parameters() if "lora_" not in k}
    lora.soft_update_old(model, decay)
    for key, p in old.items():
        d = before_default[key.replace(".old.", ".default.")]
        torch.testing.assert_close(p.detach(), decay * before_old[key] + (1 - decay) * d, rtol=1e-14, atol=0)
    for key, p in default.items():
        assert torch.equal(p, before_default[key])
    for key, p in model.named_parameters():
        if "lora_" not in key:
            assert torch.equal(p, base[key])
    if decay == 0.0:
        with lora.using_adapter(model, lora.OLD):
            old_out = _output(model, x)
        assert torch.equal(old_out, _output(model, x))


@pytest.mark.parametrize("decay", [-0.1, 1.5])
def test_soft_update_rejects_decay_outside_unit_interval(decay: float) -> None:
    model, _, _ = _tiny_model()
    with pytest.raises(ValueError, match="decay"):
        lora.soft_update_old(model, decay)


def test_copy_adapter_makes_old_equal_default() -> None:
    model, x, base_out = _tiny_model()
    default = lora.adapter_parameters(model, lora.TRAINED)
    _perturb(default, seed=3)
    default_out = _output(model, x)
    with lora.using_adapter(model, lora.OLD):
        assert not torch.allclose(_output(model, x), default_out)
    lora.copy_adapter(model, lora.TRAINED, lora.OLD)
    old = lora.adapter_parameters(model, lora.OLD)
    for key, p in default.items():
        assert torch.equal(p, old[key.replace(".default.", ".old.")])
    with lora.using_adapter(model, lora.OLD):
        assert torch.equal(_output(model, x), default_out)
    with lora.adapters_disabled(model):
        assert torch.equal(_output(model, x), base_out)


# ---------------------------------------------------------------------------------------------------------
# Which timesteps NFT trains


@pytest.mark.parametrize("fraction", [0.6, 1.0])
def test_noisiest_trains_the_highest_noise_times_random_draws_them_per_sample(fraction: float) -> None:
    from omni_diffusion_rl.config import load_config
    from omni_diffusion_rl.experience.rollout import Rollout
    from omni_diffusion_rl.trainers.skeleton import noised_inputs

    cfg = load_config(None, ["data.group_size=2", f"algorithm.timestep_fraction={fraction}"])
    grid = torch.linspace(1, 0, 11)
    x0 = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    rollout = Rollout(["a"] * 4, torch.tensor([0, 0, 1, 1]), x0, {}, grid)
    noisiest = noised_inputs(cfg, rollout, step=3, choice="noisiest")
    drawn = noised_inputs(cfg, rollout, step=3)
    trained = int(10 * fraction)
    assert len(noisiest) == len(drawn) == trained
    times = torch.stack([t for t, _, _ in noisiest], dim=1)  # [N, trained]
    assert torch.equal(times, grid[:trained].expand(4, trained))  # every sample: the noisiest first
    random_times = torch.stack([t for t, _, _ in drawn], dim=1)
    if fraction < 1:
        assert not torch.equal(random_times.sort(dim=1).values, times.sort(dim=1).values)
    for (t, noise, x_t), (_, drawn_noise, _) in zip(noisiest, drawn, strict=True):
        assert torch.equal(noise, drawn_noise)  # the same noise, whichever times are trained
        torch.testing.assert_close(x_t, (1 - t[:, None]) * x0 + t[:, None] * noise)
    with pytest.raises(ValueError, match="unknown timestep choice 'latest'; choose one of random, noisiest"):
        noised_inputs(cfg, rollout, step=3, choice="latest")
    half = cfg.train.steps // 2  # noisiest_then_random: noisiest before half the run, random from there
    for step, same_as in ((0, "noisiest"), (half - 1, "noisiest"), (half, "random"), (half + 5, "random")):
        switching = noised_inputs(cfg, rollout, step=step, choice="noisiest_then_random")
        expected = noised_inputs(cfg, rollout, step=step, choice=same_as)
        for got, want in zip(switching, expected, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (step, same_as)
