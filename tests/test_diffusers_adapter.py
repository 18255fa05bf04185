"""Diffusers adapters (SD3 image, Stable Audio DiT) on tiny random-init models, fully offline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderOobleck,
    StableAudioDiTModel,
)

from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.models.diffusers_adapter import DiffusersAudioPolicy as AudioPolicy
from omni_diffusion_rl.models.diffusers_adapter import DiffusersImagePolicy as ImagePolicy
from omni_diffusion_rl.models.diffusers_adapter import (
    HashedPromptEncoder,
    PromptEncoder,
    TransformersPromptEncoder,
)
from omni_diffusion_rl.models.lora import (
    OLD,
    TRAINED,
    adapter_parameters,
    adapters_disabled,
    add_nft_adapters,
    trainable_parameters,
    using_adapter,
)
from omni_diffusion_rl.models.policy import FlowPolicy

from .helpers import tiny_sd3

Policy = ImagePolicy | AudioPolicy
PROMPTS = ["a red cat on a mat", "low drum beat"]
KINDS = ["image", "audio"]


pytestmark = pytest.mark.usefixtures("single_thread")


def tiny_stable_audio() -> StableAudioDiTModel:
    torch.manual_seed(0)
    return StableAudioDiTModel(
        sample_size=16,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        num_key_value_attention_heads=1,
        out_channels=4,
        cross_attention_dim=16,
        time_proj_dim=8,
        global_states_input_dim=12,
        cross_attention_input_dim=10,
    )


def tiny_image_vae() -> AutoencoderKL:
    torch.manual_seed(1)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 8),
        latent_channels=4,
        norm_num_groups=4,
        layers_per_block=1,
        sample_size=16,
        scaling_factor=1.5,
        shift_factor=0.1,
    )


def tiny_audio_vae() -> AutoencoderOobleck:
    torch.manual_seed(1)
    return AutoencoderOobleck(
        encoder_hidden_size=4,
        downsampling_ratios=[2, 2],
        channel_multiples=[1, 2],
        decoder_channels=4,
        decoder_input_channels=4,
        audio_channels=2,
        sampling_rate=16000,
    )


def make_policy(kind: str, vae: bool = False) -> Policy:
    if kind == "image":
        return ImagePolicy(tiny_sd3(), vae=tiny_image_vae() if vae else None)
    return AudioPolicy(tiny_stable_audio(), vae=tiny_audio_vae() if vae else None)


def inputs(policy: Policy, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    gen = torch.Generator().manual_seed(seed)
    x_t = torch.randn(len(PROMPTS), *policy.latent_shape, generator=gen)
    return x_t, torch.tensor([0.3, 0.8]), policy.encode_prompts(PROMPTS)


def base_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}


@pytest.mark.parametrize("kind", KINDS)
def test_velocity_shapes(kind: str) -> None:
    policy = make_policy(kind)
    assert isinstance(policy, FlowPolicy)
    x_t, t, cond = inputs(policy)
    v = policy.velocity(x_t, t, cond)
    assert v.shape == x_t.shape and v.dtype == x_t.dtype and torch.isfinite(v).all()
    assert policy.latent_shape == ((4, 8, 8) if kind == "image" else (4, 16))
    # a scalar time broadcasts over the batch
    same = policy.velocity(x_t, torch.tensor(0.5), cond)
    assert torch.allclose(same, policy.velocity(x_t, torch.full((2,), 0.5), cond))
    # the time and the prompt both matter
    assert not torch.allclose(v, policy.velocity(x_t, t.flip(0), cond))
    assert not torch.allclose(v, policy.velocity(x_t, t, policy.encode_prompts(PROMPTS[::-1])))


def test_hashed_prompt_encoder() -> None:
    enc = HashedPromptEncoder(dim=6, pooled_dim=5, max_tokens=4, seed=3)
    assert isinstance(enc, PromptEncoder)
    cond = enc(["Red cat", "red CAT!", "", "one two three four five six"])
    hidden, pooled = cond["encoder_hidden_states"], cond["pooled"]
    assert hidden.shape == (4, 4, 6) and pooled.shape == (4, 5)
    assert torch.equal(hidden[0], hidden[1]) and torch.equal(pooled[0], pooled[1])
    assert hidden[2].abs().sum() == 0 and pooled[2].abs().sum() == 0
    assert hidden[0, 2:].abs().sum() == 0 and hidden[3].abs().sum(-1).gt(0).all()
    again = HashedPromptEncoder(dim=6, pooled_dim=5, max_tokens=4, seed=3)(["Red cat"])
    assert torch.equal(again["encoder_hidden_states"][0], hidden[0])
    other = HashedPromptEncoder(dim=6, pooled_dim=5, max_tokens=4, seed=4)(["Red cat"])
    assert not torch.equal(other["pooled"][0], pooled[0])


def test_prompt_width_mismatch_is_reported() -> None:
    policy = ImagePolicy(tiny_sd3(), prompt_encoder=HashedPromptEncoder(dim=7, pooled_dim=12))
    with pytest.raises(ValueError, match="width 7"):
        policy.encode_prompts(PROMPTS)


@pytest.mark.parametrize("kind", KINDS)
def test_lora_default_targets_and_disabled_base(kind: str) -> None:
    policy = make_policy(kind)
    model = policy.transformer
    x_t, t, cond = inputs(policy)
    with torch.no_grad():
        base = policy.velocity(x_t, t, cond)
    add_nft_adapters(model, rank=2, alpha=2.0, target_modules=policy.lora_target_modules)
    lora_modules = {name for name, _ in model.named_modules() if name.endswith(".lora_A")}
    for target in policy.lora_target_modules:
        assert any(name.endswith(f".{target}.lora_A") for name in lora_modules), target
    with torch.no_grad():
        for param in adapter_parameters(model, TRAINED).values():
            param.add_(0.3 * torch.randn_like(param))
        enabled = policy.velocity(x_t, t, cond)
        with adapters_disabled(model):
            disabled = policy.velocity(x_t, t, cond)
        with using_adapter(model, OLD):
            old = policy.velocity(x_t, t, cond)
    assert torch.equal(disabled, base)
    assert not torch.allclose(enabled, base, atol=1e-4)
    assert torch.allclose(old, base, atol=1e-6)  # `old` still holds the zero-B initial adapter


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_step_moves_only_lora(kind: str) -> None:
    policy = make_policy(kind)
    model = policy.transformer
    add_nft_adapters(model, rank=2, alpha=2.0, target_modules=policy.lora_target_modules)
    params = trainable_parameters(model)
    frozen = base_state(model)
    old = {k: p.detach().clone() for k, p in adapter_parameters(model, OLD).items()}
    x_t, t, cond = inputs(policy)
    with torch.no_grad():
        before = policy.velocity(x_t, t, cond)
    optimizer = torch.optim.SGD(params, lr=0.1)
    loss = policy.velocity(x_t, t, cond).sub(x_t).pow(2).mean()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = policy.velocity(x_t, t, cond)
    assert not torch.allclose(before, after)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in frozen.items())
    assert all(torch.equal(v, adapter_parameters(model, OLD)[k]) for k, v in old.items())


@pytest.mark.parametrize("kind", KINDS)
def test_save_and_from_pretrained_round_trip(kind: str, tmp_path: Path) -> None:
    policy = make_policy(kind, vae=True)
    policy.transformer.save_pretrained(tmp_path / "transformer")
    cls = type(policy)
    loaded = cls.from_pretrained(tmp_path, vae_subfolder=None)
    assert loaded.vae is None
    x_t, t, cond = inputs(policy)
    with torch.no_grad():
        assert torch.equal(
            policy.velocity(x_t, t, cond), loaded.velocity(x_t, t, loaded.encode_prompts(PROMPTS))
        )
    with pytest.raises(FileNotFoundError, match="no subfolder 'vae'"):
        cls.from_pretrained(tmp_path)
    assert policy.vae is not None
    policy.vae.save_pretrained(tmp_path / "vae")
    with_vae = cls.from_pretrained(tmp_path)
    assert with_vae.vae is not None
    with torch.no_grad():
        a, b = policy.decode(x_t), with_vae.decode(x_t)
    for field in ("video", "audio"):
        if getattr(a, field) is not None:
            assert torch.equal(getattr(a, field), getattr(b, field))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vae", [False, True])
def test_decode_gives_valid_media(kind: str, vae: bool) -> None:
    policy = make_policy(kind, vae=vae)
    x0 = 3 * torch.randn(2, *policy.latent_shape)
    with torch.no_grad():
        media = policy.decode(x0)
    assert isinstance(media, MediaBatch) and len(media) == 2
    if kind == "image":
        assert media.audio is None and media.video is not None
        side = 16 if vae else 8
        assert media.video.shape == (2, 1, 3, side, side)
        assert media.video.min() >= 0 and media.video.max() <= 1
        if not vae:
            assert torch.equal(media.video[:, 0], ((x0[:, :3] + 1) / 2).clamp(0, 1))
    else:
        assert media.video is None and media.audio is not None
        assert media.audio.shape == ((2, 2, 64) if vae else (2, 4, 16))
        assert media.audio.abs().max() <= 1
        assert media.sample_rate == (16000 if vae else 8000)


def tiny_text_encoder_dir(root: Path) -> Path:
    """Save a tiny BPE tokenizer and a random CLIPTextModelWithProjection, pipeline-style."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(["a red cat sits on a mat", "a low drum beat", "the cat hears the drum"], trainer)
    bos, eos = bpe.token_to_id("<bos>"), bpe.token_to_id("<eos>")
    bpe.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", bos), ("<eos>", eos)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", model_max_length=16
    )
    tokenizer.save_pretrained(root / "tokenizer")
    torch.manual_seed(2)
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=16,
        projection_dim=12,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    CLIPTextModelWithProjection(config).save_pretrained(root / "text_encoder")
    return root


