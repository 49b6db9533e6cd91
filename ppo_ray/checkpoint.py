"""Checkpoints of a PPO run: written atomically, resumed exactly.

Layout (one directory per checkpoint, under ``<run_dir>/checkpoints``)::

    checkpoints/
      step-000010/
        adapter/                 the policy LoRA in PEFT format (PeftModel / vLLM load it)
        value.safetensors        the value model's trainable tensors (LoRA + head)
        optimizer.pt             both Adam states, their lr schedules, the KL coefficient (torch.save;
                                 loaded with weights_only=True)
        rng.pt                   the learner's RNG state (LoRA dropout) and the data-order RNG
        trainer.json             step, adapter version, data cursor, metrics lines written
        config.yaml              the run's config (paths inside the run directory relative to it)
        checksums.json           sha256 of every file above, written last
      latest                     the name of the newest complete checkpoint ("step-000010")

Atomicity: a checkpoint is written into a hidden temporary directory next to its final
place, every file fsynced, then renamed into place (a rename within one filesystem is
atomic), and only then is ``latest`` replaced (write a temp file, os.replace). A crash at
any point leaves ``latest`` naming a complete checkpoint; half-written temp directories are
removed by the next save. Nothing is loaded with pickle: tensors are safetensors, optimiser
and RNG states go through ``torch.load(weights_only=True)``.

Integrity: a file damaged after the fact (an interrupted copy, a full disk, bit rot) fails
its checksum on load. Loading a run directory then falls back to the newest intact
checkpoint with a warning naming the damaged file; loading one named checkpoint stops with
a CheckpointError naming it. Checkpoints written before checksums existed load unchecked.

Compatibility: resuming with a config that changes what the checkpoint's tensors mean
(model, LoRA shape, value model, dtype) is refused with an error naming the fields;
run-length fields (steps, eval_every, checkpoint_every, ...) may change.

Portability: the pipeline's PPO config names parts of the run directory (model_name =
<run_dir>/sft, the reward model, the prompts file). The checkpoint's config.yaml stores such
paths relative to the run directory (``${run_dir}/sft``), and paths are compared resolved,
so a run directory that is moved, copied or mounted elsewhere (another node, another
cluster) resumes where it now is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional

import torch

from ppo_ray.config import PPOConfig

# Fields that decide what a checkpoint's tensors are and how the run samples/learns: a
# resume that changes one of them would silently mix two runs.
MUST_MATCH = (
    "model_name", "ref_model_name", "reward_model_name", "value_model_name", "reward_funcs",
    "reward_weights", "lora_r", "lora_alpha", "lora_target_modules", "dtype", "seed", "batch_size",
    "dataset", "prompt_column", "temperature", "top_k", "top_p", "max_new_tokens", "apply_chat_template",
)
LATEST = "latest"
CHECKSUMS = "checksums.json"
# Config fields that may name a path inside the run directory (the pipeline's PPO stage).
PATH_FIELDS = ("model_name", "ref_model_name", "reward_model_name", "value_model_name", "dataset")
RUN_DIR = "${run_dir}"

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that cannot be found, read, or resumed with this config."""


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_checksums(ckpt: Path) -> None:
    sums = {p.relative_to(ckpt).as_posix(): _sha256(p) for p in sorted(ckpt.rglob("*"))
            if p.is_file() and p.name != CHECKSUMS}
    (ckpt / CHECKSUMS).write_text(json.dumps(sums, indent=1))


def verify_checkpoint(ckpt: Path) -> None:
    """CheckpointError naming the first file that is missing or fails its checksum. A
    checkpoint without checksums.json (written before they existed) passes unchecked."""
    sums_path = ckpt / CHECKSUMS
    if not sums_path.is_file():
        if (ckpt / "trainer.json").is_file():
            log.warning("checkpoint %s has no %s (written by an older version): loaded unverified", ckpt, CHECKSUMS)
            return
        raise CheckpointError(f"checkpoint {ckpt} is incomplete: no trainer.json")
    try:
        sums = json.loads(sums_path.read_text())
    except ValueError as e:
        raise CheckpointError(f"checkpoint {ckpt}: {sums_path} is damaged ({e})") from e
    for name, digest in sums.items():
        path = ckpt / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {ckpt} is damaged: {path} is missing")
        if _sha256(path) != digest:
            raise CheckpointError(f"checkpoint {ckpt} is damaged: {path} fails its sha256 checksum "
                                  f"({path.stat().st_size} bytes; an interrupted copy or a full disk?)")


