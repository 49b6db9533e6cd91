"""docs/ARCHITECTURE.md's module map (its first code block) is true to the code: its layer
headings are tests/layers.py's, in that order; every Python module of ppo_ray/, actors/ and
learner/ is listed by its path (a package's __init__.py by the package's path, `ppo_ray/config/`),
once, with its purpose, under its own layer; every path listed names a module that exists.
Text and paths only: nothing of the product is imported.

The map's lines: a layer heading starts with the layer's name (`tasks (top)   what ...`), an
entry with its path (`ppo_ray/deadlines.py   the deadline rule ...`), and a description's
continuation is indented.
"""

from __future__ import annotations

from pathlib import Path

from layers import LAYERS, layer_name

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = ("ppo_ray", "actors", "learner")


def module_map(text: str) -> tuple[list[str], list[tuple[str, str, bool]]]:
    """The map's layer headings in order, and its entries: (heading above it, path, whether a
    purpose follows the path on its line)."""
    block = text.split("```")[1]
    headings: list[str] = []
    entries: list[tuple[str, str, bool]] = []
    for line in block.splitlines():
        if not line.strip() or line[0].isspace():
            continue  # a blank line, or a description's continuation
        first, *rest = line.split()
        if "/" in first or first.endswith(".py"):
            entries.append((headings[-1] if headings else "", first, bool(rest)))
        else:
            headings.append(first)
    return headings, entries


def modules(root: Path) -> list[str]:
    """Every module's path under the layered packages; a package's __init__.py as the package's."""
    return [p.relative_to(root).as_posix().removesuffix("__init__.py")
            for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))]


def source_file(root: Path, path: str) -> str | None:
    """The source file a listed path names (a package's __init__.py), None when there is none."""
    rel = path + "__init__.py" if path.endswith("/") else path
    return rel if rel.endswith(".py") and (root / rel).is_file() else None


def problems(text: str, root: Path) -> list[str]:
    """Everything the map gets wrong about the tree at `root`, one line each."""
    headings, entries = module_map(text)
    out = []
    if headings != list(LAYERS):
        out.append(f"the layers are {headings}, tests/layers.py's are {list(LAYERS)}")
    listed = [path for _, path, _ in entries]
    missing = [m for m in modules(root) if m not in listed]
    if missing:
        out.append("not listed: " + ", ".join(missing))
    for heading, path, has_purpose in entries:
        rel = source_file(root, path)
        if listed.count(path) > 1:
            out.append(f"{path}: listed {listed.count(path)} times")
        if rel is None:
            out.append(f"{path}: names no module of the tree")
        elif layer_name(rel) != heading:
            out.append(f"{path}: listed under {heading or 'no layer'}, its layer is {layer_name(rel)}")
        if not has_purpose:
            out.append(f"{path}: no purpose on its line")
    return sorted(set(out), key=out.index)


def test_the_module_map_is_true_to_the_code():
    found = problems(DOC.read_text(encoding="utf-8"), ROOT)
    assert not found, "docs/ARCHITECTURE.md's module map:\n" + "\n".join(found)


def test_the_check_finds_a_module_left_out_misplaced_or_gone():
    """Not vacuous: the doc with one module's line removed, one moved under another layer and
    one path that names nothing fails naming each; with two layers' headings swapped, naming
    the order and the modules now under the wrong heading."""
    text = DOC.read_text(encoding="utf-8")
    lines = text.splitlines()
    rundir = next(line for line in lines if line.startswith("ppo_ray/driver/rundir.py "))
    lines = [line for line in lines if not line.startswith(("ppo_ray/deadlines.py ", "ppo_ray/driver/rundir.py "))]
    at = next(i for i, line in enumerate(lines) if line.startswith("bottom ")) + 1
    lines[at:at] = ["ppo_ray/gone.py           a module that no longer exists", rundir, "ppo_ray/atomic.py"]
    assert problems("\n".join(lines), ROOT) == [
        "not listed: ppo_ray/deadlines.py",
        "ppo_ray/gone.py: names no module of the tree",
        "ppo_ray/driver/rundir.py: listed under bottom, its layer is driver",
        "ppo_ray/atomic.py: listed 2 times",
        "ppo_ray/atomic.py: no purpose on its line",
    ]
    swapped = text.replace("\ndriver ", "\nROLES  ", 1).replace("\nroles (middle)", "\ndriver (middle)", 1)
    found = problems(swapped.replace("\nROLES  ", "\nroles  ", 1), ROOT)
    assert found[0] == ("the layers are ['tasks', 'roles', 'driver', 'bottom', 'math'], tests/layers.py's are "
                        "['tasks', 'driver', 'roles', 'bottom', 'math']"), found
    assert "ppo_ray/trainer.py: listed under roles, its layer is driver" in found
    assert "actors/generator.py: listed under driver, its layer is roles" in found
