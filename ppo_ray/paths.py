"""Model names to directories: the one place a config's model name becomes a path.

    resolve_model_path("Qwen/Qwen3-0.6B-Base")   # a hub id: returned as is
    resolve_model_path("~/runs/x/sft")            # a local HF directory: its path
    resolve_model_path("embedded:tldr")           # the committed default-job model
    resolve_model_path("embedded:tiny")           # built once, cached (ppo_ray.tiny_model)
    resolve_model_path("~/models/m.Q4_1.gguf")    # a GGUF file: converted once, cached (ppo_ray.gguf_model)
    resolve_model_path("package:smollm2-135m-instruct")  # a registry package's GGUF: the same

Bottom layer: imports the standard library, and ppo_ray.tiny_model (the bottom-layer
builder of the test models) and ppo_ray.gguf_model (the GGUF conversion) lazily. The committed model's BUILDER (ppo_ray.tldr_model)
sits above the PPO system, with the task it pretrains on; resolving it needs only where
its committed files lie, which is here, so nothing below the task imports the task.
"""

from __future__ import annotations

from pathlib import Path

EMBEDDED_PREFIX = "embedded:"
# The default job's committed model (built by ppo_ray.tldr_model, committed in ASSET_DIR).
TLDR_MODEL_NAME = "embedded:tldr"
TLDR_MODEL_ASSET_DIR = "assets/tldr_model"


def tldr_model_dir() -> Path:
    """The committed model directory of TLDR_MODEL_NAME (inside the installed package)."""
    return Path(__file__).resolve().parent / TLDR_MODEL_ASSET_DIR


def resolve_model_path(name: str) -> str:
    """A hub id or a local directory is returned as is; "embedded:tldr" is the committed
    model of the default job (tldr_model_dir); "embedded:tiny" / "embedded:small" is built
    (once, cached) by ppo_ray.tiny_model; a path ending in .gguf, or "package:<name>" (a
    GGUF a registry package carries), is converted (once, cached) by ppo_ray.gguf_model;
    either way its directory is returned. A local path that exists but holds no config.json
    is a FileNotFoundError, as is a .gguf path with no file."""
    from ppo_ray import gguf_model  # the standard library only at import; transformers when converting

    if gguf_model.is_gguf_source(name):
        if name.startswith(gguf_model.PACKAGE_PREFIX):
            return str(gguf_model.packaged_model_dir(name))
        return str(gguf_model.convert_gguf(name))
    if name.startswith(EMBEDDED_PREFIX):
        if name == TLDR_MODEL_NAME:
            return str(tldr_model_dir())
        from ppo_ray.tiny_model import build_tiny_model

        return str(build_tiny_model(size=name[len(EMBEDDED_PREFIX):]))
    path = Path(name).expanduser()
    if path.exists() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"model path {name!r} exists but is not a model directory (no config.json)")
    return str(path) if path.exists() else name
