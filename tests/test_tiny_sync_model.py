"""The tiny sync model (models/tiny_sync.py): its tokens hold the latent exactly, it loads as a
family from a saved folder, its decoder is differentiable, and a few flow-matching steps on the
world's clips lower its loss."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest
import torch

from omni_diffusion_rl.config import ModelConfig
from omni_diffusion_rl.models import build_policy
from omni_diffusion_rl.models.tiny_sync import SlotTokens, TinySyncPolicy, TinySyncTransformer
from omni_diffusion_rl.world import sync_clip as clip
from omni_diffusion_rl.world import tiny_sync as world
from omni_diffusion_rl.world.pretrain import flow_matching_step

from .helpers import odrl_main


def test_slot_tokens_hold_the_latent_exactly() -> None:
    x = torch.randn(3, clip.LATENT_DIM)
    looks, events = SlotTokens().split(x)
    assert looks.shape == (3, clip.SLOTS, 3 + 1 + 1 + clip.AUDIO_BINS)
    assert events.shape == (3, clip.SLOTS, clip.FRAMES, 1 + clip.HOPS_PER_FRAME)
    assert torch.equal(SlotTokens().join(looks, events), x)
    heights = clip.slot_parts(x)["height"]
    assert torch.equal(events[..., 0], heights), "a frame token holds that frame's height"


def test_the_family_loads_a_saved_model_and_decodes_clips_with_sound(tmp_path: Path) -> None:
    torch.manual_seed(0)
    TinySyncTransformer(dim=32, depth=1, heads=2).save_pretrained(tmp_path / "model")
    policy, targets = build_policy(ModelConfig(family="tiny_sync", pretrained=str(tmp_path / "model")))
    assert isinstance(policy, TinySyncPolicy) and "to_q" in targets
    cond = policy.encode_prompts([world.TRAIN_PROMPTS[0], world.TRAIN_PROMPTS[-1]])
    x = torch.randn(2, *policy.latent_shape)
    assert policy.velocity(x, torch.full((2,), 0.5), cond).shape == x.shape
    media = policy.decode(x)
    assert media.video.shape == (2, clip.FRAMES, 3, clip.SIZE, clip.SIZE)
    assert media.audio.shape == (2, 1, clip.SAMPLE_RATE) and media.sample_rate == clip.SAMPLE_RATE
    with pytest.raises(FileNotFoundError, match="config.json missing"):
        TinySyncPolicy.from_pretrained(tmp_path / "nothing")


def test_the_decoder_passes_gradients_to_every_part_of_a_slot() -> None:
    scene = world.SyncScene((world.Bouncer("red", "large", 3, (4, 9)),))
    latent = world.encode_scene(scene)[None].clone()
    latent[0, clip.PARTS["column"][0]] += 0.1  # off a whole pixel: coverage has kinks at whole pixels
    latent.requires_grad_(True)
    ramp = torch.linspace(0, 1, clip.SIZE)  # weights that change as the square moves across
    video = clip.decode_video(latent) * ramp
    (video.sum() + clip.synthesize_sync(clip.decode_amps(latent)).square().sum()).backward()
    grads = clip.slot_parts(latent.grad)
    for name in ("color", "side", "column", "height", "spectrum", "loudness"):
        assert float(grads[name][0, 0].abs().sum()) > 0, name


def test_a_few_flow_matching_steps_on_the_worlds_clips_lower_the_loss() -> None:
    """The base's pretraining step (shared with tiny_av's) learns something: the loss on a fixed
    batch and 3 fixed noise draws halves in 8 steps."""
    torch.manual_seed(0)
    transformer = TinySyncTransformer(dim=32, depth=1, heads=2)
    policy = TinySyncPolicy(transformer)
    average = TinySyncTransformer(dim=32, depth=1, heads=2).requires_grad_(False)
    opt = torch.optim.AdamW(transformer.parameters(), lr=3e-3)
    prompts, x0 = world.training_batch(random.Random(0), 32, world.BaseNoise())
    draws = [torch.Generator().manual_seed(s % 3) for s in range(8)]  # the same 3 noise draws in turn
    losses = [flow_matching_step(policy, average, opt, prompts, x0, gen, 0.9) for gen in draws]
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3])


def test_odrl_pretrain_sync_writes_a_model_the_family_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "base"
    size = ["--dim", "32", "--depth", "1", "--heads", "2", "--fillers", "4", "--text-window", "32"]
    code, printed, err = odrl_main(capsys, "pretrain", "--sync", "--steps", "2", *size, "--output", str(out))
    assert code == 0, err
    assert '"steps": 2' in printed
    policy, _ = build_policy(ModelConfig(family="tiny_sync", pretrained=str(out)))
    assert policy.transformer.config.dim == 32 and policy.transformer.config.max_text_tokens == 32
    code, _, err = odrl_main(capsys, "pretrain", "--sync", "--teacher", "--output", str(out))
    assert code == 2 and "--sync takes no --teacher" in err
    code, _, err = odrl_main(capsys, "pretrain", "--fillers", "4", "--output", str(out))
    assert code == 2 and "options of --sync" in err


def test_the_recipe_is_ready_to_train_on_the_shipped_base() -> None:
    """`odrl train recipes/configs/tiny_sync_nft.yaml --check`'s findings: nothing missing or wrong."""
    from omni_diffusion_rl.config import load_config
    from omni_diffusion_rl.preflight import FAILING, preflight

    findings = preflight(load_config("recipes/configs/tiny_sync_nft.yaml", []))
    assert not [f for f in findings if f.status in FAILING], findings
    assert TinySyncPolicy.from_pretrained("builtin").transformer.config.dim == 96


def test_a_prompt_longer_than_the_text_window_is_cut_with_one_warning() -> None:
    from omni_diffusion_rl.models.tiny_av import HashedWordTokenizer

    tokenizer = HashedWordTokenizer(vocab_size=64, max_tokens=3)
    with pytest.warns(UserWarning, match="prompt of 4 words cut to the model's 3"):
        ids, mask = tokenizer(["one two three four"])
    assert mask.tolist() == [[True, True, True]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per tokenizer: a second long prompt is quiet
        again, _ = tokenizer(["one two three four five"])
    assert torch.equal(ids, again)
