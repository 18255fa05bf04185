"""Every refusal `odrl` meets is one sentence on stderr, exit code 2 and no traceback, through the one
error path of cli.main (issue 24, items 5, 9 and 10): config loading bounded (aliases, duplicate keys,
deep nesting), teacher routing failures, a missing teacher token, teacher options, a port in use, an
unwritable output, a device as a prompt or config file, a plug-in calling sys.exit, a teacher url with
a path. A genuine bug keeps its traceback. In-process tests call cli.main (an exception it did not
turn into a sentence would fail the test); the slow ones run `python -m omni_diffusion_rl.cli` where
the property is a real process's (its exit code, no traceback however it ends)."""

from __future__ import annotations

import errno
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_diffusion_rl.cli import bench as bench_commands
from omni_diffusion_rl.cli import main
from omni_diffusion_rl.cli import serve as serve_commands
from omni_diffusion_rl.serving.process import ServerProcess
from omni_diffusion_rl.serving.teacher_client import RemoteTeacher, TeacherURLError

from .helpers import ENV, REPO, fast_overrides, odrl, tiny_model_dir

ALIAS = "the alias *a is refused"


def _bomb(levels: int = 9, width: int = 9) -> str:
    """The 'billion laughs' of the issue under algorithm.options: width^levels values from under 500 bytes."""
    names = [chr(ord("a") + i) for i in range(levels)]
    rows = [f"    a: &a [{', '.join(['lol'] * width)}]"]
    rows += [
        f"    {names[i]}: &{names[i]} [{', '.join([f'*{names[i - 1]}'] * width)}]" for i in range(1, levels)
    ]
    return "algorithm:\n  options:\n" + "\n".join(rows) + "\n"


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """cli.main's stderr for a command it must refuse with one sentence and exit code 2."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("odrl: ") and err.count("\n") == 1, err
    return err


@pytest.fixture
def listening() -> Iterator[int]:
    """A port another process listens on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


# ------------------------------------------------------------------ config loading (item 5, 9, 10)


def test_an_alias_bomb_is_refused_at_once_in_a_file_and_in_overrides(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_bomb())
    assert len(bomb.read_bytes()) < 500  # 9^9 = 387 million values
    # Refused, not expanded: expanding the bomb would hold hundreds of millions of values (the
    # process runs out of memory) long before any message.
    err = _refused(capsys, "train", str(bomb), "--check")
    assert f"odrl: ConfigError: config file {bomb}, line 4: {ALIAS}" in err
    for section in ("algorithm", "reward"):
        err = _refused(capsys, "train", f"{section}.options={{a: &a [1, 1], b: [*a, *a]}}", "--check")
        assert f"odrl: ConfigError: override '{section}.options=" in err and ALIAS in err


def test_duplicate_keys_are_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "dup.yaml"
    config.write_text("train:\n  steps: 3\ndata:\n  group_size: 4\ntrain:\n  seed: 1\n")
    err = _refused(capsys, "train", str(config), "--check")
    assert "line 5: the key 'train' is given twice (first on line 1); give each key once" in err
    err = _refused(capsys, "train", "algorithm.options={lr: 1, lr: 2}", "--check")
    assert "the key 'lr' is given twice" in err


def test_deep_nesting_is_a_sentence_not_a_recursion_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "deep.yaml"
    config.write_text("algorithm:\n  options:\n    a: " + "[" * 5000 + "]" * 5000 + "\n")
    assert "nesting deeper than 32 levels is refused" in _refused(capsys, "train", str(config), "--check")
    block = "".join(f"{'  ' * i}k:\n" for i in range(3000))  # block style, one key a level
    config.write_text(block)
    assert "nesting deeper than 32 levels is refused" in _refused(capsys, "train", str(config), "--check")
    err = _refused(capsys, "train", "reward.options={a: " + "{b: " * 3000 + "1" + "}" * 3001, "--check")
    assert "nesting deeper than 32 levels is refused" in err
    dotted = "model.options." + ".".join(["a"] * 3000) + "=1"
    assert "nested deeper than 32 levels" in _refused(capsys, "train", dotted, "--check")
    deep_json = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    err = _refused(capsys, "serve-teacher", "policy", "--options", deep_json, "--port", "0")
    assert "--options nests too deeply" in err


