"""What a new user hits with bad input: one run per folder, clear errors instead of tracebacks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from omni_diffusion_rl.checkpoint import resolve_checkpoint
from omni_diffusion_rl.config import ConfigError, load_config
from omni_diffusion_rl.run_dir import prepare_run_dir

from .helpers import ENV, REPO, fast_overrides, odrl, odrl_main, tiny_model_dir


def _train(*args: str, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    command = odrl("train", *args)
    return subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=timeout)


def _train_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`odrl train ARGS` through cli.main in this process (run from the repository root, as `_train`):
    its exit code and stderr. An error it did not turn into a sentence fails the test."""
    code, _, err = odrl_main(capsys, "train", *args)
    return code, err


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny")


@pytest.mark.slow  # starts training or launcher processes
def test_a_second_run_into_a_run_folder_is_refused_and_the_first_run_survives(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal in a real process (its exit code, no traceback); the runs around it in this one."""
    monkeypatch.chdir(REPO)
    run = tmp_path / "run"
    code, err = _train_in_process(
        capsys, *fast_overrides(model_dir, run, steps=4), "train.checkpoint_every=2"
    )
    assert code == 0, err
    metrics = (run / "metrics.jsonl").read_text()
    second = _train(*fast_overrides(model_dir, run, steps=1))
    assert second.returncode == 2
    assert "already holds a run (checkpoints up to step_0000004" in second.stderr
    assert f"--resume {run / 'checkpoints'}" in second.stderr and "train.overwrite=true" in second.stderr
    assert "Traceback" not in second.stderr
    assert (run / "metrics.jsonl").read_text() == metrics  # nothing erased
    assert resolve_checkpoint(run / "checkpoints").name == "step_0000004"
    # Starting over on purpose leaves one consistent run behind.
    code, err = _train_in_process(capsys, *fast_overrides(model_dir, run, steps=1), "train.overwrite=true")
    assert code == 0, err
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_0000001"]
    steps = [json.loads(line).get("step") for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) <= 1


def test_overwrite_deletes_only_what_a_run_writes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints" / "step_0000003").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "failed_samples.jsonl").write_text("{}\n")
    (run / "my_notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="already holds a run"):
        prepare_run_dir(run, resume=None, overwrite=False, is_main=True)
    prepare_run_dir(run, resume=str(run / "checkpoints"), overwrite=False, is_main=True)  # resuming is fine
    prepare_run_dir(run, resume=None, overwrite=True, is_main=True)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "my_notes.txt"]
    assert not list((run / "checkpoints").iterdir())


def test_an_output_folder_that_is_a_file_fails_at_start(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        prepare_run_dir(tmp_path / "f", resume=None, overwrite=False, is_main=True)
    with pytest.raises(ConfigError, match="cannot write there"):
        prepare_run_dir(tmp_path / "f" / "run", resume=None, overwrite=False, is_main=True)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.lr=.inf", "optim.lr: inf is not a finite number"),
        ("algorithm.beta=.inf", "algorithm.beta: inf is not a finite number"),
        ("reward.weights={color_match: .nan}", "reward.weights.color_match: nan is not a finite number"),
        ("train.output_dir=", "train.output_dir is empty"),
        ("train.output_dir='  '", "train.output_dir is empty"),
    ],
)
def test_non_finite_and_empty_values_are_refused(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("text", ["- a\n- b\n", "42\n", "just words\n"])
def test_a_config_that_is_not_a_mapping_is_a_clear_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="not a mapping of sections"):
        load_config(path, ["train.steps=3"])


@pytest.mark.slow  # trains in process
def test_a_directory_given_as_config_or_prompt_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match="is a directory; give a file"):
        load_config(tmp_path)
    code, err = _train_in_process(capsys, f"data.prompts={tmp_path}", f"train.output_dir={tmp_path / 'run'}")
    assert code == 2 and "is a directory" in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ["simulate", "--steps", "0"],
        ["sample", "--steps", "0", "--prompt", "a red circle"],
        ["bench", "nft-step", "--repeats", "0"],
    ],
)
def test_zero_counts_on_the_command_line_are_usage_errors(args: list[str]) -> None:
    done = subprocess.run(odrl(*args), capture_output=True, text=True, env=ENV, cwd=REPO, timeout=60)
    assert done.returncode == 2, done.stdout
    assert "must be at least 1" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow  # starts training or launcher processes
def test_prompts_not_divisible_by_processes_is_one_clear_error(model_dir: Path, tmp_path: Path) -> None:
    overrides = [o for o in fast_overrides(model_dir, tmp_path / "run") if "prompts_per_step" not in o]
    launch = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    script = str(REPO / "recipes" / "train_nft.py")
    done = subprocess.run(
        [odrl()[0], *launch, "--main_process_port", "29517", script, *overrides, "data.prompts_per_step=3"],
        capture_output=True,
        text=True,
        env={**ENV, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"},
        cwd=REPO,
        timeout=180,
    )
    assert done.returncode != 0
    assert done.stderr.count("data.prompts_per_step=3 must be divisible by the 2 processes") == 1
    assert f'File "{REPO / "omni_diffusion_rl"}' not in done.stderr  # a sentence, no traceback of ours


def test_odrl_train_nproc_refuses_a_layout_before_starting_any_process(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from omni_diffusion_rl.cli import main

    assert main(["train", "--nproc", "2", "data.prompts_per_step=3", "eval.metrics=[]"]) == 2
    err = capsys.readouterr().err
    assert err.count("data.prompts_per_step=3 must be divisible by the 2 processes") == 1, err
    assert main(["train", "--nproc", "3", "execution.mode=separate", "data.prompts_per_step=3"]) == 2
    assert "must be divisible by the 2 trainer processes" in capsys.readouterr().err


@pytest.mark.slow  # builds models in process
def test_a_missing_pretrained_model_and_bad_lora_targets_are_clear_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    for override, output, name in (
        (f"model.pretrained={tmp_path / 'nowhere'}", "a", "nowhere"),
        ("model.pretrained=someone/not-downloaded", "b", "someone/not-downloaded"),
        ("model.lora_targets=[no_such_layer]", "c", "no_such_layer"),
    ):
        code, err = _train_in_process(capsys, override, f"train.output_dir={tmp_path / output}")
        assert code == 2 and name in err and "Traceback" not in err, err


@pytest.mark.slow
def test_a_reward_server_that_serves_none_of_the_weights_is_refused() -> None:
    from omni_diffusion_rl.reward import RewardError
    from omni_diffusion_rl.reward_factory import reward_from_config
    from omni_diffusion_rl.serving.process import ServerProcess

    with ServerProcess(["av_sync"], "--port", "0", env=ENV, cwd=REPO) as srv:
        cfg = load_config(None, ["reward.weights={color_match: 1.0}", f"reward.url={srv.url}"]).reward
        with pytest.raises(RewardError, match=r"serves \['av_sync'\], but reward.weights uses none of them"):
            reward_from_config(cfg)
        used = load_config(None, ["reward.weights={color_match: 1.0, av_sync: 1.0}", f"reward.url={srv.url}"])
        reward_from_config(used.reward).close()


def test_a_plugin_file_registers_its_reward_and_a_shared_checkpoint_imports_none(tmp_path: Path) -> None:
    from omni_diffusion_rl.evaluation.targets import target_config
    from omni_diffusion_rl.registry import rewards

    marker = tmp_path / "imported"
    plugin = tmp_path / "my_rewards.py"
    plugin.write_text(
        "from pathlib import Path\n"
        "import torch\n"
        "from omni_diffusion_rl.registry import rewards\n"
        f"Path({str(marker)!r}).write_text('x')\n"
        "@rewards.register('test_file_plugin', overwrite=True)\n"
        "class Level:\n"
        "    def score(self, media, prompts):\n"
        "        return torch.ones(len(prompts))\n"
    )
    cfg = load_config(None, [f"reward.plugins=[{plugin}]", "reward.weights={test_file_plugin: 1.0}"])
    assert "test_file_plugin" in rewards.names() and marker.exists()
    with pytest.raises(ConfigError, match="reward.plugins file .* does not exist"):
        load_config(None, [f"reward.plugins=[{tmp_path / 'nope.py'}]"])
    # A checkpoint whose config names a plug-in file: evaluating it does not import the file.
    from omni_diffusion_rl.checkpoint import save_checkpoint

    marker.unlink()
    state = {
        "step": 1,
        "config": {**cfg.to_dict(), "reward": {**cfg.to_dict()["reward"], "weights": {"av_sync": 1.0}}},
    }
    ckpt = save_checkpoint(tmp_path / "ckpt", 1, {}, {}, state)
    evaluated = target_config(str(ckpt), None, [])
    assert evaluated.reward.plugins == [] and not marker.exists()


@pytest.mark.parametrize("url", ["http://127.0.0.1:8400/score", "http://127.0.0.1:8400/?x=1", "http://:8400"])
def test_a_reward_url_with_a_path_is_refused_at_load(url: str) -> None:
    with pytest.raises(ConfigError, match="must be scheme://host:port only"):
        load_config(None, [f"reward.url={url}"])


@pytest.mark.slow  # trains in process
def test_a_reward_server_that_is_down_names_the_rewards(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    monkeypatch.chdir(REPO)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, err = _train_in_process(
        capsys,
        f"reward.url=http://127.0.0.1:{port}",
        "reward.request_retries=1",
        "reward.timeout_s=2",
        f"train.output_dir={tmp_path / 'run'}",
    )
    assert code == 2 and "Traceback" not in err
    assert f"http://127.0.0.1:{port}" in err and "'color_match'" in err
    assert "odrl serve-reward color_match" in err
