"""The package's import graph: no circle, and no module imports a layer above its own.

Every module under omni_diffusion_rl/ is parsed with `ast` (nothing is imported). Every `import` and
`from ... import` counts, at module level or inside a function or class: a lazy import ties two
modules together as much as an eager one. Relative imports are resolved to module names. Importing
`a.b.c` also runs the packages `a.b` and `a`, so those count too (except the importer's own packages,
which are already running). Imports under `if TYPE_CHECKING:` are left out: they never execute (they
only name types for a type checker), so they can neither close a circle nor pull a layer in at run
time. Dynamic imports (`importlib.import_module("...")`) are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "omni_diffusion_rl"
PACKAGE_DIR = Path(__file__).resolve().parent.parent / PACKAGE

# Lowest first. A module belongs to the layer of its longest matching prefix: a prefix matches the
# module of that name and the modules under it; one ending in "*" matches every module name starting
# with what comes before the "*". A module may import modules of its own layer and of lower ones only.
LAYERS: list[list[str]] = [
    # foundations: configs, processes, registries, media, the tiny clip format, samplers, pure maths
    # and utilities (the experience and world packages' __init__ import nothing)
    [
        f"{PACKAGE}.config",
        f"{PACKAGE}.config_fields",
        f"{PACKAGE}.config_yaml",
        f"{PACKAGE}.config_checks",
        f"{PACKAGE}.algorithm_options",
        f"{PACKAGE}.runtime",
        f"{PACKAGE}.async_layout",
        f"{PACKAGE}.registry",
        f"{PACKAGE}.media",
        f"{PACKAGE}.sync_metrics",
        f"{PACKAGE}.answer_data",
        f"{PACKAGE}.world",
        f"{PACKAGE}.experience",
        f"{PACKAGE}.algorithms",
        f"{PACKAGE}.state_codec",
        f"{PACKAGE}.named_batch",
        f"{PACKAGE}.precision",
        f"{PACKAGE}.teacher",
        f"{PACKAGE}.checkpoint",
        f"{PACKAGE}.bounded_json",
        f"{PACKAGE}.run_dir",
        f"{PACKAGE}.tracking",
    ],
    # the generators, and the synthetic world (its data and its judge); see SEPARATE
    [
        f"{PACKAGE}.models",
        f"{PACKAGE}.world.tiny_world",
        f"{PACKAGE}.world.avqa",
        f"{PACKAGE}.world.avqa_files",
        f"{PACKAGE}.world.judge",
        f"{PACKAGE}.world.sync_judge",
        f"{PACKAGE}.world.adversarial",
        f"{PACKAGE}.world.sync_adversarial",
    ],
    # rewards, the reward server and its client, the combined reward of a config, prompt sources
    [f"{PACKAGE}.reward", f"{PACKAGE}.serving", f"{PACKAGE}.reward_factory", f"{PACKAGE}.prompts"],
    # what a run needs, checked before it starts (odrl train CONFIG --check)
    [f"{PACKAGE}.preflight"],
    # generating and scoring batches, evaluation
    [
        f"{PACKAGE}.experience.rollout",
        f"{PACKAGE}.experience.guidance",
        f"{PACKAGE}.experience.text_rollout",
        f"{PACKAGE}.experience.teacher_targets",
        f"{PACKAGE}.experience.answer_backends",
        f"{PACKAGE}.evaluation",
        f"{PACKAGE}.inference",
    ],
    # training, the execution modes and their replay buffer, and the tools built on trained runs
    [
        f"{PACKAGE}.trainers",
        f"{PACKAGE}.world.pretrain",
        f"{PACKAGE}.world.pretrain_omni",
        f"{PACKAGE}.world.pretrain_sync",
        f"{PACKAGE}.execution",
        f"{PACKAGE}.buffer",
        f"{PACKAGE}.export",
        f"{PACKAGE}.notebook_runner",
    ],
    # entry points: the command line and the benchmarks (bench*.py, moving to benchmarks/)
    [f"{PACKAGE}.cli", f"{PACKAGE}.bench*", f"{PACKAGE}.benchmarks"],
]

# Pairs of prefixes that must not import each other: the tiny model decodes into the clip format
# (world.tiny_clip) and knows nothing of the world that renders clips in it, and the other way.
WORLD_DATA = ("tiny_world", "tiny_sync", "sync_judge", "avqa", "judge", "adversarial", "sync_adversarial")
SEPARATE: list[tuple[str, str]] = [(f"{PACKAGE}.models", f"{PACKAGE}.world.{m}") for m in WORLD_DATA]


def module_files() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its __init__.py)."""
    files: dict[str, Path] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def executed_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """All import statements of a module, nested ones included, except those under TYPE_CHECKING."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))
    return found


def _known_module(name: str, known: set[str]) -> str | None:
    """The longest module of `known` that `name` is or lies in, or None outside the package."""
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return None
    parts = name.split(".")
    while parts:
        if ".".join(parts) in known:
            return ".".join(parts)
        parts.pop()
    return None


def _ancestors(module: str) -> set[str]:
    """The packages a module lies in: a.b.c -> {a.b, a}."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def imported_modules(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that running `module` (whose code is `source`) imports."""
    names: list[str] = []
    for node in executed_imports(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
            continue
        base = node.module or ""
        if node.level:
            package = module if is_package else module.rpartition(".")[0]
            parts = package.split(".")
            assert node.level - 1 < len(parts), f"{module}: relative import beyond the top package"
            anchor = ".".join(parts[: len(parts) - (node.level - 1)])
            base = f"{anchor}.{base}" if base else anchor
        names.append(base)  # `from X import y` runs X, and X.y when y is a module
        names += [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
    targets: set[str] = set()
    for name in names:
        target = _known_module(name, known)
        if target is not None:
            targets |= {target} | (_ancestors(target) & known)
    return targets - _ancestors(module) - {module}


def import_graph() -> dict[str, set[str]]:
    """{module: the package modules it imports}."""
    files = module_files()
    known = set(files)
    return {
        module: imported_modules(path.read_text(encoding="utf-8"), module, path.name == "__init__.py", known)
        for module, path in files.items()
    }


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a -> ... -> a) per back edge of a depth-first search; empty when there is none."""
    state: dict[str, str] = {}
    path: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def _matches(prefix: str, module: str) -> bool:
    if prefix.endswith("*"):
        return module.startswith(prefix[:-1])
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the module's longest matching prefix, or None when none matches."""
    matches = [(len(p), i) for i, prefixes in enumerate(LAYERS) for p in prefixes if _matches(p, module)]
    return max(matches)[1] if matches else None


def _describe(layer: int) -> str:
    return f"layer {layer} ({', '.join(p.removeprefix(PACKAGE + '.') for p in LAYERS[layer][:3])}, ...)"


def test_the_import_graph_has_no_circle() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles (lazy imports count):\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(m for m in module_files() if m != PACKAGE and layer_of(m) is None)
    assert not unplaced, (
        f"modules in no layer: {', '.join(unplaced)}. Place each in LAYERS in {Path(__file__).name} "
        "(in the lowest layer whose modules are all it imports)"
    )


def test_no_module_imports_a_higher_layer() -> None:
    upward = []
    for module, targets in sorted(import_graph().items()):
        own = layer_of(module)
        for target in sorted(targets):
            theirs = layer_of(target)
            if own is not None and theirs is not None and theirs > own:
                upward.append(f"{module} ({_describe(own)}) imports {target} ({_describe(theirs)})")
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_separate_packages_do_not_import_each_other() -> None:
    crossing = [
        f"{module} imports {target}"
        for module, targets in sorted(import_graph().items())
        for target in sorted(targets)
        for a, b in SEPARATE
        if (_matches(a, module) and _matches(b, target)) or (_matches(b, module) and _matches(a, target))
    ]
    assert not crossing, "\n".join(crossing)


def test_execution_modes_import_no_algorithm() -> None:
    """Execution modes decide who does what; what is learned (the algorithms, their math, the
    two-adapter LoRA layout they keep their rollout weights in) stays behind the Algorithm seam."""
    trainers = ("skeleton", "algorithms", "nft", "distill", "raft", "flow_grpo", "awm", "gspo")
    algorithm_modules = (
        *(f"{PACKAGE}.trainers.{name}" for name in trainers),
        f"{PACKAGE}.algorithms",
        f"{PACKAGE}.models.lora",
    )
    graph = import_graph()
    found = {
        module: sorted(m for m in imports if any(_matches(a, m) for a in algorithm_modules))
        for module, imports in graph.items()
        if _matches(f"{PACKAGE}.execution", module)
    }
    assert found and not any(found.values()), {m: i for m, i in found.items() if i}


def test_the_config_imports_no_algorithm() -> None:
    """Each algorithm owns its options and their checks (issue 25): config.py builds the algorithm
    section from what the registered algorithm declares, and imports none of them or their math."""
    algorithm_modules = (f"{PACKAGE}.trainers", f"{PACKAGE}.algorithms", f"{PACKAGE}.models")
    imports = import_graph()[f"{PACKAGE}.config"]
    found = sorted(m for m in imports if any(_matches(a, m) for a in algorithm_modules))
    assert not found, found


def test_models_import_no_algorithm_and_no_trainer() -> None:
    """A model computes what it is asked (velocities, log-probs); the losses and the loop that use
    them sit above it (issue 25)."""
    above = (f"{PACKAGE}.algorithms", f"{PACKAGE}.trainers")
    found = {
        module: sorted(m for m in imports if any(_matches(a, m) for a in above))
        for module, imports in import_graph().items()
        if _matches(f"{PACKAGE}.models", module)
    }
    assert found and not any(found.values()), {m: i for m, i in found.items() if i}


def test_the_loop_and_the_execution_modes_import_no_demo_world() -> None:
    """The tiny world and tiny AVQA are plug-ins of the loop, like a user's: the trainer and the
    execution modes reach them only through registries (a family's held-out evaluation, its preview
    reference), never by import (issue 25)."""
    demo = (f"{PACKAGE}.world", f"{PACKAGE}.evaluation.avqa")
    found = {
        module: sorted(m for m in imports if any(_matches(d, m) for d in demo))
        for module, imports in import_graph().items()
        if _matches(f"{PACKAGE}.trainers", module) or _matches(f"{PACKAGE}.execution", module)
    }
    assert found and not any(found.values()), {m: i for m, i in found.items() if i}


def test_the_loop_and_the_execution_modes_never_ask_what_they_learn_from() -> None:
    """Media or answers is decided once, in trainers/experience_kinds.py: no other module of the loop
    or the execution modes branches on it, names the demo worlds, or imports the answer rollouts
    (issue 27)."""
    kinds = f"{PACKAGE}.trainers.experience_kinds"
    loop = [
        m
        for m in import_graph()
        if (_matches(f"{PACKAGE}.trainers", m) or _matches(f"{PACKAGE}.execution", m)) and m != kinds
    ]
    answers = (f"{PACKAGE}.experience.text_rollout", f"{PACKAGE}.evaluation.avqa")
    graph = import_graph()
    importers = {m: sorted(i for i in graph[m] if any(_matches(a, i) for a in answers)) for m in loop}
    assert loop and not any(importers.values()), {m: i for m, i in importers.items() if i}
    words = ("is_answering", "avqa", "tiny_world")
    for module in [*loop, kinds]:
        path = PACKAGE_DIR.parent / (module.replace(".", "/") + ".py")
        if not path.exists():
            path = path.with_suffix("") / "__init__.py"
        text = path.read_text().lower()
        assert not [w for w in words if w in text], f"{module} names {[w for w in words if w in text]}"


def test_the_package_root_imports_nothing_of_the_package() -> None:
    """Importing any module runs omni_diffusion_rl/__init__.py first: whatever it imported would sit
    below every module."""
    assert import_graph()[PACKAGE] == set()


def test_every_layer_prefix_is_used_once_and_names_a_module() -> None:
    prefixes = [p for layer in LAYERS for p in layer]
    assert len(prefixes) == len(set(prefixes)), "a prefix is in LAYERS twice"
    modules = module_files()
    stale = [p for p in prefixes if not p.endswith("*") and not any(_matches(p, m) for m in modules)]
    assert not stale, f"LAYERS names modules that do not exist (moved or removed?): {stale}"


def test_the_parser_counts_lazy_and_relative_imports_but_not_type_checking_ones() -> None:
    known = {
        PACKAGE,
        f"{PACKAGE}.a",
        f"{PACKAGE}.sub",
        f"{PACKAGE}.sub.b",
        f"{PACKAGE}.sub.c",
        f"{PACKAGE}.d",
    }
    source = (
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "from . import c\n"
        "from ..a import thing\n"
        "if TYPE_CHECKING:\n"
        f"    from {PACKAGE}.d import Type\n"
        "def f():\n"
        "    from .. import d\n"
    )
    imported = imported_modules(source, f"{PACKAGE}.sub.b", False, known)
    assert imported == {f"{PACKAGE}.sub.c", f"{PACKAGE}.a", f"{PACKAGE}.d"}
    hidden = imported_modules(
        source.replace("    from .. import d\n", "    pass\n"), f"{PACKAGE}.sub.b", False, known
    )
    assert f"{PACKAGE}.d" not in hidden
    assert find_cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}}) == [["x", "y", "z", "x"]]
    assert find_cycles({"x": {"y"}, "y": set()}) == []


def test_answer_rollouts_and_their_evaluation_ask_questions_through_plug_ins() -> None:
    """Tiny AVQA is a registered question set like a user's (registry.question_sets): the answer
    rollouts and the answering evaluation import no part of the tiny world (issue 27)."""
    graph = import_graph()
    users = (f"{PACKAGE}.experience.text_rollout", f"{PACKAGE}.evaluation.avqa")
    worlds = {u: sorted(i for i in graph[u] if _matches(f"{PACKAGE}.world", i)) for u in users}
    assert not any(worlds.values()), worlds