def test_a_device_as_a_config_or_prompt_file(capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(capsys, "train", "/dev/zero", "--check")
    assert "config file /dev/zero is not a regular file (a device, pipe or socket)" in err
    err = _refused(capsys, "sample", "--prompts-file", "/dev/zero")
    assert "odrl: PromptFileError: prompt file /dev/zero is not a regular file" in err


# ------------------------------------------------------------------ servers and outputs (item 9)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ('{"cfg_scale": 0}', "cfg_scale must be a number >= 1 (1 is off); got 0"),
        ('{"cfg_scale": "high"}', "cfg_scale must be a number >= 1 (1 is off); got 'high'"),
        ('{"device": "warp-drive"}', "device 'warp-drive' is not a device"),
        ('{"no_such_option": 1}', "could not be created with ['no_such_option']"),
    ],
)
def test_teacher_options_are_sentences(
    options: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(capsys, "serve-teacher", "policy", "--options", options, "--port", "0")
    assert err.startswith("odrl: ConfigError: ") and message in err, err


@pytest.mark.parametrize("command", [["serve-reward", "color_match"], ["serve-teacher", "policy"]])
def test_a_port_in_use_is_a_sentence_before_anything_loads(
    command: list[str], listening: int, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(capsys, *command, "--port", str(listening))
    assert f"cannot listen: port {listening} on 127.0.0.1 is in use (another server?)" in err
    assert "pass another --port (0 picks a free one)" in err


def test_a_port_taken_after_the_check_is_a_sentence_too(
    listening: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        serve_commands, "_check_can_listen", lambda settings: None
    )  # another process was quicker
    err = _refused(capsys, "serve-reward", "color_match", "--port", str(listening))
    assert f"port {listening} on 127.0.0.1 is in use" in err


def test_a_host_that_is_not_this_machine_is_a_sentence(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ODRL_REWARD_TOKEN", "a-token")  # binding beyond loopback needs one
    err = _refused(capsys, "serve-reward", "color_match", "--host", "no-such-host.invalid", "--port", "8999")
    assert "--host no-such-host.invalid is not a name or address of this machine" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["sample", "--prompt", "a red circle", "--output", "/proc/x"],
            "--output /proc/x: cannot write there",
        ),
        (
            ["eval", "world", "--output", "/proc/x/r.json"],
            "--output /proc/x/r.json: the folder /proc/x: cannot",
        ),
        (["simulate", "--output", "/proc/x/r.json"], "--output /proc/x/r.json: the folder /proc/x: cannot"),
        (
            ["sample", "--prompt", "a red circle", "--output", "/dev/null"],
            "--output /dev/null is not a folder",
        ),
        (["eval", "world", "--output", "/tmp"], "--output /tmp is a folder; give a file name"),
    ],
)
def test_an_output_that_cannot_be_written_is_a_sentence_before_any_work(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in _refused(capsys, *argv)


# ------------------------------------------------------------------ plug-ins and urls (item 10)

EXITING_REWARD = """
import sys

from omni_diffusion_rl.registry import rewards


@rewards.register("test_exiting_reward")
def exiting_reward(**kwargs):
    sys.exit(4)
"""


def test_a_plugin_calling_sys_exit_is_a_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    exits = tmp_path / "exits_on_import.py"
    exits.write_text("import sys\nsys.exit(3)\n")
    err = _refused(capsys, "train", f"reward.plugins=[{exits}]", "--check")
    assert f"reward.plugins: importing '{exits}' called sys.exit(3); a plug-in module must register" in err
    plugin = tmp_path / "exiting_reward.py"
    plugin.write_text(EXITING_REWARD)
    err = _refused(capsys, "serve-reward", "test_exiting_reward", "--plugin", str(plugin), "--port", "0")
    assert "odrl: RegistryError: creating reward 'test_exiting_reward' called sys.exit(4)" in err

    def exit_somewhere(args: object) -> int:
        sys.exit(5)

    monkeypatch.setattr(bench_commands, "cmd_simulate", exit_somewhere)
    err = _refused(capsys, "simulate")
    assert "odrl: SystemExit: `odrl simulate` was ended by sys.exit(5) at " in err and __file__ in err


def test_a_teacher_url_with_a_path_names_the_teacher() -> None:
    with pytest.raises(TeacherURLError, match="teacher.urls: teacher server url 'http://127.0.0.1:8500/v'"):
        RemoteTeacher(["http://127.0.0.1:8500/v"])
    with pytest.raises(TeacherURLError, match="e.g. http://127.0.0.1:8500 \\(as `odrl serve-teacher`"):
        RemoteTeacher(["127.0.0.1:8500"])


# ------------------------------------------------------------------ genuine bugs stay visible


def test_a_genuine_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(args: object) -> int:
        return 1 // 0

    monkeypatch.setattr(bench_commands, "cmd_simulate", broken)
    with pytest.raises(ZeroDivisionError):
        main(["simulate"])

    def disk_full(*args: object, **kwargs: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("omni_diffusion_rl.serving.server.main_serve", disk_full)
    with pytest.raises(OSError, match="No space left"):  # not a listening error: not explained away
        main(["serve-reward", "color_match", "--port", "0"])


# ------------------------------------------------------------------ real processes (slow)


def _odrl(
    *args: str, env: dict[str, str] | None = None, timeout: int = 240
) -> subprocess.CompletedProcess[str]:
    command = odrl(*args)
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={**ENV, "OMP_NUM_THREADS": "1", **(env or {})},
        cwd=REPO,
        timeout=timeout,
    )


def _sentence(done: subprocess.CompletedProcess[str], message: str) -> None:
    """Exit code 2, `message` in stderr, no traceback."""
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert message in done.stderr, done.stderr[-3000:]


@pytest.mark.slow  # starts odrl processes
def test_the_listed_crashes_are_sentences_in_a_real_process(tmp_path: Path, listening: int) -> None:
    bomb, deep = tmp_path / "bomb.yaml", tmp_path / "deep.yaml"
    bomb.write_text(_bomb())
    deep.write_text("algorithm:\n  options:\n    a: " + "[" * 5000 + "]" * 5000 + "\n")
    run = f"train.output_dir={tmp_path / 'run'}"
    cases = {
        ("train", str(bomb), run): ALIAS,  # `train`, not only --check: it hung in dataclasses.asdict
        ("train", str(deep), run): "nesting deeper than 32 levels is refused",
        ("serve-teacher", "policy", "--options", '{"cfg_scale": 0}'): "cfg_scale must be a number >= 1",
        ("serve-teacher", "policy", "--port", str(listening)): f"port {listening} on 127.0.0.1 is in use",
        ("sample", "--prompt", "a red circle", "--output", "/proc/x"): "--output /proc/x: cannot write there",
        (
            "sample",
            "--prompt",
            "a red circle",
            "--cfg-scale",
            "0.5",
        ): "expected a finite number >= 1 (1 is off)",
    }
    for args, message in cases.items():
        _sentence(_odrl(*args, timeout=120), message)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("teacher"))


