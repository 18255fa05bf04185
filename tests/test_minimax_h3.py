"""MiniMax-H3 (joint audio and video) over diffusers' H3 transformer and VAEs, on tiny random-init
components: the adapter's packed forward equals a hand-packed call, its sampler follows
MiniMaxH3Scheduler (a flipped time or velocity convention is caught), decoding gives frames and a
stereo waveform, and the training loop runs with the real CLAP and ImageBind reward code."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from omni_diffusion_rl.checkpoint import CheckpointError
from omni_diffusion_rl.config import ConfigError, load_config
from omni_diffusion_rl.experience.rollout import generate
from omni_diffusion_rl.models import build_nft_policy, lora
from omni_diffusion_rl.models.minimax_h3 import TEXT, TEXT_LENGTH, MiniMaxH3Policy
from omni_diffusion_rl.trainers.trainer import Trainer

from .av_rewards import AudioVideoLevel, clap_and_imagebind, needs_imagebind
from .h3_tiny import CLIP, save_tiny_h3, tiny_h3_components
from .helpers import last_json_line, step_records

pytestmark = pytest.mark.usefixtures("single_thread")
CLIP_OPTION = "{" + ", ".join(f"{k}: {v}" for k, v in CLIP.items()) + "}"


@pytest.fixture(scope="module")
def policy() -> MiniMaxH3Policy:
    return MiniMaxH3Policy(tiny_h3_components(), **CLIP)


def hand_packed(video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor, t_h3: float) -> dict:
    """The transformer's inputs written out from docs/research/minimax_h3.md section 2, independently
    of the adapter: [text | audio (channel-major stereo) | video] rows, tags text 1 / audio 2 /
    video 0, (t, h, w) positions on one clock, one timestep (text rows take the video one)."""
    b, c, f, h, w = video.shape
    _, s, ca, n_audio = audio.shape
    length = text.shape[1]
    video_rows = video.reshape(b, c, f, 1, h // 2, 2, w // 2, 2).permute(0, 2, 4, 6, 1, 3, 5, 7)
    video_rows = video_rows.reshape(b, -1, c * 4)
    audio_rows = audio.permute(0, 1, 3, 2).reshape(b, s * n_audio, ca)
    n_v, n_a = video_rows.shape[1], audio_rows.shape[1]
    seq, a0, v0 = length + n_a + n_v, length, length + n_a

    def grid(size: int) -> torch.Tensor:
        ratio = (size // 2) / math.sqrt((h // 2) * (w // 2))
        left = (1 - ratio) / 2
        return 32 * (left + ratio * torch.arange(size // 2, dtype=torch.float64) / (size // 2))

    hg, wg = grid(h), grid(w)
    pos = torch.zeros(seq, 3, dtype=torch.float64)
    pos[:length, 0] = torch.arange(length, dtype=torch.float64)
    pos[a0:v0, 0] = (length + torch.arange(n_audio, dtype=torch.float64)).repeat(s)
    pos[a0:v0, 2] = torch.cat([torch.full((n_audio,), float(wg[0] if k == 0 else wg[-1])) for k in range(s)])
    spans = torch.tensor([5 / 3 * (1, 4, 4, 4, 4)[i % 5] for i in range(f)], dtype=torch.float64)
    frame_time = length + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])
    hh, ww = torch.meshgrid(hg, wg, indexing="ij")
    per_frame = torch.stack([hh.reshape(-1), ww.reshape(-1)], -1)
    video_pos = torch.empty(f, per_frame.shape[0], 3, dtype=torch.float64)
    video_pos[:, :, 0], video_pos[:, :, 1:] = frame_time[:, None], per_frame[None]
    pos[v0:] = video_pos.reshape(-1, 3)
    tags = torch.cat([torch.ones(length), torch.full((n_a,), 2), torch.zeros(n_v)]).long()
    return {
        "hidden_states": video_rows,
        "audio_hidden_states": audio_rows,
        "encoder_hidden_states": text,
        "timestep": torch.tensor([t_h3]),
        "timestep_indices": torch.zeros(seq, dtype=torch.long),
        "token_tags": tags,
        "position_ids": pos,
        "video_indices": torch.arange(v0, seq),
        "audio_indices": torch.arange(a0, v0),
        "text_indices": torch.arange(length),
        "return_dict": False,
    }


def test_the_packed_forward_equals_a_direct_call_on_hand_packed_inputs(policy: MiniMaxH3Policy) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, *policy.latent_shape, generator=gen)
    cond = policy.encode_prompts(["a red circle", "a red circle"])
    video, audio = policy.split(x)
    text = cond[TEXT][:, : int(cond[TEXT_LENGTH][0])]
    with torch.no_grad():
        mine = policy.velocity(x, torch.tensor([0.3, 0.3]), cond)
        video_v, audio_v = policy.transformer(**hand_packed(video, audio, text, 0.7))
    b, c, f, h, w = video.shape
    video_v = (
        video_v.reshape(b, f, h // 2, w // 2, c, 1, 2, 2).permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(video.shape)
    )
    audio_v = audio_v.reshape(b, 2, -1, audio.shape[2]).permute(0, 1, 3, 2)
    direct = torch.cat([video_v.flatten(1), audio_v.flatten(1)], 1)
    torch.testing.assert_close(mine, -direct, rtol=0, atol=1e-6)  # sigma 0.3 is H3's t = 0.7; u = -v
    assert mine.abs().max() > 1e-3


def _scheduler_run(policy: MiniMaxH3Policy, noise: torch.Tensor, prompt: str, steps: int) -> torch.Tensor:
    """MiniMaxH3Scheduler stepping the raw transformer in H3's own convention (t = 1 clean)."""
    from diffusers import MiniMaxH3Scheduler

    scheduler = MiniMaxH3Scheduler(shift=12.0)
    scheduler.set_timesteps(steps + 1)
    cond = policy.encode_prompts([prompt])
    text = cond[TEXT][:, : int(cond[TEXT_LENGTH][0])]
    x = noise.clone()
    for t in scheduler.timesteps:
        video, audio = policy.split(x)
        with torch.no_grad():
            v_video, v_audio = policy.h3_velocity(video, audio, text, float(t))
        x = scheduler.step(torch.cat([v_video.flatten(1), v_audio.flatten(1)], 1), t, x, return_dict=False)[0]
    return x


