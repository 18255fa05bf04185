"""The CLI's sample and pretrain paths, and the tiny world's pre-training."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from omni_diffusion_rl.models.folder_card import read_folder_guidance, read_trained_parts
from omni_diffusion_rl.models.tiny_av import TinyAVPolicy
from omni_diffusion_rl.world import tiny_world as world
from omni_diffusion_rl.world.pretrain import pretrain_base_model

from .helpers import ENV, REPO, odrl, odrl_main, tiny_model_dir


@pytest.mark.slow
def test_pretrain_writes_a_loadable_model_and_lowers_the_loss(tmp_path: Path) -> None:
    out = tmp_path / "base"
    small = {"dim": 32, "depth": 1, "heads": 2, "mlp_ratio": 2}
    first = pretrain_base_model(out, steps=1, batch_size=8, progress=False, ema_decay=0.0, **small)
    assert (out / "config.json").is_file()
    later = pretrain_base_model(out, steps=60, batch_size=16, lr=3e-3, progress=False, ema_decay=0.0, **small)
    assert later["final_loss"] < first["final_loss"]
    policy = TinyAVPolicy.from_pretrained(out)
    (dim,) = policy.latent_shape
    v = policy.velocity(torch.zeros(2, dim), torch.full((2,), 0.5), policy.encode_prompts(["a", "b"]))
    assert v.shape == (2, dim) and torch.isfinite(v).all()


@pytest.mark.slow
def test_odrl_pretrain_takes_the_teachers_size_and_writes_its_guidance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--dim/--depth/--heads size the model; --teacher's folder recommends guidance 3 unless it
    learned no empty prompt; a size that cannot work is refused before any training. The first
    pretraining is a real `odrl pretrain` process; the others go through cli.main in this one."""
    size = ("--steps", "1", "--dim", "32", "--depth", "1", "--heads", "2")
    guided, unguided = tmp_path / "guided", tmp_path / "unguided"
    command = odrl("pretrain", *size, "--teacher", "--output", str(guided))
    done = subprocess.run(command, env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    config = json.loads((guided / "config.json").read_text())
    assert (config["dim"], config["depth"], config["heads"]) == (32, 1, 2)
    assert read_folder_guidance(guided) == 3.0
    code, _, err = odrl_main(
        capsys, "pretrain", *size, "--teacher", "--prompt-dropout", "0", "--output", str(unguided)
    )
    assert code == 0, err
    assert read_folder_guidance(unguided) is None
    code, _, err = odrl_main(capsys, "pretrain", *size, "--heads", "5", "--output", str(tmp_path / "bad"))
    assert code == 2, err
    assert "dim 32 must be a multiple of heads 5" in err, err
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_a_partial_pretraining_learns_only_its_parts(tmp_path: Path) -> None:
    """--parts spectrum,loudness: the picture's head gets no gradient and stays the init's; the
    pitch head learns (a tiny audio-only teacher for teacher.routes)."""
    small = {"dim": 32, "depth": 1, "heads": 2, "mlp_ratio": 2, "batch_size": 8, "progress": False}
    pretrain_base_model(tmp_path / "init", steps=1, lr=1e-12, ema_decay=0.0, **small)  # the init, kept
    audio_only = ["spectrum", "loudness"]
    pretrain_base_model(tmp_path / "audio", steps=20, lr=3e-3, ema_decay=0.0, parts=audio_only, **small)
    init, audio = (TinyAVPolicy.from_pretrained(tmp_path / name).transformer for name in ("init", "audio"))
    torch.testing.assert_close(audio.picture_out.weight, init.picture_out.weight, rtol=0, atol=1e-5)
    assert not torch.allclose(audio.pitch_out.weight, init.pitch_out.weight, atol=1e-3), "the audio learned"
    assert read_trained_parts(tmp_path / "audio") == ("spectrum", "loudness")  # the folder says so
    assert read_trained_parts(tmp_path / "init") is None
    pretrain_base_model(tmp_path / "audio", steps=1, **small)  # retrained on every part: the file goes
    assert read_trained_parts(tmp_path / "audio") is None
    with pytest.raises(ValueError, match=r"parts \['depth'\]: the latent's parts are picture"):
        pretrain_base_model(tmp_path / "x", steps=1, parts=["depth"], **small)


def test_pretraining_is_reproducible(tmp_path: Path) -> None:
    small = {
        "dim": 32,
        "depth": 1,
        "heads": 2,
        "mlp_ratio": 2,
        "steps": 3,
        "batch_size": 4,
        "progress": False,
    }
    pretrain_base_model(tmp_path / "a", **small)
    pretrain_base_model(tmp_path / "b", **small)
    a = load_file(str(tmp_path / "a" / "diffusion_pytorch_model.safetensors"))
    b = load_file(str(tmp_path / "b" / "diffusion_pytorch_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_prompt_dropout_trains_on_the_empty_prompt(tmp_path: Path) -> None:
    """prompt_dropout (for guidance): the empty prompt's velocity is trained toward the clips, so its
    loss on held clips falls further than without dropout; a share outside [0, 1) is refused."""
    small = {"dim": 32, "depth": 1, "heads": 2, "mlp_ratio": 2, "batch_size": 16, "progress": False}
    for share in (0.0, 0.5):
        out = tmp_path / str(share)
        pretrain_base_model(out, steps=40, lr=3e-3, ema_decay=0.0, prompt_dropout=share, **small)
    gen = torch.Generator().manual_seed(7)
    _, video, amps = world.synthetic_clips(64, gen)
    losses = {}
    for share in (0.0, 0.5):
        policy = TinyAVPolicy.from_pretrained(tmp_path / str(share))
        x0 = policy.transformer.layout.encode(video, amps)
        noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(8))
        t = torch.full((64,), 0.5)
        with torch.no_grad():
            v = policy.velocity((x0 + noise) / 2, t, policy.encode_prompts([""] * 64))
        losses[share] = float(((v - (noise - x0)) ** 2).mean())
    assert losses[0.5] < losses[0.0], losses
    with pytest.raises(ValueError, match=r"prompt_dropout=1.0: give a share in \[0, 1\)"):
        pretrain_base_model(tmp_path / "x", steps=1, prompt_dropout=1.0, **small)


def test_pretraining_records_its_recommended_guidance_in_the_folder(tmp_path: Path) -> None:
    """guidance= writes guidance.json (what a teacher uses when given none); a model without the empty
    prompt may not recommend any, and a folder retrained without guidance loses the old file."""
    small = {"dim": 32, "depth": 1, "heads": 2, "mlp_ratio": 2, "batch_size": 8, "progress": False}
    pretrain_base_model(tmp_path, steps=2, prompt_dropout=0.2, guidance=2.5, **small)
    assert read_folder_guidance(tmp_path) == 2.5
    pretrain_base_model(tmp_path, steps=2, prompt_dropout=0.2, **small)
    assert read_folder_guidance(tmp_path) is None and not (tmp_path / "guidance.json").exists()
    with pytest.raises(ValueError, match=r"guidance=3.0 needs a model trained on the empty prompt"):
        pretrain_base_model(tmp_path / "y", steps=1, guidance=3.0, **small)
    # refused before any training, so nothing is written
    with pytest.raises(ValueError, match=r"cfg_scale 0.5 is outside \[1, 20\]"):
        pretrain_base_model(tmp_path / "z", steps=1, prompt_dropout=0.1, guidance=0.5, **small)
    with pytest.raises(ValueError, match="distinct names"):
        pretrain_base_model(tmp_path / "z", steps=1, parts=["picture", "picture"], **small)
    with pytest.raises(ValueError, match=r"parts \['depth'\]"):
        pretrain_base_model(tmp_path / "z", steps=1, parts=["depth"], **small)
    assert not (tmp_path / "z").exists() and not (tmp_path / "y").exists()


def test_the_latent_encodes_world_clips_exactly() -> None:
    layout = TinyAVPolicy.from_pretrained().transformer.layout
    prompts, video, amps = world.synthetic_clips(32, torch.Generator().manual_seed(3), label_noise=0.5)
    x = layout.encode(video, amps)
    assert x.shape == (32, layout.dim) and float(x.abs().max()) <= 1.0
    decoded_video, decoded_amps = layout.decode(x)
    assert torch.allclose(decoded_video, video, atol=1e-6) and torch.equal(decoded_amps, amps)


def test_missing_model_directory_is_a_clear_error(tmp_path: Path) -> None:
    try:
        TinyAVPolicy.from_pretrained(tmp_path / "absent")
    except FileNotFoundError as e:
        assert "config.json missing" in str(e)
    else:
        raise AssertionError("loading a missing model must fail")


@pytest.mark.slow
def test_sample_command_writes_previews(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`odrl sample` through cli.main in this process (its refusals in a real process:
    test_cli_errors.py)."""
    model = tiny_model_dir(tmp_path / "model")
    out = tmp_path / "samples"
    prompts = ["--prompt", world.HELDOUT_PROMPTS[0], "--prompt", world.HELDOUT_PROMPTS[1]]
    code, printed, err = odrl_main(
        capsys, "sample", "--pretrained", str(model), *prompts, "--steps", "3", "--output", str(out)
    )
    assert code == 0, err
    files = json.loads(printed.strip().splitlines()[-1])["files"]
    assert {"sheet.png", "sample_00.gif", "sample_01.wav", "index.json"} <= set(files)
    index = json.loads((out / "index.json").read_text())
    assert index["prompts"] == world.HELDOUT_PROMPTS[:2]


def test_guided_samples_differ_and_scale_one_is_the_plain_sampler(tmp_path: Path) -> None:
    from omni_diffusion_rl.inference import generate_media, load_policy

    policy = load_policy(None, str(tiny_model_dir(tmp_path / "model")))
    prompts = world.HELDOUT_PROMPTS[:2]
    plain = generate_media(policy, prompts, steps=3)
    assert torch.equal(generate_media(policy, prompts, steps=3, cfg_scale=1.0).video, plain.video)
    guided = generate_media(policy, prompts, steps=3, cfg_scale=4.0)
    assert not torch.allclose(guided.video, plain.video, atol=1e-3)


def test_every_tiny_world_prompt_parses_back_to_its_scene() -> None:
    for scene in world.ALL_SCENES:
        assert world.parse_prompt(scene.prompt) == scene
    assert world.parse_prompt("a photo of a cat") is None
    assert not set(world.TRAIN_PROMPTS) & set(world.HELDOUT_PROMPTS)