def test_transformers_prompt_encoder(tmp_path: Path) -> None:
    root = tiny_text_encoder_dir(tmp_path)
    enc = TransformersPromptEncoder.from_pretrained(root, max_tokens=8)
    assert type(enc.text_encoder).__name__ == "CLIPTextModelWithProjection"
    assert isinstance(enc, PromptEncoder)
    cond = enc(PROMPTS)
    assert cond["encoder_hidden_states"].shape == (2, 8, 16) and cond["pooled"].shape == (2, 12)
    assert torch.equal(cond["pooled"], enc(PROMPTS)["pooled"])
    assert not torch.allclose(cond["pooled"][0], cond["pooled"][1])
    # the projected end-of-text token is the pooled vector; "mean" pooling and padding are options
    mean = TransformersPromptEncoder(enc.text_encoder, enc.tokenizer, 8, pooling="mean", pooled_dim=20)
    mean_cond = mean(PROMPTS)
    assert mean_cond["pooled"].shape == (2, 20) and mean_cond["pooled"][:, 16:].abs().sum() == 0
    masked = TransformersPromptEncoder(enc.text_encoder, enc.tokenizer, 8, mask_padding=True)(["cat"])
    assert masked["encoder_hidden_states"][0, 3:].abs().sum() == 0  # <bos> cat <eos> then padding
    # plugged into the image policy (SD3 widths 16 / 12 match the tiny CLIP)
    policy = ImagePolicy(tiny_sd3(), prompt_encoder=enc)
    x_t, t, cond = inputs(policy)
    assert policy.velocity(x_t, t, cond).shape == x_t.shape


def test_empty_tokenizer_is_rejected() -> None:
    from transformers import CLIPTokenizer

    # offline, a concrete tokenizer class given an uncached hub id silently builds an empty tokenizer
    with pytest.raises(ValueError, match="empty vocabulary"):
        TransformersPromptEncoder.from_pretrained(
            "no-such-org/no-such-text-encoder", tokenizer_subfolder=None, tokenizer_cls=CLIPTokenizer
        )


@pytest.mark.parametrize("cls", [ImagePolicy, AudioPolicy])
def test_missing_paths_fail_fast(cls: type, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        cls.from_pretrained(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        cls.from_pretrained("./no/such/model")
    with pytest.raises(FileNotFoundError, match="no subfolder 'transformer'"):
        cls.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TransformersPromptEncoder.from_pretrained(tmp_path / "missing")
    with pytest.raises(OSError, match="local cache only"):  # offline, an uncached hub id: no download
        cls.from_pretrained("no-such-org/no-such-model")