def _portable(config: PPOConfig, run_dir: Path) -> PPOConfig:
    """`config` with paths inside `run_dir` written relative to it (${run_dir}/...)."""
    root = run_dir.resolve()
    changes = {}
    for name in PATH_FIELDS:
        value = getattr(config, name)
        if not value or value.startswith(RUN_DIR):
            continue
        try:
            rel = Path(value).resolve().relative_to(root)
        except ValueError:  # outside the run directory (or not a path): kept as written
            continue
        changes[name] = f"{RUN_DIR}/{rel.as_posix()}"
    return config.replace(**changes) if changes else config


def _localized(config: PPOConfig, run_dir: Path) -> PPOConfig:
    """`config` with ${run_dir} replaced by where the run directory is now."""
    changes = {name: str(run_dir / getattr(config, name)[len(RUN_DIR):].lstrip("/"))
               for name in PATH_FIELDS if (getattr(config, name) or "").startswith(RUN_DIR)}
    return config.replace(**changes) if changes else config


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: str | Path, *, config: PPOConfig, learner_state: dict, trainer_state: dict,
                    model_dir: str, keep: int = 2) -> Path:
    """Write one checkpoint atomically and point ``latest`` at it; keep the newest `keep`."""
    from safetensors.torch import save_file

    from ppo_ray.modeling import write_lora_adapter

    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # an earlier crash's half-written checkpoint
        shutil.rmtree(stale, ignore_errors=True)
    name = step_name(int(trainer_state["step"]))
    tmp = root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write_lora_adapter(tmp / "adapter", learner_state["policy"], base_model=model_dir)
        save_file({k: v.contiguous() for k, v in learner_state["value"].items()}, str(tmp / "value.safetensors"))
        torch.save({"policy": learner_state["policy_optimizer"], "value": learner_state["value_optimizer"],
                    "policy_scheduler": learner_state["policy_scheduler"],
                    "value_scheduler": learner_state["value_scheduler"], "kl_coef": learner_state["kl_coef"]},
                   tmp / "optimizer.pt")
        torch.save({"learner": learner_state["rng"], "learner_cuda": learner_state.get("cuda_rng", []),
                    "data": trainer_state["data_rng"]}, tmp / "rng.pt")
        meta = {k: v for k, v in trainer_state.items() if k != "data_rng"}
        meta["version"] = int(learner_state["version"])
        (tmp / "trainer.json").write_text(json.dumps(meta, indent=1))
        _portable(config, Path(run_dir)).to_yaml(tmp / "config.yaml")
        _write_checksums(tmp)
        _fsync_tree(tmp)
        final = root / name
        if final.exists():  # the same step written again (a run resumed from an older checkpoint)
            trash = root / f".tmp-old-{name}-{uuid.uuid4().hex[:8]}"
            final.rename(trash)
            shutil.rmtree(trash, ignore_errors=True)
        tmp.rename(final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pointer = root / f".tmp-latest-{uuid.uuid4().hex[:8]}"
    pointer.write_text(name + "\n")
    with open(pointer, "rb") as f:
        os.fsync(f.fileno())
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-max(keep, 1)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def resolve_checkpoint(path: str | Path, verify: bool = True) -> Path:
    """A checkpoint directory, or a run directory / checkpoints folder -> its newest intact
    checkpoint. A damaged newest checkpoint (checksums) is skipped with a warning naming the
    damaged file, for the next older intact one; a named checkpoint that is damaged, or a
    run with none intact, is a CheckpointError naming the file."""
    path = Path(path)
    if (path / "trainer.json").is_file() or (path / CHECKSUMS).is_file():
        if verify:
            verify_checkpoint(path)
        return path
    for root in (checkpoint_root(path), path):
        pointer = root / LATEST
        if not pointer.is_file():
            continue
        named = root / pointer.read_text().strip()
        # newest first: the one `latest` names, then the others by step (names sort by step)
        candidates = [named] + sorted((p for p in root.glob("step-*") if p.is_dir() and p != named), reverse=True)
        problems = []
        for ckpt in candidates:
            try:
                if not (ckpt / "trainer.json").is_file():
                    raise CheckpointError(f"{pointer} names {ckpt.name}, which is missing or incomplete"
                                          if ckpt == named else f"checkpoint {ckpt} is incomplete: no trainer.json")
                if verify:
                    verify_checkpoint(ckpt)
            except CheckpointError as e:
                problems.append(str(e))
                continue
            if problems:
                log.warning("%s; resuming from the newest intact checkpoint, %s", "; ".join(problems), ckpt)
            return ckpt
        raise CheckpointError("no intact checkpoint in " + str(root) + ": " + "; ".join(problems))
    if not path.exists():
        raise CheckpointError(f"--resume {path}: no such file or directory")
    raise CheckpointError(f"--resume {path}: no checkpoint there (expected a step-NNNNNN directory "
                          f"with trainer.json, or a run directory with checkpoints/{LATEST})")


def _same_path(a: Any, b: Any) -> bool:
    if a == b:
        return True
    if not isinstance(a, str) or not isinstance(b, str):
        return False
    return Path(a).resolve() == Path(b).resolve()


def check_compatible(saved: PPOConfig, config: PPOConfig, where: Path) -> None:
    def same(k: str) -> bool:
        a, b = getattr(saved, k), getattr(config, k)
        return _same_path(a, b) if k in PATH_FIELDS else a == b

    diffs = [f"{k}: checkpoint {getattr(saved, k)!r} vs now {getattr(config, k)!r}"
             for k in MUST_MATCH if not same(k)]
    if diffs:
        raise CheckpointError(f"checkpoint {where} was written by a run with a different config; "
                              f"refusing to mix them: " + "; ".join(diffs))


def load_checkpoint(path: str | Path, config: Optional[PPOConfig] = None) -> tuple[Path, dict, dict]:
    """(checkpoint dir, learner_state, trainer_state); with `config`, refuse an incompatible one."""
    from safetensors.torch import load_file

    from ppo_ray.modeling import read_lora_adapter

    ckpt = resolve_checkpoint(path)
    try:
        saved = _localized(PPOConfig.from_yaml(ckpt / "config.yaml"), ckpt.parent.parent)
    except Exception as e:
        raise CheckpointError(f"checkpoint {ckpt}: unreadable config.yaml: {e}") from e
    if config is not None:
        check_compatible(saved, config, ckpt)
    try:
        meta: dict[str, Any] = json.loads((ckpt / "trainer.json").read_text())
        optim = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True)
        rng = torch.load(ckpt / "rng.pt", map_location="cpu", weights_only=True)
        learner_state = {
            "version": int(meta["version"]),
            "policy": read_lora_adapter(ckpt / "adapter"),
            "value": load_file(str(ckpt / "value.safetensors")),
            "policy_optimizer": optim["policy"], "value_optimizer": optim["value"],
            "rng": rng["learner"], "cuda_rng": rng.get("learner_cuda", []),
        }
        # learning-rate schedules and the adaptive KL coefficient (absent in checkpoints
        # written before they existed: the learner then keeps its fresh ones)
        learner_state.update({k: optim[k] for k in ("policy_scheduler", "value_scheduler", "kl_coef") if k in optim})
    except (OSError, KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {ckpt} is incomplete or corrupt: {e}") from e
    trainer_state = {**meta, "data_rng": rng["data"]}
    return ckpt, learner_state, trainer_state