class FlippedVelocity(MiniMaxH3Policy):
    """H3's velocity passed on without the sign change (a convention bug)."""

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return -super().velocity(x_t, t, cond)


class FlippedTime(MiniMaxH3Policy):
    """sigma passed as H3's t (a convention bug)."""

    def h3_velocity(self, video, audio, text, h3_time):  # noqa: ANN001, ANN201
        return super().h3_velocity(video, audio, text, 1.0 - h3_time)


def test_our_sampler_follows_minimax_h3_scheduler_and_catches_a_flipped_convention() -> None:
    components = tiny_h3_components()
    good = MiniMaxH3Policy(components, **CLIP)
    torch.testing.assert_close(good.time_grid(4, 1.0), _sigmas(4))  # the scheduler's shift 12, final 0
    noise = torch.randn(1, *good.latent_shape, generator=torch.Generator().manual_seed(1))
    reference = _scheduler_run(good, noise, "a red circle", 4)
    errors = {}
    for cls in (MiniMaxH3Policy, FlippedVelocity, FlippedTime):
        with torch.no_grad():
            x0 = generate(cls(components, **CLIP), ["a red circle"], [0], noise, 4, 1.0, "euler").x0
        errors[cls.__name__] = float((x0 - reference).abs().max())
    assert errors["MiniMaxH3Policy"] < 1e-5, errors
    assert errors["FlippedVelocity"] > 1e-2 and errors["FlippedTime"] > 1e-3, errors


def _sigmas(steps: int) -> torch.Tensor:
    base = torch.linspace(1, 0, steps + 1)
    return 12 * base / (1 + 11 * base)


def test_decoding_gives_frames_and_stereo_audio_and_each_sample_has_its_own_time(
    policy: MiniMaxH3Policy,
) -> None:
    x = torch.randn(3, *policy.latent_shape, generator=torch.Generator().manual_seed(2))
    media = policy.decode(x)
    assert media.video.shape == (3, 22, 3, 32, 32) and 0 <= media.video.min() and media.video.max() <= 1
    assert media.audio.shape == (3, 2, 37 * 800) and media.audio.abs().max() <= 1  # 40 latents/s, hop 800
    assert (media.fps, media.sample_rate) == (24.0, 32000)
    cond = policy.encode_prompts(["a", "b c", "a"])
    with torch.no_grad():
        batch = policy.velocity(x, torch.tensor([0.9, 0.5, 0.9]), cond)
        one = policy.velocity(x[1:2], torch.tensor([0.5]), {k: v[1:2] for k, v in cond.items()})
    torch.testing.assert_close(batch[1:2], one, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"MiniMax-H3 latents must be \[B, 2384\] \(video 1792 \+ audio 592"):
        policy.velocity(x[:, :100], torch.tensor([0.5] * 3), cond)