def _distill(student: Path, run: Path, steps: int, urls: list[str], *extra: str) -> list[str]:
    return [
        *fast_overrides(student, run, steps),
        "train.eval_at_start_and_end=false",
        "algorithm.name=distill",
        f"teacher.urls=[{', '.join(urls)}]",
        "teacher.request_samples=2",
        "teacher.timeout_s=10",
        *extra,
    ]


def _teacher_server(model: Path, **env: str) -> ServerProcess:
    options = json.dumps({"pretrained": str(model)})
    return ServerProcess(["policy"], "--options", options, command="serve-teacher", env={**ENV, **env})


@pytest.mark.slow  # starts server and training processes
def test_teacher_routing_failures_and_every_replica_gone_are_sentences(
    teacher_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each teacher routing failure is refused by cli.main with one sentence (in this process, against
    real servers); then, in a real `odrl train` process, every replica gone mid-run is a sentence
    (exit code 2, no traceback) and the checkpoint stays. Three servers serve every case: the other
    model sits behind a token, asked with it for the mismatch and without it for the refusal, and
    the first teacher is the one killed mid-run at the end."""
    from .test_teacher_server import _kill_after_step

    student, other = tiny_model_dir(tmp_path / "student", seed=1), tiny_model_dir(tmp_path / "other", seed=3)
    with socket.socket() as free:  # a port nothing listens on
        free.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{free.getsockname()[1]}"
    with (
        _teacher_server(teacher_dir, OMP_NUM_THREADS="1") as first,
        _teacher_server(other, OMP_NUM_THREADS="1", ODRL_TEACHER_TOKEN="s3cret") as guarded,
        ServerProcess(["color_match"], env={**ENV, "OMP_NUM_THREADS": "1"}) as rewards,
    ):
        cases = [  # the urls, the token this process sends (None: none), the sentence
            (
                [rewards.url],
                None,
                f"TeacherServerMismatch: teacher server {rewards.url} does not serve 'policy'; it serves [];"
                " it is a reward server (rewards ['color_match'])",
            ),
            (
                [first.url, guarded.url],
                "s3cret",  # the first ignores it; the second answers with its (other) model
                "TeacherServerMismatch: the teacher replicas serve different models",
            ),
            ([closed], None, f"TeacherUnavailable: teacher server {closed} does not answer /info"),
            (
                [guarded.url],
                None,
                f"TeacherRequestRejected: teacher server {guarded.url} refused /info (401): no token "
                "was sent: set ODRL_TEACHER_TOKEN to the token the teacher server was started with",
            ),
            (["http://127.0.0.1:8500/velocity"], None, "TeacherURLError: teacher.urls: teacher server url"),
        ]
        for i, (urls, token, message) in enumerate(cases):
            if token is None:
                monkeypatch.delenv("ODRL_TEACHER_TOKEN", raising=False)
            else:
                monkeypatch.setenv("ODRL_TEACHER_TOKEN", token)
            err = _refused(capsys, "train", *_distill(student, tmp_path / f"run{i}", 2, urls))
            assert f"odrl: {message}" in err, err
        monkeypatch.delenv("ODRL_TEACHER_TOKEN", raising=False)
        run = tmp_path / "run"  # the only teacher is killed after step 2 of 50
        watcher = _kill_after_step(first, run, 2)
        overrides = _distill(
            teacher_dir, run, 50, [first.url], "train.checkpoint_every=1", "teacher.timeout_s=5"
        )
        done = _odrl("train", *overrides)
        watcher.join(timeout=10)
    _sentence(done, f"odrl: TeacherUnavailable: no teacher replica of 'policy' is left ({first.url}: ")
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert (run / "checkpoints" / latest / "tensors.safetensors").is_file()
