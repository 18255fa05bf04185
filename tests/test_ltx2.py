"""LTX-2 (joint audio and video) through LTX2Pipeline's components, on a tiny random-init pipeline:
our sampler reproduces the pipeline's own latents (guidance off), decoding gives frames and a
stereo waveform, and the whole training loop runs, checkpoints and resumes equal."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from omni_diffusion_rl.config import ConfigError, load_config
from omni_diffusion_rl.experience.rollout import generate
from omni_diffusion_rl.models import build_nft_policy, lora
from omni_diffusion_rl.models.ltx2 import LTX2Policy
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.trainers.trainer import Trainer

from .av_rewards import AV_LEVEL_PLUGIN, AudioVideoLevel, clap_and_imagebind, needs_imagebind
from .helpers import last_json_line, step_records
from .ltx2_tiny import CLIP, GUIDANCE_OFF, tiny_ltx2_pipeline

pytestmark = pytest.mark.usefixtures("single_thread")
CLIP_OPTION = "{" + ", ".join(f"{k}: {v}" for k, v in CLIP.items()) + "}"


def test_our_sampler_reproduces_the_pipelines_latents_with_guidance_off() -> None:
    from diffusers.utils.torch_utils import randn_tensor

    pipe = tiny_ltx2_pipeline()
    policy = LTX2Policy(pipe, **CLIP)
    clip = {k: v for k, v in CLIP.items() if k != "max_sequence_length"}
    reference_video, reference_audio = pipe(
        prompt="a red circle",
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
        return_dict=False,
        num_inference_steps=3,
        max_sequence_length=CLIP["max_sequence_length"],
        **clip,
        **GUIDANCE_OFF,
    )
    gen = torch.Generator().manual_seed(0)  # the pipeline's draw order: video noise, then audio
    frames, height, width = policy.video_grid
    video = randn_tensor((1, policy.video_channels, frames, height, width), generator=gen)
    audio_shape = (1, pipe.audio_vae.config.latent_channels, policy.audio_frames, policy.audio_mel_bins)
    audio = randn_tensor(audio_shape, generator=gen)
    noise = torch.cat(
        [pipe._pack_latents(video, 1, 1).flatten(1), pipe._pack_audio_latents(audio).flatten(1)], 1
    )
    with torch.no_grad():
        rollout = generate(policy, ["a red circle"], [0], noise, 3, 1.0, "euler")
    assert torch.allclose(rollout.grid, torch.tensor([1.0, 2 / 3, 1 / 3, 0.0]))
    mine_video, mine_audio = policy.split(rollout.x0)
    vae, audio_vae = pipe.vae, pipe.audio_vae
    mine_video = pipe._denormalize_latents(
        pipe._unpack_latents(mine_video, frames, height, width, 1, 1),
        vae.latents_mean,
        vae.latents_std,
        vae.config.scaling_factor,
    )
    mine_audio = pipe._unpack_audio_latents(
        pipe._denormalize_audio_latents(mine_audio, audio_vae.latents_mean, audio_vae.latents_std),
        policy.audio_frames,
        policy.audio_mel_bins,
    )
    assert (mine_video - reference_video).abs().max() < 1e-4
    assert (mine_audio - reference_audio).abs().max() < 1e-4


def test_decoding_gives_frames_and_stereo_audio_and_each_sample_has_its_own_time() -> None:
    policy = LTX2Policy(tiny_ltx2_pipeline(), **CLIP)
    x = torch.randn(3, *policy.latent_shape, generator=torch.Generator().manual_seed(1))
    media = policy.decode(x)
    assert media.video.shape == (3, 9, 3, 32, 32) and 0 <= media.video.min() and media.video.max() <= 1
    assert media.audio.shape[:2] == (3, 2) and media.audio.abs().max() <= 1
    assert (media.fps, media.sample_rate) == (25.0, 400)
    cond = policy.encode_prompts(["a", "b c", "d"])
    with torch.no_grad():
        batch = policy.velocity(x, torch.tensor([0.9, 0.5, 0.1]), cond)
        one = policy.velocity(x[1:2], torch.tensor([0.5]), {k: v[1:2] for k, v in cond.items()})
    assert torch.allclose(batch[1:2], one, atol=1e-5), "a sample's velocity depends on its own t only"
    with pytest.raises(ValueError, match=r"LTX-2 latents must be \[B, 356\]"):
        policy.velocity(x[:, :10], torch.tensor([0.5] * 3), cond)


@pytest.fixture
def pipeline_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setitem(rewards._factories, "av_level", AudioVideoLevel)  # noqa: SLF001
    path = tmp_path / "ltx2"
    tiny_ltx2_pipeline().save_pretrained(path)
    return path


def _overrides(pipeline_dir: Path, run: Path, steps: int) -> list[str]:
    return [
        "model.family=ltx2",
        f"model.pretrained={pipeline_dir}",
        f"model.options={CLIP_OPTION}",
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
        "reward.weights={av_level: 1}",
        "eval.metrics=[]",
    ]


def test_the_training_loop_runs_checkpoints_and_resumes_equal(pipeline_dir: Path, tmp_path: Path) -> None:
    whole = Trainer(load_config(None, _overrides(pipeline_dir, tmp_path / "whole", 2)))
    before = {k: v.clone() for k, v in lora.adapter_state_dict(whole.transformer, lora.TRAINED).items()}
    summary = whole.fit()
    assert summary["samples"]["trained"] == 2 * 2 * 2
    after = lora.adapter_state_dict(whole.transformer, lora.TRAINED)
    assert any(not torch.equal(before[k], after[k]) for k in after), "the LTX-2 adapter trained"
    Trainer(load_config(None, _overrides(pipeline_dir, tmp_path / "split", 1))).fit()
    resumed = Trainer(load_config(None, _overrides(pipeline_dir, tmp_path / "split", 2)))
    resumed.fit(resume=str(tmp_path / "split" / "checkpoints"))
    rows = [step_records(tmp_path / name) for name in ("whole", "split")]
    assert rows[0] == rows[1], "a resumed run logs what the uninterrupted one did"
    state = json.loads((tmp_path / "whole" / "checkpoints" / "step_0000002" / "state.json").read_text())
    assert state["config"]["model"]["family"] == "ltx2"


@pytest.mark.slow
def test_separate_mode_trains_ltx2_from_the_buffer_with_two_processes(
    pipeline_dir: Path, tmp_path: Path
) -> None:
    from .test_separate import REPO, _launch

    plugin = tmp_path / "av_level.py"
    plugin.write_text(AV_LEVEL_PLUGIN)
    run = tmp_path / "run"
    args = [*_overrides(pipeline_dir, run, 3), f"reward.plugins=[{plugin}]", "execution.mode=separate"]
    proc = _launch([*args, "execution.data_timeout_s=60"], 29641, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    buffer = last_json_line(proc.stdout)["execution"]["buffer"]
    assert buffer["trained"] == 3 * 2 * 2, buffer
    assert [r["step"] for r in step_records(run)] == [1, 2, 3]


def test_bad_options_and_a_missing_component_are_named(pipeline_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [*_overrides(pipeline_dir, tmp_path / "a", 1), "model.options={fps: 3}"])
    with pytest.raises(ConfigError, match="model.options: fps unknown to ltx2; it takes height, width"):
        build_nft_policy(cfg.model)
    odd = load_config(None, [*_overrides(pipeline_dir, tmp_path / "b", 1), "model.options={height: 40}"])
    with pytest.raises(ConfigError, match="height and width divisible by 32"):
        build_nft_policy(odd.model)
    import shutil

    shutil.rmtree(pipeline_dir / "vocoder")
    with pytest.raises(ConfigError, match="lacks the component folder.s. vocoder that model_index.json"):
        build_nft_policy(load_config(None, _overrides(pipeline_dir, tmp_path / "c", 1)).model)


def test_the_trained_adapter_exports_for_ltx2_pipeline_load_lora_weights(
    pipeline_dir: Path, tmp_path: Path
) -> None:
    from omni_diffusion_rl.export import export_adapter

    run = tmp_path / "run"
    trainer = Trainer(load_config(None, _overrides(pipeline_dir, run, 1)))
    trainer.fit()
    out = export_adapter(run / "checkpoints", tmp_path / "lora", "diffusers")
    x = torch.randn(2, *trainer.policy.latent_shape, generator=torch.Generator().manual_seed(3))
    t = torch.tensor([0.7, 0.3])

    def velocity(policy: LTX2Policy) -> torch.Tensor:
        with torch.no_grad():
            return policy.velocity(x, t, policy.encode_prompts(["a red circle", "a low tone"]))

    lora.set_active_adapter(trainer.transformer, lora.TRAINED)
    trained = velocity(trainer.policy)
    fresh = LTX2Policy.from_pretrained(str(pipeline_dir), **CLIP)
    base = velocity(fresh)
    fresh.pipeline.load_lora_weights(str(out))
    loaded = velocity(fresh)
    assert not torch.allclose(base, trained, atol=1e-6), "one step moved the adapter"
    torch.testing.assert_close(loaded, trained, rtol=1e-4, atol=1e-5)


@needs_imagebind
def test_ltx2_clips_are_scored_by_the_real_clap_and_imagebind_code(
    pipeline_dir: Path, tmp_path: Path
) -> None:
    config = tmp_path / "rewards.yaml"
    config.write_text(yaml.safe_dump({"reward": clap_and_imagebind(tmp_path / "rewards")}))
    overrides = [o for o in _overrides(pipeline_dir, tmp_path / "run", 1) if not o.startswith("reward.")]
    summary = Trainer(load_config(config, overrides)).fit()
    assert summary["samples"]["trained"] == 2 * 2
    (row,) = step_records(tmp_path / "run")
    for name in ("clap", "imagebind"):
        assert math.isfinite(row[f"reward/{name}"]) and -1 <= row[f"reward/{name}"] <= 1, row


def test_vae_tiling_and_slicing_reach_the_vae_and_slicing_decodes_the_same() -> None:
    plain = LTX2Policy(tiny_ltx2_pipeline(), **CLIP)
    sliced = LTX2Policy(tiny_ltx2_pipeline(), **CLIP, vae_tiling=True, vae_slicing=True)
    assert (sliced.pipeline.vae.use_tiling, sliced.pipeline.vae.use_slicing) == (True, True)
    assert (plain.pipeline.vae.use_tiling, plain.pipeline.vae.use_slicing) == (False, False)
    x = torch.randn(2, *plain.latent_shape, generator=torch.Generator().manual_seed(4))
    # tiles larger than these 32 x 32 frames: tiling leaves them whole, slicing is exact
    torch.testing.assert_close(sliced.decode(x).video, plain.decode(x).video, rtol=0, atol=1e-5)
    # decoded into one output, post-processed a sample at a time: the pipeline's own batch
    # post-processing, bit for bit
    pipe = plain.pipeline
    video, _ = plain.split(x.float())
    frames, height, width = plain.video_grid
    config = plain.transformer.config
    latents = pipe._unpack_latents(video, frames, height, width, config.patch_size, config.patch_size_t)
    latents = pipe._denormalize_latents(
        latents, pipe.vae.latents_mean, pipe.vae.latents_std, pipe.vae.config.scaling_factor
    )
    with torch.no_grad():
        pixels = pipe.vae.decode(latents.to(pipe.vae.dtype), None, return_dict=False)[0]
    assert torch.equal(
        plain.decode(x).video, pipe.video_processor.postprocess_video(pixels, output_type="pt").float()
    )


def test_bf16_base_weights_train_with_fp32_adapters_and_sample_without_autocast(
    pipeline_dir: Path, tmp_path: Path
) -> None:
    from omni_diffusion_rl.inference import generate_media, load_policy

    losses = {}
    for dtype in ("fp32", "bf16"):
        run = tmp_path / dtype
        trainer = Trainer(load_config(None, [*_overrides(pipeline_dir, run, 2), f"model.base_dtype={dtype}"]))
        trainer.fit()
        losses[dtype] = [r["loss/total"] for r in step_records(run)]
    assert trainer.transformer.proj_in.weight.dtype == torch.bfloat16
    assert trainer.policy.pipeline.text_encoder.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in trainer.params), "the trained adapter and AdamW are fp32"
    # measured: bf16 within 1.1e-4 (step 1) and 4.1e-4 (step 2) of fp32; 10x that (docs/real-models.md)
    for fp32, bf16 in zip(losses["fp32"], losses["bf16"], strict=True):
        assert math.isfinite(bf16) and bf16 == pytest.approx(fp32, rel=4e-3), losses
    media = generate_media(load_policy(tmp_path / "bf16" / "checkpoints"), ["a red circle"], steps=2)
    assert torch.isfinite(media.video).all() and torch.isfinite(media.audio).all()
