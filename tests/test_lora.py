"""Adapter switching keeps `old` frozen and routes forwards through the named adapter."""

from __future__ import annotations

import torch
from torch import nn

from omni_diffusion_rl.models import lora


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    model.requires_grad_(False)
    lora.add_nft_adapters(model, rank=2, alpha=4, target_modules=["0", "2"])
    return model


def _grad_flags(model: nn.Module, name: str) -> set[bool]:
    return {p.requires_grad for p in lora.adapter_parameters(model, name).values()}


def test_only_the_trained_adapter_ever_requires_grad() -> None:
    model = _model()
    lora.trainable_parameters(model)
    assert _grad_flags(model, lora.TRAINED) == {True} and _grad_flags(model, lora.OLD) == {False}
    with lora.using_adapter(model, lora.OLD):
        assert _grad_flags(model, lora.OLD) == {False}
    with lora.adapters_disabled(model):
        pass
    assert _grad_flags(model, lora.TRAINED) == {True} and _grad_flags(model, lora.OLD) == {False}


def test_forwards_follow_the_active_adapter() -> None:
    model = _model()
    x = torch.randn(3, 4)
    with lora.adapters_disabled(model):
        base = model(x)
    with torch.no_grad():
        for p in lora.adapter_parameters(model, lora.TRAINED).values():
            p.add_(0.5)
    trained = model(x)
    with lora.using_adapter(model, lora.OLD):
        old = model(x)
    assert torch.equal(old, base), "old still equals its initial copy (lora_B = 0): the base output"
    assert not torch.equal(trained, base)
    assert torch.equal(model(x), trained), "leaving the context routes back to `default`"


def test_an_embedding_target_is_refused_rather_than_never_trained() -> None:
    """peft names an embedding's LoRA `lora_embedding_A.<adapter>` (no weight matrix): it would be
    left out of the trained parameters, so the run would train nothing there without a word."""
    import pytest

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4)).requires_grad_(False)
    with pytest.raises(lora.LoraTargetError, match=r"LoRA on \['0'\] is not supported"):
        lora.add_nft_adapters(model, rank=2, alpha=4, target_modules=["0", "1"])