def _decoded_whole(policy: MiniMaxH3Policy, x: torch.Tensor) -> torch.Tensor:
    """The frames as decode computed them before it decoded into one output: one VAE call, then the
    float post-processing on the whole batch (three full-size float copies)."""
    video, _ = policy.split(x.float())
    vae = policy.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        pixels = vae.decode((video * std + mean).to(vae.dtype), return_dict=False)[0].float()
    imagenet_mean = torch.tensor((0.485, 0.456, 0.406)).view(1, -1, 1, 1, 1)
    imagenet_std = torch.tensor((0.229, 0.224, 0.225)).view(1, -1, 1, 1, 1)
    return (pixels * imagenet_std + imagenet_mean).clamp(0, 1).permute(0, 2, 1, 3, 4)


def test_frames_decoded_into_one_output_are_the_whole_batch_decodes_exactly() -> None:
    """In place, one sample at a time, the same pixels as the whole-batch post-processing (bit for
    bit), and with vae_slicing (one sample per VAE call) the same as the VAE's own slicing."""
    components = tiny_h3_components()
    whole = MiniMaxH3Policy(components, **CLIP, vae_tiling=False)
    x = torch.randn(3, *whole.latent_shape, generator=torch.Generator().manual_seed(5))
    assert torch.equal(whole.decode(x).video, _decoded_whole(whole, x))
    sliced = MiniMaxH3Policy(components, **CLIP, vae_tiling=False, vae_slicing=True)
    assert torch.equal(sliced.decode(x).video, _decoded_whole(sliced, x))  # the VAE slices itself there


def test_bad_clip_sizes_and_long_prompts_are_named() -> None:
    components = tiny_h3_components()
    with pytest.raises(ValueError, match=r"num_frames = 17 n \+ 5 .* got 30, the next that fits is 39"):
        MiniMaxH3Policy(components, **{**CLIP, "num_frames": 30})
    with pytest.raises(ValueError, match="height and width divisible by 8; got 36 x 32"):
        MiniMaxH3Policy(components, **{**CLIP, "height": 36})
    with pytest.raises(ValueError, match="text_encoder_layer=4: the conditioner has 4 decoder layers"):
        MiniMaxH3Policy(components, **{**CLIP, "text_encoder_layer": 4})
    short = MiniMaxH3Policy(components, **{**CLIP, "max_sequence_length": 4})
    with pytest.raises(ValueError, match=r"is 12 tokens; MiniMax-H3 takes 1 to 4 here \(raise model.options"):
        short.encode_prompts(["a red circle"])


@pytest.fixture(scope="module")
def h3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_h3(tmp_path_factory.mktemp("h3") / "h3")


@pytest.fixture(scope="module")
def reward_section(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return clap_and_imagebind(tmp_path_factory.mktemp("rewards"))


def _config(h3_dir: Path, reward: dict, run: Path, steps: int, *extra: str):  # noqa: ANN202
    path = run.parent / f"{run.name}.yaml"
    run.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"reward": reward, "model": {"options": CLIP}}))
    overrides = [
        "model.family=minimax_h3",
        f"model.pretrained={h3_dir}",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        f"train.output_dir={run}",
        f"train.steps={steps}",
        "train.checkpoint_every=1",
        "train.eval_at_start_and_end=false",
        "train.preview_every=0",
        "train.progress=false",
        "data.prompts_per_step=2",
        "data.group_size=2",
        "sampling.num_steps=3",
        "eval.metrics=[]",
        *extra,
    ]
    return path, overrides


