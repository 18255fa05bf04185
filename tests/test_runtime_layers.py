"""Layers that hold at run time, not only in the source text (tests/test_import_graph.py): loading a
config imports no trainer, model or peft; `odrl serve-reward --help` imports no algorithm; the
built-in algorithms' cards (algorithm_options.py) say what their classes say; algorithm files are
named in algorithm.plugins, and reward.plugins still takes them for this release with a warning."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from omni_diffusion_rl.algorithm_options import BUILTIN_CARDS, card_of_class
from omni_diffusion_rl.registry import algorithms

from .helpers import ENV, REPO

HEAVY = ("omni_diffusion_rl.trainers", "omni_diffusion_rl.models", "peft", "torch.distributed.tensor")
ALGORITHMS = ("omni_diffusion_rl.trainers", "omni_diffusion_rl.algorithms.", "peft")


def loaded_in_a_fresh_process(code: str) -> dict:
    """Run `code` in a new interpreter (nothing imported yet); it prints one JSON line."""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_loading_every_recipe_imports_no_trainer_model_or_peft() -> None:
    found = loaded_in_a_fresh_process(
        "import glob, json, sys\n"
        "from omni_diffusion_rl.config import load_config\n"
        "recipes = sorted(glob.glob('recipes/configs/*.yaml'))\n"
        "names = [load_config(r).algorithm.name for r in recipes]\n"
        f"heavy = sorted(m for m in sys.modules if m.startswith({HEAVY!r}))\n"
        "print(json.dumps({'recipes': len(recipes), 'names': sorted(set(names)), 'heavy': heavy}))\n"
    )
    assert found["recipes"] >= 10 and {"nft", "flow_grpo", "awm", "distill", "gspo"} <= set(found["names"])
    assert found["heavy"] == []


@pytest.mark.slow
def test_the_reward_servers_help_imports_no_algorithm() -> None:
    found = loaded_in_a_fresh_process(
        "import contextlib, io, json, sys\n"
        "from omni_diffusion_rl.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try:\n"
        "        main(['serve-reward', '--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"names = sorted(m for m in sys.modules if m.startswith({ALGORITHMS!r}))\n"
        "print(json.dumps({'help': out.getvalue()[:200], 'algorithms': names}))\n"
    )
    assert "serve-reward" in found["help"] and found["algorithms"] == []


@pytest.mark.parametrize("name", sorted(BUILTIN_CARDS))
def test_each_built_in_card_says_what_its_class_says(name: str) -> None:
    card, of_class = BUILTIN_CARDS[name], card_of_class(algorithms.get(name))
    assert card.options_type is of_class.options_type is not None
    assert (card.display_name, card.uses_teacher) == (of_class.display_name, of_class.uses_teacher)


@pytest.mark.slow
def test_an_algorithm_file_loads_from_algorithm_plugins_and_from_reward_plugins_with_a_warning() -> None:
    example = "examples/advantage_weighted_fm.py"
    found = loaded_in_a_fresh_process(
        "import json, warnings\n"
        "from omni_diffusion_rl.config import load_config\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        f"    new = load_config(None, ['algorithm.plugins=[{example}]', 'algorithm.name=awfm'])\n"
        "new_warned = [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]\n"
        "print(json.dumps({'name': new.algorithm.name, 'temperature': new.algorithm.awfm_temperature,\n"
        "                  'warned': new_warned}))\n"
    )
    assert found == {"name": "awfm", "temperature": 1.0, "warned": []}
    old = loaded_in_a_fresh_process(
        "import json, warnings\n"
        "from omni_diffusion_rl.config import load_config\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        f"    cfg = load_config(None, ['reward.plugins=[{example}]', 'algorithm.name=awfm'])\n"
        "warned = [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]\n"
        "print(json.dumps({'name': cfg.algorithm.name, 'warned': warned}))\n"
    )
    assert old["name"] == "awfm" and len(old["warned"]) == 1
    assert "algorithm.plugins" in old["warned"][0] and "awfm" in old["warned"][0]
