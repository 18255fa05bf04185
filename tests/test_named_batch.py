"""Experience at process boundaries: named tensors and texts, checked against the experience
type's schema; a scored group survives the transport's bytes exactly."""

from __future__ import annotations

import pytest
import torch

from omni_diffusion_rl.execution import transport
from omni_diffusion_rl.experience.rollout import Rollout
from omni_diffusion_rl.named_batch import BatchSchemaError, NamedBatch
from omni_diffusion_rl.reward import ScoreResult


def _rollout(n: int = 4) -> Rollout:
    gen = torch.Generator().manual_seed(0)
    return Rollout(
        prompts=[f"prompt {i // 2}" for i in range(n)],
        group_ids=torch.arange(n) // 2 + 7,
        x0=torch.randn((n, 3, 5), generator=gen),
        cond={
            "tokens": torch.randint(0, 9, (n, 6), generator=gen),
            "pooled": torch.randn((n, 4), generator=gen),
        },
        grid=torch.linspace(1, 0, 4),
    )


def test_a_scored_rollout_crosses_the_transport_exactly() -> None:
    rollout = _rollout()
    scored = ScoreResult(
        torch.tensor([0.1, float("nan"), 0.7, 0.2]),
        {"color": torch.tensor([1.0, 0.0, 0.5, 0.25])},
        {1: "why"},
    )
    data = transport.pack_group(rollout.to_named(), scored, 3, {"gen_s": 0.5})
    named, back_scored, version, info = transport.unpack_group(data)
    back = Rollout.from_named(named)
    assert (version, info) == (3, {"gen_s": 0.5})
    assert back.prompts == rollout.prompts and torch.equal(back.group_ids, rollout.group_ids)
    assert torch.equal(back.x0, rollout.x0) and torch.equal(back.grid, rollout.grid)
    assert back.cond.keys() == rollout.cond.keys()
    assert all(torch.equal(back.cond[k], rollout.cond[k]) for k in rollout.cond)
    assert torch.allclose(back_scored.total, scored.total, equal_nan=True)
    assert back_scored.failures == {1: "why"} and torch.equal(
        back_scored.parts["color"], scored.parts["color"]
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: b.per_sample.pop("x0"), "lacks the per-sample tensor x0"),
        (lambda b: b.shared.pop("grid"), "lacks the shared tensor grid"),
        (lambda b: b.texts.pop("prompts"), "lacks the text prompts"),
        (lambda b: b.per_sample.update(logprobs=torch.zeros(4)), "does not know: logprobs"),
        (
            lambda b: b.per_sample.update(x0=torch.zeros(3, 3, 5)),
            "disagree on the samples: x0 3, group_ids 4",
        ),
        (
            lambda b: b.texts.update(prompts=["a", "b"]),
            "cond.pooled 4, prompts 2",
        ),
        (lambda b: b.texts.update(prompts=[1, 2, 3, 4]), "text prompts must be strings"),
    ],
)
def test_a_batch_that_does_not_fit_the_schema_is_refused_by_name(change, message: str) -> None:  # noqa: ANN001
    batch = _rollout().to_named()
    change(batch)
    with pytest.raises(BatchSchemaError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Rollout.from_named(batch)


def test_scores_that_do_not_cover_the_samples_are_refused() -> None:
    scored = ScoreResult(torch.zeros(3), {}, {})
    data = transport.pack_group(_rollout().to_named(), scored, 0)
    with pytest.raises(BatchSchemaError, match="a group of 4 samples came with 3 scores"):
        transport.unpack_group(data)


def test_an_empty_named_batch_has_no_samples() -> None:
    assert len(NamedBatch()) == 0
