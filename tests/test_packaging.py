"""The installed package (issue 28, section 4): a normal, non-editable install, as
deploy/Dockerfile makes, runs `ppo-ray` from any folder and finds the presets by name.

The wheel is built from exactly what the Dockerfile copies into the image, installed into a
fresh venv (its dependencies come from this venv's site-packages through a .pth file, so
nothing is downloaded), and run from a folder outside the repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from fast_tier import heavy_fixture
from ppo_ray.config import PRESETS_DIR, ConfigError, PPOConfig, preset_names, resolve_config

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


# ----------------------------------------------------------------------------- --config NAME
def test_presets_are_the_package_folder_and_configs_points_there():
    assert preset_names() == ["arith-tiny", "qwen3-0.6b-tldr", "smollm2-arith", "smollm2-tldr", "tiny", "tldr-tiny",
                              "tool-tiny"]
    assert PRESETS_DIR == ROOT / "ppo_ray" / "configs"
    # configs/xxx.yaml (README, tests, deploy/) still works in a checkout: a symlink
    assert (ROOT / "configs").is_symlink() and (ROOT / "configs").resolve() == PRESETS_DIR


def test_config_resolves_a_file_first_then_a_preset_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_config("tiny") == resolve_config("tiny.yaml") == PRESETS_DIR / "tiny.yaml"
    assert PPOConfig.from_yaml("qwen3-0.6b-tldr") == PPOConfig.from_yaml(PRESETS_DIR / "qwen3-0.6b-tldr.yaml")
    # a file that exists wins over the preset of the same name
    Path("tiny").write_text("kl_coef: 0.3\n")
    assert resolve_config("tiny") == Path("tiny") and PPOConfig.from_yaml("tiny").kl_coef == 0.3
    # a path is a path: no preset lookup for a missing one (the message launch.py prints is unchanged)
    with pytest.raises(ConfigError, match=r"^config file 'nope.yaml' does not exist \(or is not a file\)$"):
        PPOConfig.from_yaml("nope.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        PPOConfig.from_yaml("elsewhere/tiny")
    with pytest.raises(ConfigError, match=r"^config 'tinyy' is neither a file nor a preset; "
                                          r"presets: arith-tiny, qwen3-0.6b-tldr, smollm2-arith, smollm2-tldr, tiny, tldr-tiny, "
                                          r"tool-tiny$"):
        PPOConfig.from_yaml("tinyy")


# ----------------------------------------------------------------------------- the wheel
def _image_sources() -> list[str]:
    """What deploy/Dockerfile copies into /tmp/ppo-ray/src to `pip install` the package."""
    sources = []
    for line in DOCKERFILE.read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["COPY"] and parts[-1].startswith("/tmp/ppo-ray/src"):
            sources += [p for p in parts[1:-1] if not p.startswith("--")]
    return sources


@pytest.fixture(scope="module")
@heavy_fixture("builds the wheel and installs it into a new virtual environment")
def installed(tmp_path_factory) -> dict:
    """The wheel, built from the image's sources, installed into a fresh venv."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    src.mkdir()
    for name in _image_sources():
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(tmp / "dist"),
                    str(src)], check=True, capture_output=True, text=True, timeout=600)
    wheel, = (tmp / "dist").glob("ppo_ray-*.whl")

    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # the dependencies (torch, yaml, ...): this venv's, after the fresh venv's own site-packages
    # (a path in a .pth file is appended; its own .pth files, our editable install's finder
    # among them, are not run)
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "--isolated", "--disable-pip-version-check", "install", "-q",
                    "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=600)
    elsewhere = tmp / "elsewhere"  # the cwd: outside the repository
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return {"wheel": wheel, "python": python, "bin": env_dir / "bin", "site": site, "cwd": elsewhere, "env": env}


def _run(installed: dict, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*argv], cwd=installed["cwd"], env=installed["env"], capture_output=True, text=True,
                          timeout=300)


def test_wheel_holds_the_presets_and_the_bundled_assets(installed):
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    for folder in ("ppo_ray/configs", "ppo_ray/assets"):
        shipped = {str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob("*") if p.is_file()}
        assert shipped and shipped <= names, sorted(shipped - names)
    assert {"launch.py", "ppo_ray/config/__init__.py", "actors/generator.py", "learner/algos.py"} <= names
    assert any(n.endswith(".dist-info/entry_points.txt") for n in names)


def test_installed_ppo_ray_runs_outside_the_repository_with_presets_by_name(installed):
    # the installed modules, not the repository's
    where = _run(installed, str(installed["python"]), "-c",
                 "import launch, ppo_ray.config as c; print(launch.__file__); print(c.PRESETS_DIR)")
    assert where.returncode == 0, where.stderr
    launch_file, presets = map(Path, where.stdout.split())
    assert launch_file == installed["site"] / "launch.py"
    assert presets == installed["site"] / "ppo_ray" / "configs"
    # every preset loads and validates by name from the installed package
    check = _run(installed, str(installed["python"]), "-c",
                 "from ppo_ray.config import PPOConfig, preset_names\n"
                 "for name in preset_names(): print(name, PPOConfig.from_yaml(name).model_name)")
    assert check.returncode == 0, check.stderr
    assert check.stdout.splitlines() == ["arith-tiny embedded:tldr", "qwen3-0.6b-tldr Qwen/Qwen3-0.6B-Base",
                                         "smollm2-arith package:smollm2-135m-instruct",
                                         "smollm2-tldr package:smollm2-135m-instruct", "tiny embedded:tiny",
                                         "tldr-tiny embedded:tldr", "tool-tiny embedded:tldr"]

    ppo_ray = str(installed["bin"] / "ppo-ray")
    assert Path(ppo_ray).read_text().startswith(f"#!{installed['python']}")
    help_ = _run(installed, ppo_ray, "--help")
    assert help_.returncode == 0 and "--config FILE|PRESET" in help_.stdout, help_.stderr
    # The command loads the preset by name: stage sft rejects tiny's reward_funcs (a check on the
    # loaded config, before anything is written and before Ray starts).
    tiny = _run(installed, ppo_ray, "sft", "--config", "tiny")
    assert tiny.returncode == 2 and "the config names reward sources" in tiny.stderr, tiny.stderr
    unknown = _run(installed, ppo_ray, "--config", "qwen3")
    assert unknown.returncode == 2
    assert unknown.stderr.strip() == ("error: config 'qwen3' is neither a file nor a preset; "
                                      "presets: arith-tiny, qwen3-0.6b-tldr, smollm2-arith, smollm2-tldr, tiny, tldr-tiny, tool-tiny")
    assert not any(installed["cwd"].iterdir())  # nothing written
