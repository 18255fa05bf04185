"""GSPO's loss as a pure function: equal to trl's GRPOTrainer (importance_sampling_level "sequence",
and GRPO's "token") on the same model and tensors, loss and gradient; invariant to padding; no NaN
for an empty answer or a group whose rewards are all equal; a log-ratio above 20 capped at 20."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from omni_diffusion_rl.algorithms.advantages import group_advantages
from omni_diffusion_rl.algorithms.gspo import GSPO_EPS_HIGH, policy_loss, sequence_log_ratio
from omni_diffusion_rl.experience.text_sampling import token_log_probs

VOCAB, PROMPT, ANSWER = 64, 3, 5


def _tiny_lm() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
    )
    return Qwen2ForCausalLM(config).float()


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    completion_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    return {
        "prompt_ids": torch.randint(3, VOCAB, (4, PROMPT), generator=g),
        "prompt_mask": torch.ones(4, PROMPT, dtype=torch.long),
        "completion_ids": torch.randint(3, VOCAB, (4, ANSWER), generator=g),
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.3, -0.8]),
    }


def _our_log_probs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, PROMPT - 1 : -1]
    return token_log_probs(logits, batch["completion_ids"])


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_loss_and_gradient_equal_trls_grpo_trainer(tmp_path, level: str) -> None:  # noqa: ANN001
    # trl is in the test extra (pip install -e '.[test]'): without it this test fails, never skips
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    words = ["<pad>", "<eos>", "<unk>", *(f"w{i}" for i in range(VOCAB - 3))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    theirs = _tiny_lm()
    ours = copy.deepcopy(theirs)  # trl patches its model's head: ours stays a plain transformers model
    args = GRPOConfig(
        output_dir=str(tmp_path),
        importance_sampling_level=level,
        loss_type="grpo",
        epsilon=3e-4,
        epsilon_high=4e-4,
        beta=0.0,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=ANSWER,
        report_to=[],
        use_cpu=True,
        bf16=False,  # trl's default on CPU is bf16: compare in float32
    )
    trainer = GRPOTrainer(
        model=theirs,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["w1 w2"] * 4}),
        processing_class=tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1
    batch = _batch()
    with torch.no_grad():  # behaviour log-probs near the current ones: some ratios clip, some do not
        noise = torch.randn(4, ANSWER, generator=torch.Generator().manual_seed(2)) * 5e-4
        behaviour = _our_log_probs(ours, batch) + noise
    theirs.train()
    ours.train()
    their_loss = trainer._compute_loss(theirs, {**batch, "old_per_token_logps": behaviour})
    their_loss.backward()
    our_loss, stats = policy_loss(
        _our_log_probs(ours, batch), behaviour, batch["advantages"], batch["completion_mask"], level=level
    )
    our_loss.backward()
    assert our_loss.item() == pytest.approx(their_loss.item(), rel=1e-5, abs=1e-7)
    assert 0 < stats["clip_fraction"] < 1, stats  # both branches of the clip are exercised
    their_grads = dict(theirs.named_parameters())
    compared = 0
    for name, p in ours.named_parameters():
        if p.grad is None:
            continue
        torch.testing.assert_close(p.grad, their_grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
        compared += 1
    assert compared > 10


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_padding_changes_nothing_even_when_it_holds_nan(level: str) -> None:
    g = torch.Generator().manual_seed(3)
    logp = (torch.randn(3, 4, generator=g) - 3).requires_grad_()
    behaviour = logp.detach() + torch.randn(3, 4, generator=g) * 1e-3
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([0.7, -1.2, 0.4])
    loss, _ = policy_loss(logp, behaviour, adv, mask, level=level)
    (grad,) = torch.autograd.grad(loss, logp)

    padded = torch.cat([logp, torch.full((3, 3), float("nan"))], dim=1)
    padded_behaviour = torch.cat([behaviour, torch.full((3, 3), float("-inf"))], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(3, 3, dtype=torch.bool)], dim=1)
    padded_loss, _ = policy_loss(padded, padded_behaviour, adv, padded_mask, level=level)
    (padded_grad,) = torch.autograd.grad(padded_loss, logp)
    assert padded_loss.item() == pytest.approx(loss.item(), rel=1e-6)
    torch.testing.assert_close(padded_grad, grad)


def test_the_sequence_ratio_is_the_mean_log_ratio_over_the_answer() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    behaviour = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    torch.testing.assert_close(sequence_log_ratio(logp, behaviour, mask), torch.tensor([-0.5 / 3, 0.0]))


def test_on_policy_gradient_is_the_advantage_weighted_mean_log_prob_gradient() -> None:
    """With ratio 1 (on policy) GSPO's gradient is -mean_i A_i * grad(mean_t log pi): nothing clips."""
    g = torch.Generator().manual_seed(4)
    logp = (torch.randn(4, 6, generator=g) - 2).requires_grad_()
    mask = torch.rand(4, 6, generator=g) > 0.3
    mask[:, 0] = True
    adv = torch.randn(4, generator=g)
    loss, stats = policy_loss(logp, logp.detach(), adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = -adv[:, None] * mask / mask.sum(-1, keepdim=True) / 4
    torch.testing.assert_close(grad, expected)
    assert loss.item() == pytest.approx(-adv.mean().item(), rel=1e-6) and stats["clip_fraction"] == 0.0


@pytest.mark.parametrize("log_ratio", [30.0, 100.0])
def test_a_sequence_log_ratio_above_20_is_capped_at_20_for_either_sign(log_ratio: float) -> None:
    """policy_loss clamps the log-ratio at 20 before exp (its docstring): for A > 0 the clip at
    1 + eps_high binds, the loss is -(1 + eps_high) A; for A < 0 the unclipped term w A is the
    smaller one, the loss is e^20 |A| (not e^30 |A|, nor inf at 100) and its gradient 0."""
    logp = torch.tensor([[-1.0, -2.0, -3.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    token_ratios = torch.tensor([[log_ratio - 20, log_ratio, log_ratio + 20, 0.0]])  # mean: log_ratio
    behaviour = logp - token_ratios
    assert sequence_log_ratio(logp, behaviour, mask).item() == pytest.approx(log_ratio)
    for advantage, expected in [(-0.5, math.exp(20) * 0.5), (1.5, -(1 + GSPO_EPS_HIGH) * 1.5)]:
        x = logp.clone().requires_grad_()
        loss, stats = policy_loss(x, behaviour, torch.tensor([advantage]), mask)
        (grad,) = torch.autograd.grad(loss, x)
        assert math.isfinite(loss.item()) and loss.item() == pytest.approx(expected, rel=1e-6), advantage
        assert torch.equal(grad, torch.zeros_like(grad)), (advantage, grad)
        assert stats["clip_fraction"] == 1.0 and stats["ratio_mean"] == pytest.approx(math.exp(20), rel=1e-6)


def test_an_empty_answer_and_a_group_of_equal_rewards_give_no_nan() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    adv = group_advantages(rewards, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    assert torch.all(adv[:4] == 0) and torch.isfinite(adv).all()
    logp = torch.randn(8, 3).requires_grad_()
    mask = torch.ones(8, 3, dtype=torch.bool)
    mask[5] = False  # an answer with no tokens counted
    loss, stats = policy_loss(logp, logp.detach() + 0.01, adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and all(map(lambda v: v == v, stats.values()))
    assert torch.all(grad[:4] == 0) and torch.all(grad[5] == 0)


def test_bad_shapes_and_levels_are_named() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="ratio level"):
        policy_loss(x, x, torch.zeros(2), x.bool(), level="word")
    with pytest.raises(ValueError, match=r"advantages \(3,\)"):
        policy_loss(x, x, torch.zeros(3), x.bool())


def test_the_sample_std_gives_trls_advantages_and_the_population_std_ours() -> None:
    """algorithm.adv_std=sample divides by the std with Bessel's correction, as trl's GRPOTrainer
    computes it (rewards.view(-1, G).std(dim=1)); population (the default) is larger by
    sqrt(G / (G - 1)), 1.069 at G=8."""
    from omni_diffusion_rl.algorithms.advantages import STD_CORRECTIONS

    g = 8
    rewards = torch.rand(3 * g, generator=torch.Generator().manual_seed(0))
    groups = torch.arange(3).repeat_interleave(g)
    grouped = rewards.view(-1, g).double()
    trl = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-4)
    sample = group_advantages(rewards, groups, per_group_std=True, std_correction=STD_CORRECTIONS["sample"])
    torch.testing.assert_close(sample, trl.flatten().float(), rtol=1e-6, atol=1e-7)
    population = group_advantages(rewards, groups, per_group_std=True)
    ratio = (population / sample)[sample.abs() > 0.1]
    torch.testing.assert_close(ratio, torch.full_like(ratio, (g / (g - 1)) ** 0.5), rtol=1e-3, atol=0)
