"""The checkpoint trust boundary (GitHub issue 24, the checkpoint items): a checkpoint names its model
and carries its tensors; it never chooses a server, a token, a file to read or a plug-in, and every
value read from it is checked. Each test states what a crafted checkpoint did before and does now."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from omni_diffusion_rl.checkpoint import (
    MANIFEST,
    MAX_JSON_DEPTH,
    MAX_LORA_RANK,
    MAX_SAMPLING_STEPS,
    CheckpointError,
    load_checkpoint,
    resolve_checkpoint,
)
from omni_diffusion_rl.cli import main
from omni_diffusion_rl.config import ConfigError, RewardConfig, load_config
from omni_diffusion_rl.evaluation.targets import evaluate_target, target_config
from omni_diffusion_rl.export import export_adapter
from omni_diffusion_rl.inference import load_policy
from omni_diffusion_rl.models import lora
from omni_diffusion_rl.models.tiny_av import TinyAVTransformer
from omni_diffusion_rl.trainers.trainer import Trainer

from .helpers import ENV, REPO, fast_overrides, odrl, tiny_model_dir

pytestmark = pytest.mark.usefixtures("single_thread")
DEEP = "[" * 200_000
"""What the attacker put into state.json: Python's recursion limit, reached while parsing."""


# ------------------------------------------------------------------------------------ helpers
def rehash(folder: Path) -> None:
    """Recompute the manifest's sizes and hashes, as a forger would (the manifest guards against
    damage, not against someone who edits the files)."""
    manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    for name in manifest["files"]:
        data = (folder / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")


def forge_file(folder: Path, name: str, data: bytes | str) -> Path:
    """`folder/name` replaced by `data`, the manifest rehashed."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    (folder / name).write_bytes(raw)
    rehash(folder)
    return folder


def forge_state(folder: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """state.json edited in place by `edit`, the manifest rehashed."""
    state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    edit(state)
    return forge_file(folder, "state.json", json.dumps(state))


def forge_tensors(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """tensors.safetensors edited in place by `edit`, the manifest rehashed."""
    tensors = load_file(str(folder / "tensors.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "tensors.safetensors"))
    rehash(folder)
    return folder


def copy_checkpoint(source: Path, into: Path) -> Path:
    return Path(shutil.copytree(resolve_checkpoint(source), into / "step_0000001"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model"))


def tiny_overrides(model_dir: Path, run: Path) -> list[str]:
    return [*fast_overrides(model_dir, run, 1), "train.eval_at_start_and_end=false"]


def saved_tiny_run(model_dir: Path, run: Path) -> Trainer:
    """A tiny run trained one step, which saved step 1 (adapters, optimizer moments, RNGs) into `run`."""
    trained = Trainer(load_config(None, tiny_overrides(model_dir, run)))
    trained.fit()
    return trained


@pytest.fixture(scope="module")
def trainer(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    """The tiny run that saved step 1; --resume loads into it."""
    return saved_tiny_run(model_dir, tmp_path_factory.mktemp("run"))


@pytest.fixture(autouse=True)
def keep_rng() -> Iterator[None]:
    """A successful --resume sets the global RNGs to the checkpoint's: give the other tests theirs back."""
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    yield
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])


@pytest.fixture()
def ckpt(trainer: Trainer, tmp_path: Path) -> Path:
    """A fresh copy of the tiny run's checkpoint (step_0000001) to forge."""
    return copy_checkpoint(trainer.output_dir / "checkpoints", tmp_path / "shared")


def sample_argv(ckpt: Path, tmp_path: Path) -> tuple[str, ...]:
    return (
        "sample",
        "--checkpoint",
        str(ckpt),
        "--prompt",
        "a red circle",
        "--output",
        str(tmp_path / "samples"),
    )