@needs_imagebind
def test_the_loop_scores_with_clap_and_imagebind_trains_checkpoints_and_resumes_equal(
    h3_dir: Path, reward_section: dict, tmp_path: Path
) -> None:
    whole = Trainer(load_config(*_config(h3_dir, reward_section, tmp_path / "whole", 2)))
    before = {k: v.clone() for k, v in lora.adapter_state_dict(whole.transformer, lora.TRAINED).items()}
    summary = whole.fit()
    assert summary["samples"]["trained"] == 2 * 2 * 2
    after = lora.adapter_state_dict(whole.transformer, lora.TRAINED)
    assert any(not torch.equal(before[k], after[k]) for k in after), "the H3 adapter trained"
    assert all(k.split(".")[0] == "transformer_blocks" for k in after), "the text refiner is left alone"
    rows = step_records(tmp_path / "whole")
    for name in ("clap", "imagebind"):
        values = [r[f"reward/{name}"] for r in rows]
        assert all(math.isfinite(v) and -1 <= v <= 1 for v in values), (name, values)
    Trainer(load_config(*_config(h3_dir, reward_section, tmp_path / "split", 1))).fit()
    resumed = Trainer(load_config(*_config(h3_dir, reward_section, tmp_path / "split", 2)))
    resumed.fit(resume=str(tmp_path / "split" / "checkpoints"))
    assert step_records(tmp_path / "split") == rows, "a resumed run logs what the uninterrupted one did"
    state = json.loads((tmp_path / "whole" / "checkpoints" / "step_0000002" / "state.json").read_text())
    assert state["config"]["model"]["family"] == "minimax_h3"
    tiny = Trainer(load_config(None, [f"train.output_dir={tmp_path / 'tiny'}", "train.steps=1"]))
    with pytest.raises(CheckpointError, match="made for another model configuration"):
        tiny.load(tmp_path / "whole" / "checkpoints" / "step_0000002")


@pytest.mark.slow
@needs_imagebind
def test_separate_mode_trains_h3_from_the_buffer_scored_by_clap_and_imagebind(
    h3_dir: Path, reward_section: dict, tmp_path: Path
) -> None:
    from .test_separate import REPO, _launch

    run = tmp_path / "run"
    extra = ("execution.mode=separate", "execution.data_timeout_s=60")
    path, overrides = _config(h3_dir, reward_section, run, 3, *extra)
    proc = _launch([str(path), *overrides], 29643, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    buffer = last_json_line(proc.stdout)["execution"]["buffer"]
    assert buffer["trained"] == 3 * 2 * 2, buffer
    rows = step_records(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["reward/clap"]) and math.isfinite(r["reward/imagebind"]) for r in rows), rows


