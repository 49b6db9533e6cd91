"""docs/ARCHITECTURE.md's layers (tests/layers.py defines them: tasks, driver, roles, bottom,
math), read from the code's own imports (every `import` and `from` statement, at module level or
inside a function, parsed with ast; nothing is imported or run).

The rules, each a list of violations "file:line: the import: the rule":
- actors/ and learner/ import only the bottom of ppo_ray and the math, never each other;
- the bottom imports no driver or top module and no role; it may import the math (the config
  takes the registries' names and parameters from it);
- the math imports only torch, the standard library and itself;
- the driver imports no top module, and only its hosts and stage tasks (ROLE_IMPORTERS) import the roles;
- launch.py imports no role (it reaches them through the driver, the registries through the config).
"""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

from layers import ROLE_IMPORTERS, ROLE_PACKAGES, layer_of_file, layer_of_module

ROOT = Path(__file__).resolve().parent.parent

# Imports the rules do not yet hold: none.
KNOWN: set[tuple[str, str]] = set()


def imports(path: Path, rel: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement in the file; `from X import Y`
    counts as X (and X.Y when Y is a submodule of a project package: `from ppo_ray import trainer`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
    package = rel.rsplit("/", 1)[0].replace("/", ".") if "/" in rel else ""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the file's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((node.lineno, module))
            if module in ("ppo_ray", *ROLE_PACKAGES, "ppo_ray.tasks"):
                out += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return out


def rule_broken(rel: str, module: str) -> str | None:
    """The rule an import of `module` from file `rel` breaks, or None."""
    here, there = layer_of_file(rel), layer_of_module(module)
    if here == "math":
        if there == "math" or (there is None and module.split(".")[0] in ("torch", *sys.stdlib_module_names)):
            return None
        return "the PPO math imports only torch, the standard library and itself"
    if there in (None, "math"):
        return None
    if here in ROLE_PACKAGES:
        if there in ROLE_PACKAGES and there != here:
            return "actors/ and learner/ never import each other"
        if there in ("driver", "top"):
            return f"{here}/ imports only the bottom of ppo_ray, no {there} module"
    elif here == "bottom":
        if there != "bottom":
            return f"the bottom imports no {there} module"
    elif here == "driver":
        if there == "top":
            return "the driver imports no top module"
        if there in ROLE_PACKAGES and rel not in ROLE_IMPORTERS:
            return f"of the driver only {' and '.join(sorted(ROLE_IMPORTERS))} import actors/ and learner/"
    elif here == "top" and there in ROLE_PACKAGES and rel.startswith("launch"):
        return "launch.py reaches actors/ and learner/ through the driver"
    return None


def violations(root: Path) -> list[str]:
    """Every broken rule in the tree at `root`, as "file:line: import module: rule"."""
    files = [root / "launch.py", *sorted((root / "ppo_ray").rglob("*.py")),
             *[p for pkg in ROLE_PACKAGES for p in sorted((root / pkg).rglob("*.py"))]]
    out = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        for line, module in imports(path, rel):
            why = rule_broken(rel, module)
            if why and (rel, module) not in KNOWN:
                out.append(f"{rel}:{line}: import {module}: {why}")
    return out


def test_the_code_keeps_the_documented_layers():
    assert violations(ROOT) == []


def test_every_known_exception_is_still_needed():
    """An exception that the code no longer needs is removed from KNOWN (so it cannot hide a
    new import of the same module later)."""
    for rel, module in KNOWN:
        found = [m for _, m in imports(ROOT / rel, rel)]
        assert module in found and rule_broken(rel, module), (rel, module)


def test_a_planted_driver_import_in_the_learner_is_found(tmp_path):
    """The check is not vacuous: a copy of the tree with `from ppo_ray.driver.checkpoint import ...`
    planted in a learner module (inside a function too), and one learner module importing an
    actor, fails naming each file and line."""
    for name in ("launch.py", "ppo_ray", *ROLE_PACKAGES):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    buffer = tmp_path / "learner" / "buffer.py"
    lines = buffer.read_text().splitlines()
    lines.append("from ppo_ray.driver.checkpoint import CheckpointError")
    lines.append("def _planted():\n    from actors.generator import Generator\n    return Generator")
    buffer.write_text("\n".join(lines) + "\n")
    n = len(lines)
    found = violations(tmp_path)
    assert found == [
        f"learner/buffer.py:{n - 1}: import ppo_ray.driver.checkpoint: learner/ imports only the bottom of ppo_ray, "
        "no driver module",
        f"learner/buffer.py:{n + 1}: import actors.generator: actors/ and learner/ never import each other",
    ], found
    for name, planted in (("algos", "import numpy"), ("losses", "from learner.buffer import Experience")):
        math_file = tmp_path / "learner" / f"{name}.py"
        math_file.write_text(math_file.read_text() + f"\n{planted}\n")
        assert any(v.startswith(f"learner/{name}.py:") and "imports only torch" in v for v in violations(tmp_path))
    launch = tmp_path / "launch.py"
    launch.write_text(launch.read_text() + "\nfrom learner.algos import ADVANTAGE_ESTIMATORS\n")
    assert not any(v.startswith("launch.py:") for v in violations(tmp_path))  # the math is below everything
    launch.write_text(launch.read_text() + "\nfrom learner.learner import Learner\n")
    assert any(v.startswith("launch.py:") and "through the driver" in v for v in violations(tmp_path))
    # a role imported by a driver module that is not a host or a stage task
    creation = tmp_path / "ppo_ray" / "driver" / "creation.py"
    creation.write_text(creation.read_text() + "\nfrom actors.generator import Generator\n")
    assert any(v.startswith("ppo_ray/driver/creation.py:") and "of the driver only ppo_ray/driver/hosts.py and "
               "ppo_ray/driver/stage_tasks.py import actors/ and learner/" in v for v in violations(tmp_path))


def test_each_file_has_a_layer():
    """Every source file of the layered packages falls in exactly one layer (a new top-level
    package or file would have to be placed here first)."""
    layers = {layer_of_file(p.relative_to(ROOT).as_posix())
              for p in [ROOT / "launch.py", *(ROOT / "ppo_ray").rglob("*.py"), *(ROOT / "learner").rglob("*.py"),
                        *(ROOT / "actors").rglob("*.py")]}
    assert layers == {"top", "driver", "bottom", "actors", "learner", "math"}