def written(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """`odrl ARGV` in this process: exit 2 and one sentence on stderr, no traceback; the sentence."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "odrl: CheckpointError" in err and "Traceback" not in err, err
    return err


# ------------------------------------------------------------------------------------ item 1
class Listener:
    """A TCP listener on 127.0.0.1 that records whatever connects to it."""

    def __init__(self) -> None:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen()
        self.socket.settimeout(0.2)
        self.port = self.socket.getsockname()[1]
        self.received: list[bytes] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.socket.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    self.received.append(conn.recv(65536) or b"(connected)")
                except OSError:
                    self.received.append(b"(connected)")

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        self.socket.close()


@pytest.fixture()
def listener() -> Iterator[Listener]:
    server = Listener()
    yield server
    server.close()


@pytest.mark.slow
def test_a_checkpoint_never_names_the_server_the_token_or_the_prompt_file_of_eval(
    ckpt: Path, tmp_path: Path, listener: Listener
) -> None:
    """Before: a checkpoint whose config set reward.url (a listener), reward.token_env=HF_TOKEN and
    data.eval_prompts=<a secret file> made `HF_TOKEN=... odrl eval CKPT` exit 0 after sending the
    listener `Authorization: Bearer <token>` and the file's lines as prompts. Now: eval takes the
    reward, data and eval sections from the user (here: the package's defaults); the listener gets
    no connection at all and neither the token nor the file shows anywhere."""
    secret = tmp_path / "secret.txt"
    secret.write_text("sk-the-secret-line-one\nsk-the-secret-line-two\n", encoding="utf-8")

    def plant(state: dict[str, Any]) -> None:
        state["config"]["reward"].update(
            {"url": f"http://127.0.0.1:{listener.port}", "token_env": "HF_TOKEN", "plugins": []}
        )
        state["config"]["data"]["eval_prompts"] = str(secret)

    forge_state(ckpt, plant)
    env = {**ENV, "HF_TOKEN": "hf_TOKEN_THAT_MUST_STAY_HERE", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        odrl("eval", str(ckpt), "data.eval_samples=8"),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert listener.received == []
    for text in (proc.stdout, proc.stderr):
        assert "hf_TOKEN_THAT_MUST_STAY_HERE" not in text and "sk-the-secret" not in text
    assert "tiny_world_judge" in proc.stdout  # the package's default evaluation ran
    # The notebook's evaluation cell goes through target_config: the same defaults.
    cfg = target_config(str(ckpt), None, ["data.eval_samples=8"])
    assert dataclasses.asdict(cfg.reward) == dataclasses.asdict(RewardConfig())
    assert cfg.data.eval_prompts == "builtin:tiny_world_heldout"


@pytest.mark.slow
def test_a_checkpoint_naming_etc_passwd_as_prompts_never_prints_it(ckpt: Path) -> None:
    """Before: data.eval_prompts=/etc/passwd in a checkpoint's config made `odrl eval CKPT` print a
    line of /etc/passwd on stderr. Now the file is never read: eval uses the held-out prompts of the
    user's config (the defaults here)."""
    passwd = Path("/etc/passwd")
    lines = [line for line in passwd.read_text(encoding="utf-8").splitlines() if line.strip()]
    forge_state(ckpt, lambda s: s["config"]["data"].update({"eval_prompts": str(passwd)}))
    proc = subprocess.run(
        odrl("eval", str(ckpt), "data.eval_samples=8"),
        cwd=REPO,
        env={**ENV, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    for line in lines:
        assert line not in proc.stdout and line not in proc.stderr


def test_plugins_and_sections_of_a_config_file_are_the_users(ckpt: Path, tmp_path: Path) -> None:
    """What a --config file sets (data, reward, eval, sampling) is used for a checkpoint; its model
    section is the checkpoint's; overrides go on top; without --config the checkpoint's sampling
    section (bounded) is kept."""
    config = tmp_path / "eval.yaml"
    config.write_text(
        "model: {lora_rank: 8}\ndata: {eval_samples: 12}\nsampling: {eval_num_steps: 2}\n", encoding="utf-8"
    )
    cfg = target_config(str(ckpt), str(config), ["eval.metrics=[]"])
    assert cfg.model.lora_rank == 4 and cfg.data.eval_samples == 12
    assert cfg.sampling.eval_num_steps == 2 and cfg.eval.metrics == []
    assert target_config(str(ckpt), None, []).sampling.eval_num_steps == 3  # the checkpoint's


# ------------------------------------------------------------------------------------ item 6
@pytest.fixture(scope="module")
def gspo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Trainer, Path]:
    """A GSPO run of a small omni model that saved step 1 with a perturbed adapter."""
    from .test_gspo_loop import gspo_overrides, omni_model_dir

    root = tmp_path_factory.mktemp("gspo")
    model = omni_model_dir(root / "omni")
    overrides = gspo_overrides(model, root / "run", 1, "train.eval_at_start_and_end=false")
    trained = Trainer(load_config(None, overrides))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in lora.adapter_parameters(trained.transformer, lora.TRAINED).values():
            param.add_(0.3 * torch.randn(param.shape, generator=gen))
    trained.step = 1
    trained.save()
    return trained, root / "run" / "checkpoints"


def test_eval_of_a_gspo_checkpoint_reports_what_the_trainer_logs(gspo_run: tuple[Trainer, Path]) -> None:
    """Before: `odrl eval runs/tiny_avqa_gspo/checkpoints` failed with AttributeError: 'TinyOmniPolicy'
    object has no attribute 'latent_shape'. Now it reports the held-out exact-answer accuracy and
    reward of the trainer's own evaluation, equal to it, with tiny AVQA's held-out questions and
    answer rewards as the defaults of an answering model."""
    trained, checkpoints = gspo_run
    cfg = target_config(str(checkpoints), None, ["data.eval_samples=80", "algorithm.max_new_tokens=6"])
    assert cfg.data.eval_prompts == "builtin:tiny_avqa_heldout" and cfg.eval.metrics == []
    result = evaluate_target(str(checkpoints), cfg)
    assert result == pytest.approx(trained.heldout.evaluate())
    assert {"accuracy/greedy", "accuracy/sampled", "accuracy/greedy/color", "reward"} <= set(result)


def test_odrl_eval_of_a_gspo_base_and_checkpoint_on_the_command_line(
    gspo_run: tuple[Trainer, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: `odrl eval base --config recipes/configs/tiny_avqa_gspo.yaml` crashed like the
    checkpoint did. Now both are evaluated side by side (here with a small omni base)."""
    trained, checkpoints = gspo_run
    config = tmp_path / "gspo.yaml"
    model = trained.cfg.model
    config.write_text(
        f"model: {{family: tiny_omni, pretrained: '{model.pretrained}', lora_rank: 4, lora_alpha: 8}}\n"
        "algorithm: {name: gspo, max_new_tokens: 6}\n"
        "data: {eval_prompts: 'builtin:tiny_avqa_heldout', eval_samples: 80}\n"
        "reward: {weights: {avqa_exact: 1.0, answer_format: 0.5}}\n"
        "eval: {metrics: []}\n",
        encoding="utf-8",
    )
    assert main(["eval", "base", str(checkpoints), "--config", str(config)]) == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(results) == {"base", str(checkpoints)}
    for values in results.values():
        assert 0.0 <= values["accuracy/greedy"] <= 1.0 and "reward" in values
    with pytest.raises(ConfigError, match="an answering model is scored by its exact answers"):
        evaluate_target("base", target_config("base", str(config), ["eval.metrics=[color_match]"]))


# ------------------------------------------------------------------------------------ item 7
CRAFTED_MODEL = [
    ("lora_rank", "abc", "model.lora_rank: expected an integer"),
    ("lora_rank", 10**7, f"model.lora_rank: 10000000 is out of range; it must be <= {MAX_LORA_RANK}"),
    ("pretrained", "/etc/passwd", "a checkpoint's base must be a builtin model, a model directory"),
    ("pretrained", "http://127.0.0.1:1/x", "a checkpoint's base must be"),
    ("options", {"height": 10**12}, "model.options.height"),
]


@pytest.mark.parametrize(("key", "value", "message"), CRAFTED_MODEL)
def test_crafted_model_values_are_refused_by_sample_export_and_eval(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, value: Any, message: str
) -> None:
    """Before: model.lora_rank "abc" was a TypeError and 10**7 tried to allocate terabytes in
    `odrl sample` and `odrl export`. Now each is a CheckpointError naming the value (exit 2)."""
    forge_state(ckpt, lambda s: s["config"]["model"].update({key: value}))
    for argv in (
        sample_argv(ckpt, tmp_path),
        ("export", str(ckpt), str(tmp_path / "out")),
        ("eval", str(ckpt), "data.eval_samples=4"),
    ):
        assert message in refused(capsys, *argv)
    assert not written(tmp_path / "samples") and not (tmp_path / "out").exists()


def test_adapters_that_sample_nothing_finite_are_a_sentence_and_nothing_is_saved(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: adapters scaled by 1e30 sampled black frames (NaN saved as 0) and exit 0."""
    forge_tensors(
        ckpt, lambda tensors: tensors.update({k: v * 1e30 for k, v in tensors.items() if "lora" in k})
    )
    assert main(list(sample_argv(ckpt, tmp_path))) == 2
    err = capsys.readouterr().err
    assert "odrl: NonFiniteSamples: 1 of 1 samples came out with values that are not finite" in err, err
    assert "Traceback" not in err and not written(tmp_path / "samples")


def test_more_sampler_steps_than_can_run_are_refused(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: sampling.eval_num_steps=10**12 in a checkpoint tried to allocate terabytes. Now every
    command that reads the checkpoint refuses it with the cap."""
    forge_state(ckpt, lambda s: s["config"]["sampling"].update({"eval_num_steps": 10**12}))
    assert f"it must be <= {MAX_SAMPLING_STEPS}" in refused(capsys, "eval", str(ckpt))
    with pytest.raises(CheckpointError, match="sampling.eval_num_steps"):
        load_policy(ckpt)


@pytest.mark.parametrize("name", ["state.json", "manifest.json"])
def test_deeply_nested_json_is_a_sentence_not_a_recursion_error(
    ckpt: Path, trainer: Trainer, capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str
) -> None:
    """Before: 200,000 nested `[` in state.json was a RecursionError in sample, eval and export (and
    --resume). Now the nesting is measured before parsing: a CheckpointError naming the bound."""
    if name == "manifest.json":
        (ckpt / name).write_text(DEEP, encoding="utf-8")
    else:
        forge_file(ckpt, name, DEEP)
    message = f"more than {MAX_JSON_DEPTH} deep"
    assert message in refused(capsys, *sample_argv(ckpt, tmp_path))
    assert message in refused(capsys, "export", str(ckpt), str(tmp_path / "out"))
    assert message in refused(capsys, "eval", str(ckpt))
    with pytest.raises(CheckpointError, match=message):
        trainer.load(ckpt)


def _set_numpy_dtype(tree: Any, dtype: str) -> None:
    if isinstance(tree, dict):
        if "__ndarray__" in tree:
            tree["dtype"] = dtype
        for value in tree.values():
            _set_numpy_dtype(value, dtype)
    elif isinstance(tree, list):
        for value in tree:
            _set_numpy_dtype(value, dtype)


RESUME_FORGERIES: list[tuple[str, Callable[[Path], object], str]] = [
    ("step abc", lambda c: forge_state(c, lambda s: s.update(step="abc")), "step is 'abc'"),
    ("no step", lambda c: forge_state(c, lambda s: s.pop("step")), "records no step"),
    ("negative step", lambda c: forge_state(c, lambda s: s.update(step=-3)), "from 0 to"),
    ("counts list", lambda c: forge_state(c, lambda s: s.update(sample_counts=[1, 2])), "sample_counts"),
    ("count text", lambda c: forge_state(c, lambda s: s.update(sample_counts={"trained": "x"})), "trained"),
    ("eval_before", lambda c: forge_state(c, lambda s: s.update(eval_before={"r": [1]})), "eval_before.r"),
    ("run id", lambda c: forge_state(c, lambda s: s.update(wandb_run_id="../x")), "wandb_run_id"),
    ("seconds text", lambda c: forge_state(c, lambda s: s.update(train_seconds="1e3")), "train_seconds"),
    ("negative seconds", lambda c: forge_state(c, lambda s: s.update(train_seconds=-1.0)), "train_seconds"),
    ("seconds too many", lambda c: forge_state(c, lambda s: s.update(train_seconds=1e12)), "train_seconds"),
    ("execution", lambda c: forge_state(c, lambda s: s.update(execution={"buffer": 1})), "execution"),
    ("deep training state", lambda c: forge_file(c, "training_state.json", DEEP), "deep"),
    (
        "unknown dtype",
        lambda c: forge_file(
            c,
            "training_state.json",
            json.dumps(_with(json.loads((c / "training_state.json").read_text()), "<x9")),
        ),
        "malformed training state",
    ),
]


def _with(tree: Any, dtype: str) -> Any:
    _set_numpy_dtype(tree, dtype)
    return tree


@pytest.mark.parametrize(
    ("forge", "message"), [(f, m) for _, f, m in RESUME_FORGERIES], ids=[n for n, _, _ in RESUME_FORGERIES]
)
def test_crafted_resume_state_is_refused_before_anything_is_applied(
    ckpt: Path, trainer: Trainer, forge: Callable[[Path], object], message: str
) -> None:
    """Before (--resume): step "abc" was a ValueError, a missing step a KeyError, sample_counts as a
    list a TypeError, an unknown numpy dtype in the training state a TypeError, deep nesting a
    RecursionError. Now each is a CheckpointError that names the field, and the run is unchanged."""
    step, counts = trainer.step, dict(trainer.sample_counts)
    rng = torch.get_rng_state()
    forge(ckpt)
    with pytest.raises(CheckpointError, match=message):
        trainer.load(ckpt)
    assert trainer.step == step and trainer.sample_counts == counts
    assert torch.equal(torch.get_rng_state(), rng)


def test_training_seconds_carry_across_a_resume(ckpt: Path, trainer: Trainer) -> None:
    """A resumed run's eval/train_seconds go on from the checkpoint's (they restarted at 0), and a
    checkpoint written before they were kept resumes from 0."""
    state = json.loads((ckpt / "state.json").read_text(encoding="utf-8"))
    assert state["train_seconds"] == trainer.trained_s > 0
    trainer.load(forge_state(ckpt, lambda s: s.update(train_seconds=1234)))
    assert trainer.trained_s == trainer.trained_s_before == 1234.0
    trainer.load(forge_state(ckpt, lambda s: s.pop("train_seconds")))
    assert trainer.trained_s == 0.0


def test_an_untouched_checkpoint_still_resumes(ckpt: Path, trainer: Trainer) -> None:
    trainer.load(ckpt)
    assert trainer.step == 1


@pytest.mark.slow
def test_odrl_train_turns_a_resume_refusal_into_exit_2(ckpt: Path, model_dir: Path, tmp_path: Path) -> None:
    """The refusal reaches the command line as one sentence and exit status 2 (cli.main)."""
    forge_state(ckpt, lambda s: s.update(step="abc"))
    overrides = [o for o in tiny_overrides(model_dir, tmp_path / "again") if not o.startswith("train.steps")]
    proc = subprocess.run(
        odrl("train", "--resume", str(ckpt), *overrides, "train.steps=2"),
        cwd=tmp_path,
        env={**ENV, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "odrl: CheckpointError" in proc.stderr and "step is 'abc'" in proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------ item 8
def _retype(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    for key in tensors:
        tensors[key] = (tensors[key] * 100).to(dtype)


WRONG_TENSORS: list[tuple[str, Callable[[dict[str, torch.Tensor]], None], str]] = [
    ("int32", lambda t: _retype(t, torch.int32), "not a floating tensor"),
    ("bool", lambda t: _retype(t, torch.bool), "not a floating tensor"),
    (
        "nan",
        lambda t: t.update({k: torch.full_like(v, float("nan")) for k, v in t.items()}),
        "NaN or infinite",
    ),
    (
        "fp64 overflow",
        lambda t: t.update({k: torch.full(v.shape, 1e300, dtype=torch.float64) for k, v in t.items()}),
        "NaN",
    ),
    ("extra", lambda t: t.update({"extra/unknown": torch.zeros(2)}), "unknown tensor 'extra/unknown'"),
    (
        "extra in adapter",
        lambda t: t.update({"default/x.lora_A.default.weight": torch.zeros(2)}),
        "unexpected",
    ),
    ("missing", lambda t: t.pop(sorted(t)[0]), "missing"),
    ("shape", lambda t: t.update({k: v[:1] for k, v in list(t.items())[:1]}), "shape"),
]


@pytest.mark.parametrize(
    ("edit", "message"), [(e, m) for _, e, m in WRONG_TENSORS], ids=[n for n, _, _ in WRONG_TENSORS]
)
def test_wrong_adapter_tensors_are_refused_everywhere(
    ckpt: Path,
    trainer: Trainer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    edit: Callable[[dict[str, torch.Tensor]], None],
    message: str,
) -> None:
    """Before: int32 adapters were loaded (eval reported flooded: 1.0), all-NaN adapters were
    exported as they were, an extra unknown tensor was ignored. Now sample, eval, export and
    --resume refuse them by name, before any adapter is changed."""
    forge_tensors(ckpt, edit)
    before = {k: v.clone() for k, v in lora.nft_adapter_tensors(trainer.transformer).items()}
    assert message in refused(capsys, *sample_argv(ckpt, tmp_path))
    assert message in refused(capsys, "eval", str(ckpt), "data.eval_samples=4")
    assert message in refused(capsys, "export", str(ckpt), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match=message):
        trainer.load(ckpt)
    after = lora.nft_adapter_tensors(trainer.transformer)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_half_precision_adapters_are_cast_and_loaded(ckpt: Path) -> None:
    """A floating dtype that casts safely to the parameters' (here bf16 -> fp32) still loads."""
    forge_tensors(ckpt, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    policy = load_policy(ckpt)
    saved = load_file(str(ckpt / "tensors.safetensors"))
    params = lora.adapter_parameters(policy.transformer, lora.TRAINED)
    key = sorted(params)[0]
    assert torch.equal(params[key], saved[f"{lora.TRAINED}/{key}"].float())


def test_export_makes_the_fingerprint_check_of_sample_and_eval(ckpt: Path, tmp_path: Path) -> None:
    """Before: `odrl export` rebuilt the base and exported without comparing fingerprints, so a
    checkpoint exported onto a base that had changed under its model.pretrained. Now it refuses
    like `odrl sample` and `odrl eval` do."""
    model = tmp_path / "model"
    tiny_model_dir(model)
    forge_state(ckpt, lambda s: s["config"]["model"].update({"pretrained": str(model)}))
    shutil.rmtree(model)
    torch.manual_seed(1)
    TinyAVTransformer(dim=48, depth=1, heads=2, mlp_ratio=2).save_pretrained(model)
    message = "trained on another base model than the one at model.pretrained"
    with pytest.raises(CheckpointError, match=message):
        export_adapter(ckpt, tmp_path / "out")
    with pytest.raises(CheckpointError, match=message):
        load_policy(ckpt)
    assert not (tmp_path / "out").exists()


def test_an_untouched_checkpoint_still_samples_evaluates_and_exports(ckpt: Path, tmp_path: Path) -> None:
    assert load_checkpoint(ckpt, objects=False)[2]["step"] == 1
    policy = load_policy(ckpt)
    assert policy.latent_shape
    assert export_adapter(ckpt, tmp_path / "out").is_dir()
    result = evaluate_target(str(ckpt), target_config(str(ckpt), None, ["data.eval_samples=4"]))
    assert 0.0 <= result["reward"] <= 1.0


def test_the_separate_modes_buffer_section_passes_its_check(tmp_path: Path) -> None:
    """check_execution_state accepts what the separate and hybrid modes write (a replay buffer that
    trained, dropped and still holds groups, through JSON) and refuses it edited."""
    from omni_diffusion_rl.buffer import Group, ReplayBuffer
    from omni_diffusion_rl.checkpoint import check_execution_state

    buffer: ReplayBuffer[None] = ReplayBuffer(capacity=8, max_staleness=1)
    for i in range(4):
        buffer.put(Group(group_id=i, version=0, size=2))
    batch = buffer.take(2, trainer_version=1)
    assert batch is not None
    buffer.mark_trained(batch[:1], trainer_version=1)
    buffer.drop(batch[1:], "reward_failed")
    section = {"buffer": buffer.state_dict(), "stream_next": 4, "lent_made": 0, "lent_trained": 0}
    state = json.loads(json.dumps({"execution": section}))
    check_execution_state(state, tmp_path)
    ReplayBuffer(capacity=8).load_state_dict(state["execution"]["buffer"])
    state["execution"]["buffer"]["waiting"] = [[0, 0, "two"]]
    with pytest.raises(CheckpointError, match=r"execution.buffer.waiting\[0\]"):
        check_execution_state(state, tmp_path)