def test_a_missing_component_and_unknown_options_are_named(h3_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "h3"
    shutil.copytree(h3_dir, copy)
    base = ["model.family=minimax_h3", f"model.pretrained={copy}", "eval.metrics=[]"]
    bad = load_config(None, [*base, "model.options={fps: 3}"])
    with pytest.raises(ConfigError, match="model.options: fps unknown to minimax_h3; it takes height, width"):
        build_nft_policy(bad.model)
    shutil.rmtree(copy / "audio_vae")
    cfg = load_config(None, base)
    with pytest.raises(ConfigError, match="lacks the MiniMax-H3 component folder.s. audio_vae"):
        build_nft_policy(cfg.model)


def test_the_trained_adapter_exports_for_diffusers_h3_lora_loading(
    h3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from diffusers import MiniMaxH3Transformer3DModel

    from omni_diffusion_rl.export import DIFFUSERS_WEIGHTS, export_adapter
    from omni_diffusion_rl.registry import rewards

    monkeypatch.setitem(rewards._factories, "av_level", AudioVideoLevel)  # noqa: SLF001
    run = tmp_path / "run"
    trainer = Trainer(load_config(*_config(h3_dir, {"weights": {"av_level": 1.0}}, run, 1)))
    trainer.fit()
    out = export_adapter(run / "checkpoints", tmp_path / "lora", "diffusers")
    fresh = MiniMaxH3Policy.from_pretrained(str(h3_dir), **CLIP)
    x = torch.randn(2, *fresh.latent_shape, generator=torch.Generator().manual_seed(3))
    t, prompts = torch.tensor([0.7, 0.3]), ["a red circle", "a low tone"]
    with torch.no_grad():
        lora.set_active_adapter(trainer.transformer, lora.TRAINED)
        trained = trainer.policy.velocity(x, t, trainer.policy.encode_prompts(prompts))
        base = fresh.velocity(x, t, fresh.encode_prompts(prompts))
        fresh.transformer.load_lora_adapter(str(out), weight_name=DIFFUSERS_WEIGHTS, prefix="transformer")
        loaded = fresh.velocity(x, t, fresh.encode_prompts(prompts))
    assert isinstance(fresh.transformer, MiniMaxH3Transformer3DModel)
    assert not torch.allclose(base, trained, atol=1e-6), "one step moved the adapter"
    torch.testing.assert_close(loaded, trained, rtol=1e-4, atol=1e-5)


def test_vae_tiling_is_on_by_default_as_released_and_the_options_switch_it() -> None:
    components = tiny_h3_components()
    assert MiniMaxH3Policy(components, **CLIP).vae.use_tiling is True
    policy = MiniMaxH3Policy(components, **CLIP, vae_tiling=False, vae_slicing=True)
    assert (policy.vae.use_tiling, policy.vae.use_slicing) == (False, True)


def test_bf16_base_weights_train_with_fp32_adapters_and_sample_without_autocast(
    h3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from omni_diffusion_rl.inference import generate_media, load_policy
    from omni_diffusion_rl.registry import rewards

    monkeypatch.setitem(rewards._factories, "av_level", AudioVideoLevel)  # noqa: SLF001
    reward = {"weights": {"av_level": 1.0}}
    runs = {}
    for dtype in ("fp32", "bf16"):
        trainer = Trainer(
            load_config(*_config(h3_dir, reward, tmp_path / dtype, 2, f"model.base_dtype={dtype}"))
        )
        trainer.fit()
        runs[dtype] = [r["loss/total"] for r in step_records(tmp_path / dtype)]
    weights = dict(trainer.transformer.named_parameters())
    assert weights["transformer_blocks.0.attn.to_q.base_layer.weight"].dtype == torch.bfloat16
    assert weights["proj_in.weight"].dtype == torch.float32, "H3 keeps its input and output heads in fp32"
    assert all(p.dtype == torch.float32 for p in trainer.params), "the trained adapter and AdamW are fp32"
    assert (
        trainer.policy.text_encoder.dtype == torch.bfloat16
        and trainer.policy.audio_vae.dtype == torch.float32
    )
    # measured: bf16 within 6.9e-5 (step 1) and 9.9e-5 (step 2) of fp32; 10x that (docs/real-models.md)
    for fp32, bf16 in zip(runs["fp32"], runs["bf16"], strict=True):
        assert math.isfinite(bf16) and bf16 == pytest.approx(fp32, rel=1e-3), runs
    policy = load_policy(tmp_path / "bf16" / "checkpoints")  # odrl sample's path: no autocast around it
    media = generate_media(policy, ["a red circle"], steps=2)
    assert torch.isfinite(media.video).all() and torch.isfinite(media.audio).all()


def test_another_familys_fp32_only_loader_refuses_bf16_base_weights(tmp_path: Path) -> None:
    cfg = load_config(None, ["model.base_dtype=bf16", f"train.output_dir={tmp_path}"])
    with pytest.raises(
        ConfigError, match="model.base_dtype=bf16: the tiny_av family loads its weights in fp32"
    ):
        build_nft_policy(cfg.model)


def test_the_conditioner_keeps_the_layers_it_reads_encodes_a_prompt_once_and_can_stay_off_device() -> None:
    components = tiny_h3_components()
    ids = torch.tensor([components["tokenizer"]("a red circle", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        full = (
            components["text_encoder"]
            .model(
                input_ids=ids,
                mm_token_type_ids=torch.zeros_like(ids),
                output_hidden_states=True,
                use_cache=False,
            )
            .hidden_states[CLIP["text_encoder_layer"]][0]
        )
    policy = MiniMaxH3Policy(components, **CLIP, offload_text_encoder=True)
    assert len(policy.text_encoder.model.language_model.layers) == CLIP["text_encoder_layer"] + 1 < 4
    calls = []
    policy.text_encoder.model.register_forward_hook(lambda *_: calls.append(1))
    first = policy.encode_prompts(["a red circle", "a red circle", "a low tone"])
    again = policy.encode_prompts(["a red circle"])
    assert len(calls) == 2, "two distinct prompts, each encoded once"
    length = int(first[TEXT_LENGTH][0])
    torch.testing.assert_close(first[TEXT][0, :length], full, rtol=0, atol=1e-6)
    torch.testing.assert_close(again[TEXT][0], first[TEXT][0], rtol=0, atol=0)
    policy.to("meta")
    assert policy.transformer.proj_in.weight.device.type == "meta"
    assert next(policy.text_encoder.parameters()).device.type == "cpu", "offloaded: stays in host memory"
