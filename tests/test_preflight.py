"""`odrl train CONFIG --check`: the shipped GPU recipes validate without their weights and name what
to download or start; a complete setup (a tiny H3 directory, a reward server answering on loopback)
is ready."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_diffusion_rl.cli import main
from omni_diffusion_rl.config import load_config
from omni_diffusion_rl.preflight import MISSING, OK, WRONG, preflight

from .h3_tiny import save_tiny_h3

REPO = Path(__file__).resolve().parents[1]


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = b'{"status": "ok"}' if self.path == "/health" else b"{}"
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("recipe", ["h3_av_nft.yaml", "ltx2_av_nft.yaml"])
def test_a_gpu_recipe_checks_without_weights_and_names_what_to_download(
    recipe: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(REPO)
    down = f"reward.url=http://127.0.0.1:{_free_port()}"
    code = main(
        ["train", f"recipes/configs/{recipe}", down, f"train.output_dir={tmp_path / 'run'}", "--check"]
    )
    out = capsys.readouterr().out
    assert code == 1, out
    folders = "transformer, vae, audio_vae, text_encoder, tokenizer" if "h3" in recipe else "vocoder"
    assert "MISSING" in out and folders in out, out
    assert "does not answer" in out and "odrl serve-reward clap imagebind" in out, out
    assert "2 to fix first" in out and "ok       model.options" in out


def test_a_complete_setup_is_ready_and_a_missing_part_is_named(health_server: str, tmp_path: Path) -> None:
    h3 = save_tiny_h3(tmp_path / "h3")
    overrides = [
        "model.family=minimax_h3",
        f"model.pretrained={h3}",
        f"reward.url={health_server}",
        "reward.weights={clap: 1.0, imagebind: 1.0}",
        "eval.metrics=[]",
        f"train.output_dir={tmp_path / 'run'}",
    ]
    findings = preflight(load_config(None, overrides))
    assert all(f.status == OK for f in findings), findings
    (h3 / "vae").rename(tmp_path / "elsewhere")
    model = preflight(load_config(None, overrides))[0]
    assert (model.status, model.detail) == (MISSING, f"{h3} lacks vae: download them into it")
    local = [o for o in overrides if not o.startswith("reward.")]
    local += [
        "reward.weights={clap: 1.0}",
        f"reward.options={{clap: {{checkpoint: {tmp_path / 'no_clap'}}}}}",
    ]
    rewards = [f for f in preflight(load_config(None, local)) if f.what.startswith("reward")]
    assert [(f.status, f.what) for f in rewards] == [(MISSING, "reward.options.clap.checkpoint")]


def test_a_family_option_that_does_not_exist_is_wrong(tmp_path: Path) -> None:
    cfg = load_config(None, ["model.family=minimax_h3", "model.options={fps: 24}", "eval.metrics=[]"])
    options = preflight(cfg)[1]
    assert options.status == WRONG and "fps unknown to minimax_h3; it takes height, width" in options.detail


@pytest.mark.parametrize(
    ("option", "said"),
    [
        ("motion_at=frame", "motion_at must be one of between_frames, frames; got 'frame'"),
        ("reach_frames=0", "reach_frames (where a pair's credit reaches 0) is in frames"),
        ("bogus=1", "unexpected keyword argument 'bogus'; sync_onsets takes motion_columns, reach_frames"),
    ],
)
def test_a_reward_option_the_reward_refuses_is_wrong_before_the_run(option: str, said: str) -> None:
    """The run builds its rewards after loading the model; --check builds those that load nothing."""
    recipe = "recipes/configs/tiny_sync_nft.yaml"
    (finding,) = [
        f
        for f in preflight(load_config(recipe, [f"reward.options.sync_onsets.{option}"]))
        if f.what == "reward.options.sync_onsets"
    ]
    assert finding.status == WRONG and said in finding.detail
    assert not [f for f in preflight(load_config(recipe, [])) if f.what.startswith("reward.options")]


@pytest.mark.parametrize("family", ["tiny_av", "tiny_omni", "sd3", "stable_audio"])
def test_an_option_to_a_family_that_takes_none_is_wrong_and_refused_at_load(family: str) -> None:
    """These families read no model.options: one given was ignored without a word."""
    from omni_diffusion_rl.config import ConfigError
    from omni_diffusion_rl.models.families import check_family_options

    cfg = load_config(None, [f"model.family={family}", "model.options={height: 64}", "eval.metrics=[]"])
    (options,) = [f for f in preflight(cfg) if f.what == "model.options"]
    assert options.status == WRONG and f"height unknown to {family}, which takes no options" in options.detail
    with pytest.raises(ConfigError, match=f"model.options: height unknown to {family}"):
        check_family_options(family, {"height": 64})
    check_family_options(family, {})


def test_the_gspo_recipe_checks_ready_and_a_missing_tokenizer_is_named(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(REPO)
    recipe = [
        "train",
        "recipes/configs/tiny_avqa_gspo.yaml",
        f"train.output_dir={tmp_path / 'run'}",
        "--check",
    ]
    assert main(recipe) == 0, capsys.readouterr().out
    (tmp_path / "omni").mkdir()
    (tmp_path / "omni" / "omni_config.json").write_text("{}")
    assert main([*recipe, f"model.pretrained={tmp_path / 'omni'}"]) == 1
    out = capsys.readouterr().out
    assert "lacks lm, tokenizer, media_encoder.safetensors" in out, out


def test_the_qwen_omni_recipe_names_what_to_download(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(REPO)
    recipe = [
        "train",
        "recipes/configs/qwen2_5_omni_avqa_gspo.yaml",
        f"train.output_dir={tmp_path}",
        "--check",
    ]
    assert main(recipe) == 1
    out = capsys.readouterr().out
    assert (
        "/models/Qwen2.5-Omni-7B does not exist: download the model with config.json, "
        "preprocessor_config.json, tokenizer_config.json there"
    ) in out, out
    assert "ok       data.prompts" in out and "qwen_avqa_files/questions.jsonl: 60 prompts" in out, out


def test_the_qwen_recipe_is_ready_on_its_shipped_example_set_with_the_7bs_processors(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The shipped Qwen-format example set (16 kHz sound in 224 x 224 MP4s, 2 fps, 4 s) passes every
    check of the real recipe against a thinker with Qwen2.5-Omni-7B's processors; the tiny world's
    half-second set is refused by the same check, naming the clip's fault."""
    from omni_diffusion_rl.benchmarks.tiny_qwen import save_tiny_qwen_omni

    monkeypatch.chdir(REPO)
    folder = save_tiny_qwen_omni(tmp_path / "qwen", seven_b=True)
    recipe = [
        "train",
        "recipes/configs/qwen2_5_omni_avqa_gspo.yaml",
        f"model.pretrained={folder}",
        f"train.output_dir={tmp_path / 'run'}",
        "--check",
    ]
    assert main(recipe) == 0
    out = capsys.readouterr().out
    assert "ready to train" in out and "MISSING" not in out and "WRONG" not in out, out
    tiny = "recipes/data/tiny_avqa_files/questions.jsonl"
    assert main([*recipe, f"data.prompts={tiny}", f"data.eval_prompts={tiny}"]) == 1
    out = capsys.readouterr().out
    assert "has no usable train question" in out, out
    assert "is too short: 1 of the 8 frames of a 4 s clip" in out, out


def test_teacher_servers_that_do_not_answer_are_named_and_a_route_that_answers_is_ready(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, health_server: str
) -> None:
    """Distillation asks its teacher servers' /health: a closed port is MISSING with the command to
    start there (it said ready), each route's pool is asked, and an algorithm without a teacher asks
    none."""
    monkeypatch.chdir(REPO)
    closed = f"http://127.0.0.1:{_free_port()}"
    recipe = ["train", "recipes/configs/tiny_t2av_distill.yaml", f"train.output_dir={tmp_path / 'run'}"]
    assert main([*recipe, f"teacher.urls=[{closed}]", "--check"]) == 1
    out = capsys.readouterr().out
    assert "MISSING  teacher.urls" in out and f"{closed} does not answer" in out, out
    assert "start `odrl serve-teacher policy` there" in out, out
    routes = (
        "teacher.routes={video: {parts: [picture, visibility], urls: [" + health_server + "]}, "
        "audio: {parts: [spectrum, loudness], urls: [" + closed + "]}}"
    )
    assert main([*recipe, routes, "--check"]) == 1
    out = capsys.readouterr().out
    lines = {" ".join(line.split()[:3]) for line in out.splitlines()}
    assert {
        f"ok teacher.routes.video.urls {health_server}",
        f"MISSING teacher.routes.audio.urls {closed}",
    } <= lines
    nft = ["train", "recipes/configs/tiny_t2av_nft.yaml", f"train.output_dir={tmp_path / 'nft'}"]
    assert main([*nft, f"teacher.urls=[{closed}]", "--check"]) == 0
    assert "teacher.urls" not in capsys.readouterr().out


def test_how_an_h3_folder_loads_is_noted_from_its_headers(tmp_path: Path) -> None:
    """The tiny H3's files are fp32: loaded in bf16 its conditioner is copied into every process (a
    note; in fp32 none); a sharded transformer without safetensors files is read whole (a note)."""
    from omni_diffusion_rl.preflight import NOTE, check_stored_dtypes

    folder = save_tiny_h3(tmp_path / "h3")
    base = ["model.family=minimax_h3", f"model.pretrained={folder}", "train.sharding=fsdp", "eval.metrics=[]"]
    assert check_stored_dtypes(load_config(None, [*base, "model.base_dtype=fp32"])) == []
    notes = check_stored_dtypes(load_config(None, [*base, "model.base_dtype=bf16"]))
    assert [(f.status, f.what) for f in notes] == [(NOTE, "model.base_dtype (text encoder)")]
    assert "stores float32" in notes[0].detail and "every process makes a copy" in notes[0].detail
    for weights in (folder / "transformer").glob("*.safetensors"):
        weights.rename(weights.with_suffix(".moved"))
    notes = check_stored_dtypes(load_config(None, [*base, "model.base_dtype=fp32"]))
    assert [f.what for f in notes] == ["train.sharding (transformer)"]
    assert all(f in preflight(load_config(None, [*base, "model.base_dtype=fp32"])) for f in notes)


def test_the_qwen3_omni_recipe_names_what_to_download(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(REPO)
    recipe = ["train", "recipes/configs/qwen3_omni_avqa_gspo.yaml", f"train.output_dir={tmp_path}", "--check"]
    assert main(recipe) == 1
    out = capsys.readouterr().out
    assert "/models/Qwen3-Omni-30B-A3B-Instruct does not exist: download the model" in out, out
    assert "ok       data.prompts" in out and "qwen_avqa_files/questions.jsonl: 60 prompts" in out, out
