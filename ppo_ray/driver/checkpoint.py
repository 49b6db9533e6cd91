"""Checkpoints of a PPO run: written atomically, resumed exactly.

Layout (one directory per checkpoint, under ``<run_dir>/checkpoints``)::

    checkpoints/
      step-000010/
        adapter/                 the policy LoRA in PEFT format (PeftModel / vLLM load it)
        behaviour/v000008/ ...   max_staleness: the earlier LoRA versions that the batches in flight
                                 were sampled with (PEFT format), so a resume samples them again
        value.safetensors        the value model's trainable tensors (LoRA + head)
        optimizer.pt             both Adam states, their lr schedules, the KL coefficient (torch.save;
                                 loaded with weights_only=True)
        rng.pt                   the learner's RNG state (LoRA dropout) and the data-order RNG
        trainer.json             step, adapter version, data cursor, metrics lines written
        config.yaml              the run's config (paths inside the run directory relative to it)
        checksums.json           sha256 of every file above, written last
      latest                     the name of the newest complete checkpoint ("step-000010")
      abandoned/<time>-.../      checkpoints of a branch that a resume from an older one left

Lineage: trainer.json records the run the checkpoint belongs to (``run_id``: drawn by a
fresh run, kept by a resumed one), its own ``checkpoint_id`` and the checkpoint it continues
from (``parent``, ``parent_id``). The run's history is the chain of parents from the newest
checkpoint. Pruning keeps the newest ``keep`` checkpoints of that chain and deletes nothing
else; a damaged newest checkpoint (or a missing or damaged ``latest``) falls back along the
chain only, never to a checkpoint of another run or of an abandoned branch. Resuming from
an older checkpoint of the run (:func:`branch_from`) moves the checkpoints that do not lead
to it aside, into ``checkpoints/abandoned/``, and says so: nothing is deleted that the new
branch did not supersede, and the checkpoint it resumed from is pruned only once a newer
one of the new branch is written and verified.

Atomicity: a checkpoint is written into a hidden temporary directory next to its final
place, every file fsynced, then renamed into place (ppo_ray.atomic: a rename within one
filesystem is atomic), and only then is ``latest`` replaced (write a temp file, os.replace). A crash at
any point leaves ``latest`` naming a complete checkpoint; half-written temp directories are
removed by the next save. Nothing is loaded with pickle: tensors are safetensors, optimiser
and RNG states go through ``torch.load(weights_only=True)``.

Integrity: a file damaged after the fact (an interrupted copy, a full disk, bit rot) fails
its checksum on load. Loading a run directory then falls back to the newest intact
checkpoint with a warning naming the damaged file; loading one named checkpoint stops with
a CheckpointError naming it. Checkpoints written before checksums existed load unchecked.

Compatibility: resuming with a config that changes what the checkpoint's tensors mean
(model, LoRA shape, value model, dtype) is refused with an error naming the fields;
run-length fields (steps, eval_every, checkpoint_every, ...) may change. A checkpoint also
records what its models hold (trainer.json ``fingerprints``: a content digest of every local
model directory the run was trained on, e.g. the pipeline's ``sft/`` and ``rm/``), and a
resume recomputes them: a stage re-run or overwritten since (same path, other weights) is
refused, naming the stage and both digests. The config a run resumes with is the
checkpoint's own config.yaml plus the command's overrides (:func:`resumed_config`), whichever
way it was asked to resume.

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
import re
import shutil
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ppo_ray.atomic import atomic_dir, atomic_write_text, fsync_dir, remove_stale_temps
from ppo_ray.config import MODEL_FIELDS, MUST_MATCH, PATH_FIELDS, PPOConfig  # noqa: F401 (MUST_MATCH: for callers)
from ppo_ray.paths import EMBEDDED_PREFIX
from ppo_ray.stats import LearnerState  # noqa: F401 (the checkpoint's learner part; defined in the bottom)

if TYPE_CHECKING:
    from ppo_ray.modeling import LoraWeights

LATEST = "latest"
ABANDONED = "abandoned"
BEHAVIOUR = "behaviour"  # the earlier adapters that batches in flight were sampled with (max_staleness)
CHECKSUMS = "checksums.json"
STEP_NAME = re.compile(r"step-\d{6,}")  # what `latest` may name: a checkpoint directly under checkpoints/
RUN_DIR = "${run_dir}"

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that cannot be found, read, or resumed with this config."""


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_name(step: int) -> str:
    return f"step-{step:06d}"


@dataclass(frozen=True)
class Lineage:
    """Where the next checkpoint of a run sits in its history: the run it belongs to and the
    checkpoint it continues from (None: the run's first)."""

    run_id: str
    parent: Optional[str] = None      # the checkpoint's directory name, e.g. "step-000010"
    parent_id: Optional[str] = None   # its checkpoint_id (a name alone can be reused by another branch)

    @classmethod
    def fresh(cls) -> "Lineage":
        return cls(run_id=uuid.uuid4().hex[:12])

    @classmethod
    def after(cls, ckpt: Path) -> "Lineage":
        """The lineage of a checkpoint written after `ckpt` (a resume or the next save). A
        checkpoint written before lineage existed starts a new run id."""
        meta = read_meta(ckpt) or {}
        return cls(run_id=meta.get("run_id") or uuid.uuid4().hex[:12], parent=ckpt.name,
                   parent_id=meta.get("checkpoint_id"))


def read_meta(ckpt: Path) -> Optional[dict]:
    """A checkpoint's trainer.json, or None when it is missing or unreadable."""
    try:
        meta = json.loads((Path(ckpt) / "trainer.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _steps(root: Path) -> list[Path]:
    """The checkpoint directories directly under `root`, newest step first."""
    return sorted((p for p in root.glob("step-*") if p.is_dir() and STEP_NAME.fullmatch(p.name)), reverse=True)


def ancestry(ckpt: Path, unreadable: bool = False) -> list[Path]:
    """`ckpt` and the checkpoints it continues from that are still beside it, newest first
    (follows parent/parent_id; stops at a parent that is gone, moved or of another id).
    `unreadable`: also end the chain with a parent whose trainer.json cannot be read (its id
    unknown: a candidate that resume will name as damaged, never one to prune)."""
    chain, seen = [ckpt], {ckpt.name}
    meta = read_meta(ckpt) or {}
    while meta.get("parent") and meta["parent"] not in seen and STEP_NAME.fullmatch(str(meta["parent"])):
        parent = ckpt.parent / meta["parent"]
        parent_meta = read_meta(parent)
        if parent_meta is None and unreadable and parent.is_dir():
            chain.append(parent)
            break
        if parent_meta is None or parent_meta.get("checkpoint_id") != meta.get("parent_id"):
            break
        chain.append(parent)
        seen.add(parent.name)
        meta = parent_meta
    return chain


def run_ids(run_dir: str | Path) -> set[Optional[str]]:
    """The run ids of the checkpoints in a run directory (None for one without lineage)."""
    return {(read_meta(p) or {}).get("run_id") for p in _steps(checkpoint_root(run_dir))}


def check_fresh_run(step: int, lineage: "Lineage", run_dir: Optional[Path], metrics_path: str | Path | None) -> None:
    """A run that has not started (no step, no checkpoint saved or restored: `step`, `lineage`)
    must not write into another run's files: its checkpoints would be pruned by name and its
    metrics truncated (RunDirError naming the file, before anything is written)."""
    from ppo_ray.driver.rundir import RunDirError

    if step or lineage.parent is not None:
        return
    if run_dir is not None and run_ids(run_dir) - {lineage.run_id}:
        raise RunDirError(f"{checkpoint_root(run_dir)} holds another run's checkpoints: continue it "
                          f"(trainer.restore({str(run_dir)!r}), launch.py ppo --resume {run_dir}) or "
                          "train in a new run directory")
    if metrics_path is not None and Path(metrics_path).is_file() and Path(metrics_path).stat().st_size:
        raise RunDirError(f"{metrics_path} holds another run's steps: continue that run from its checkpoint "
                          "or write this one elsewhere")


def check_own_lineage(ckpt: Path, run_dir: str | Path) -> None:
    """A run touches only its own lineage: RunDirError, before anything is loaded or written,
    when resuming `ckpt` into `run_dir` would write over another run. That is a checkpoint
    from outside run_dir while run_dir holds a run's PPO outputs (its metrics would be
    truncated, its checkpoints moved, its adapter and report overwritten), or a checkpoint
    whose run id is not that of the checkpoints beside it. Into a run directory that holds
    no PPO run, a checkpoint from elsewhere may start a copy of its run (a fork)."""
    from ppo_ray.driver.rundir import RunDirError, held_outputs

    ckpt, run_dir = Path(ckpt), Path(run_dir)
    root = checkpoint_root(run_dir)
    run_id = (read_meta(ckpt) or {}).get("run_id")
    if ckpt.parent.resolve() != root.resolve():
        held = held_outputs(run_dir, ["ppo"])
        if held:
            theirs = "/".join(sorted(i for i in run_ids(run_dir) if i)) or "without lineage"
            raise RunDirError(
                f"checkpoint {ckpt} (run {run_id}) is not in the run directory {run_dir}, which holds another run "
                f"({', '.join(held)}; run {theirs}): resuming it there would truncate that run's metrics, move its "
                f"checkpoints and overwrite its adapter and report. Resume it in its own run directory (launch.py "
                f"ppo --resume {ckpt}), or move the other run aside first (launch.py ppo --resume {ckpt} --run_dir "
                f"{run_dir} --overwrite)")
        return
    others = sorted(i for i in run_ids(run_dir) - {run_id} if i)
    if others:
        raise RunDirError(f"checkpoint {ckpt} belongs to run {run_id}, but {root} also holds run "
                          f"{', '.join(others)}: a resume continues the run its directory holds; move the checkpoint "
                          "into a run directory of its own")


def _move_aside(root: Path, ckpts: list[Path], why: str) -> Optional[Path]:
    """Move `ckpts` into root/abandoned/<time>-<why>/ (never deleted); returns that folder."""
    if not ckpts:
        return None
    where = root / ABANDONED / f"{time.strftime('%Y%m%d-%H%M%S')}-{why}-{uuid.uuid4().hex[:4]}"
    where.mkdir(parents=True)
    for ckpt in ckpts:
        ckpt.rename(where / ckpt.name)
    fsync_dir(root)
    return where


def branch_from(ckpt: Path) -> Optional[Path]:
    """Make `ckpt` the head of its run directory's history, as a resume from it does: the
    checkpoints of the same run that do not lead to it (a branch the resume abandons, e.g.
    step-20 when resuming from step-10) move to checkpoints/abandoned/ (logged), and
    `latest` names `ckpt`. Checkpoints of other runs are left where they are. Returns the
    folder they went to (None: nothing to move)."""
    ckpt = Path(ckpt)
    root = ckpt.parent
    run_id = (read_meta(ckpt) or {}).get("run_id")
    keep = {p.name for p in ancestry(ckpt)}
    off = [p for p in _steps(root) if p.name not in keep and (read_meta(p) or {}).get("run_id") == run_id]
    where = _move_aside(root, off, f"after-{ckpt.name}")
    if where is not None:
        log.warning("resuming from %s: the checkpoints of the branch it abandons (%s) were moved to %s",
                    ckpt, ", ".join(p.name for p in off), where)
    _write_latest(root, ckpt.name)
    return where


def file_sha256(path: Path) -> str:
    """The file's SHA-256, hex (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_checksums(ckpt: Path) -> None:
    sums = {p.relative_to(ckpt).as_posix(): file_sha256(p) for p in sorted(ckpt.rglob("*"))
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
        if file_sha256(path) != digest:
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


def model_fingerprint(name: str) -> str:
    """What a model name holds: a local model directory's content digest ("sha256:" + 16 hex
    digits over its files' names and bytes, ppo_ray.transfer.content_digest), a GGUF source's
    ("gguf:sha256:" + 16 hex digits of the GGUF file's bytes, ppo_ray.gguf_model.fingerprint), an
    embedded model's name (built by our own builders, by name), or a hub id as such ("hub:" + id)."""
    from ppo_ray import gguf_model
    from ppo_ray.transfer import content_digest

    if gguf_model.is_gguf_source(name):
        return gguf_model.fingerprint(name)
    if name.startswith(EMBEDDED_PREFIX):
        return name
    path = Path(name).expanduser()
    if path.is_dir():
        return "sha256:" + content_digest(path)
    return "hub:" + name


def model_fingerprints(config: PPOConfig) -> dict[str, str]:
    """{field: model_fingerprint} of every model the config names (MODEL_FIELDS)."""
    return {name: model_fingerprint(getattr(config, name)) for name in MODEL_FIELDS if getattr(config, name)}


def _model_label(name: str, value: str, run_dir: Optional[Path]) -> str:
    """'the sft stage (<run_dir>/sft)' for a model inside the run directory, else 'model_name (<path>)'."""
    if run_dir is not None:
        try:
            rel = Path(value).resolve().relative_to(Path(run_dir).resolve())
            return f"the run's {rel.as_posix()!r} stage ({value}, {name})"
        except ValueError:
            pass
    return f"{name} ({value})"


def check_fingerprints(saved: dict[str, str], config: PPOConfig, where: Path,
                       run_dir: Optional[Path] = None) -> None:
    """CheckpointError when a model the checkpoint was trained on now holds something else
    (`saved`: the checkpoint's fingerprints; a field it has none for is not compared)."""
    now = model_fingerprints(config)
    diffs = [f"{_model_label(k, getattr(config, k), run_dir)}: checkpoint trained on {v}, it now holds {now[k]}"
             for k, v in saved.items() if k in now and now[k] != v]
    if diffs:
        raise CheckpointError(
            f"checkpoint {where} was trained on models that have changed since (a stage re-run or overwritten?); "
            "resuming would put its adapters, value model and optimiser state onto other weights: "
            + "; ".join(diffs) + ". Start the PPO stage over (launch.py ppo --run_dir RUN --overwrite: the old "
            "outputs are moved aside) or resume onto the models it was trained on")


def resumed_config(ckpt: str | Path, run_dir: str | Path, overrides: Optional[dict[str, Any]] = None) -> PPOConfig:
    """The one resume rule: the checkpoint's own config (config.yaml, its ${run_dir} paths
    placed in `run_dir`) plus `overrides` (the command's --field options)."""
    ckpt = Path(ckpt)
    try:
        saved = _localized(PPOConfig.from_saved(ckpt / "config.yaml"), Path(run_dir))
    except Exception as e:
        raise CheckpointError(f"checkpoint {ckpt}: unreadable config.yaml: {e}") from e
    return saved.replace(**overrides) if overrides else saved


def config_changes(saved: PPOConfig, config: PPOConfig) -> list[tuple[str, Any, Any]]:
    """(field, checkpoint's value, this run's) for every field that differs (paths compared resolved)."""
    return [(k, getattr(saved, k), getattr(config, k)) for k in PPOConfig.field_names()
            if not (_same_path(getattr(saved, k), getattr(config, k)) if k in PATH_FIELDS
                    else getattr(saved, k) == getattr(config, k))]


def apply_changes(config: PPOConfig, ckpt: Path, saved: PPOConfig, state):
    """Name the fields of `config` (the resuming trainer's) that differ from the checkpoint's
    (they apply from the next step) and keep the restored state from shadowing them: the
    learning rates and schedule kind are the config's (Learner.load_state_dict), a fixed
    kl_coef is the config's, and an adaptive KL controller (kl_target) continues from the
    checkpoint's coefficient unless this run gives another kl_coef or another kl_target
    (then it starts from kl_coef). Returns the state to restore."""
    # steps: PPOTrainer._plan_steps says what changes
    changes = [(k, a, b) for k, a, b in config_changes(saved, config) if k != "steps"]
    if not changes:
        return state
    notes = {"learning_rate": "the policy's schedule keeps its position", "lr_scheduler": "from its current tick",
             "value_learning_rate": "the value model's schedule keeps its position"}
    adaptive = config.kl_target is not None and state.kl_coef is not None
    if adaptive and (saved.kl_target is None or saved.kl_coef != config.kl_coef
                     or saved.kl_target != config.kl_target):
        notes["kl_coef"] = notes["kl_target"] = (f"the adaptive KL controller starts from kl_coef "
                                                 f"{config.kl_coef:g}, not the checkpoint's {state.kl_coef:.6g}")
        state = replace(state, kl_coef=None)
    elif saved.kl_target is not None and config.kl_target is None:
        notes["kl_target"] = (f"kl_coef is fixed at {config.kl_coef:g} from now on (the checkpoint's "
                              f"adaptive coefficient was {state.kl_coef if state.kl_coef is not None else '?'})")
    log.warning("resuming from %s with changes to its config, applied from the next step: %s", ckpt, "; ".join(
        f"{k} {a!r} -> {b!r}" + (f" ({notes[k]})" if k in notes else "") for k, a, b in changes))
    return state


def save_checkpoint(run_dir: str | Path, *, config: PPOConfig, learner_state: dict, trainer_state: dict,
                    model_dir: str, keep: int = 2, lineage: Optional[Lineage] = None,
                    behaviour: Optional[dict] = None) -> Path:
    """Write one checkpoint atomically, verify it, point ``latest`` at it, and prune its
    history to the newest `keep`. `lineage` says which run and checkpoint it continues (the
    trainer knows); None = the one ``latest`` names, or a new run when there is none.
    `behaviour`: {version: LoraWeights} of the earlier adapter versions that batches in flight
    were sampled with (max_staleness), written under behaviour/."""
    from safetensors.torch import save_file

    from ppo_ray.modeling import write_lora_adapter

    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    if lineage is None:
        head = _pointed(root)
        lineage = Lineage.after(head) if head is not None and read_meta(head) is not None else Lineage.fresh()
    remove_stale_temps(root, ".tmp-")  # an earlier crash's half-written checkpoint
    name = step_name(int(trainer_state["step"]))
    final = root / name
    with atomic_dir(final, fsync=True) as tmp:
        write_lora_adapter(tmp / "adapter", learner_state.policy, base_model=model_dir)
        for version, weights in sorted((behaviour or {}).items()):
            write_lora_adapter(tmp / BEHAVIOUR / f"v{int(version):06d}", weights, base_model=model_dir)
        save_file({k: v.contiguous() for k, v in learner_state.value.items()}, str(tmp / "value.safetensors"))
        torch.save({"policy": learner_state.policy_optimizer, "value": learner_state.value_optimizer,
                    "policy_scheduler": learner_state.policy_scheduler,
                    "value_scheduler": learner_state.value_scheduler, "kl_coef": learner_state.kl_coef},
                   tmp / "optimizer.pt")
        torch.save({"learner": learner_state.rng, "learner_cuda": learner_state.cuda_rng,
                    "data": trainer_state["data_rng"]}, tmp / "rng.pt")
        meta = {k: v for k, v in trainer_state.items() if k != "data_rng"}
        meta["version"] = int(learner_state.version)
        meta["behaviour_versions"] = sorted(int(v) for v in (behaviour or {}))
        meta.update(run_id=lineage.run_id, checkpoint_id=uuid.uuid4().hex[:12], parent=lineage.parent,
                    parent_id=lineage.parent_id, saved_at=time.time())
        (tmp / "trainer.json").write_text(json.dumps(meta, indent=1))
        _portable(config, Path(run_dir)).to_yaml(tmp / "config.yaml")
        _write_checksums(tmp)
        if final.exists():  # a checkpoint of this name that is not this one's parent: kept aside
            where = _move_aside(root, [final], f"replaced-{name}")
            log.warning("%s already held a checkpoint that this one does not continue: moved to %s", final, where)
    verify_checkpoint(final)  # what pruning relies on: the new head reads back intact
    _write_latest(root, name)
    for old in ancestry(final)[max(keep, 1):]:  # only this run's history, never another branch
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write_latest(root: Path, name: str) -> None:
    atomic_write_text(root / LATEST, name + "\n", fsync=True)


def _pointed(root: Path) -> Optional[Path]:
    """The checkpoint `latest` names, or None when `latest` is missing or names something
    that is not a checkpoint directly under `root` (it cannot point elsewhere)."""
    try:
        name = (root / LATEST).read_text().strip()
    except OSError:
        return None
    if not STEP_NAME.fullmatch(name):
        log.warning("%s names %r, which is not a checkpoint of %s: ignored", root / LATEST, name[:200], root)
        return None
    return root / name


def resolve_checkpoint(path: str | Path, verify: bool = True) -> Path:
    """A checkpoint directory, or a run directory / checkpoints folder -> the newest intact
    checkpoint of its run's history. That history is the chain of parents from the
    checkpoint ``latest`` names, or, when ``latest`` is missing, damaged or names a missing
    checkpoint (a crash before the first pointer, a lost file), from the newest checkpoint
    written. A damaged checkpoint is skipped with a warning naming the damaged file, for the
    next one back in the chain; a named checkpoint that is damaged, or a run with none
    intact, is a CheckpointError naming the file."""
    path = Path(path)
    if (path / "trainer.json").is_file() or (path / CHECKSUMS).is_file():
        if verify:
            verify_checkpoint(path)
        return path
    for root in (checkpoint_root(path), path):
        if not root.is_dir() or not ((root / LATEST).exists() or _steps(root)):
            continue
        problems = []
        head = _pointed(root)
        if head is not None and read_meta(head) is None:
            problems.append(f"{root / LATEST} names {head.name}, which is missing or incomplete")
            head = None
        if head is None:
            if (root / LATEST).exists() and not problems:
                problems.append(f"{root / LATEST} is damaged")
            written = [(meta.get("saved_at", 0.0), p) for p in _steps(root) if (meta := read_meta(p)) is not None]
            head = max(written, key=lambda t: (t[0], t[1].name))[1] if written else None
        if head is None:
            problems.append("no checkpoint with a trainer.json")
            candidates: list[Path] = []
        elif "run_id" in (read_meta(head) or {}):
            candidates = ancestry(head, unreadable=True)
        else:  # written before lineage existed: every such checkpoint, newest step first
            candidates = [head] + [p for p in _steps(root) if p != head and "run_id" not in (read_meta(p) or {})]
        for ckpt in candidates:
            try:
                if not (ckpt / "trainer.json").is_file():
                    raise CheckpointError(f"checkpoint {ckpt} is incomplete: no trainer.json")
                if verify:
                    verify_checkpoint(ckpt)
            except CheckpointError as e:
                problems.append(str(e))
                continue
            if problems:
                log.warning("%s; resuming from the newest intact checkpoint of the run, %s", "; ".join(problems), ckpt)
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


def load_checkpoint(path: str | Path, config: Optional[PPOConfig] = None,
                    run_dir: Optional[str | Path] = None) -> tuple[Path, dict, dict]:
    """(checkpoint dir, learner_state, trainer_state); with `config`, refuse an incompatible
    one (check_compatible) and one whose models have changed since (check_fingerprints).
    The checkpoint's ${run_dir} paths are placed in `run_dir` (default: the checkpoint's own
    run directory), as resumed_config places them."""
    from safetensors.torch import load_file

    from ppo_ray.modeling import read_lora_adapter

    ckpt = resolve_checkpoint(path)
    run_dir = Path(run_dir) if run_dir is not None else ckpt.parent.parent
    saved = resumed_config(ckpt, run_dir)

    def read(name: str, load: Callable[[Path], Any]) -> Any:
        try:
            return load(ckpt / name)
        except Exception as e:  # noqa: BLE001 - any failure to read a file (unpickling, safetensors, I/O) names it
            raise CheckpointError(f"checkpoint {ckpt} is incomplete or corrupt: {ckpt / name} cannot be read "
                                  f"({type(e).__name__}: {e})") from e

    def torch_file(p: Path) -> Any:
        return torch.load(p, map_location="cpu", weights_only=True)

    meta: dict[str, Any] = read("trainer.json", lambda p: json.loads(p.read_text()))
    if config is not None:
        check_compatible(saved, config, ckpt)
        if meta.get("fingerprints") is None:
            log.warning("checkpoint %s records no fingerprints of its models (written by an older version): the "
                        "models it was trained on are not checked", ckpt)
        check_fingerprints(meta.get("fingerprints") or {}, config, ckpt, run_dir)
    optim = read("optimizer.pt", torch_file)
    rng = read("rng.pt", torch_file)
    try:
        # learning-rate schedules and the adaptive KL coefficient: None in checkpoints written
        # before they existed (the learner then keeps its fresh ones)
        learner_state = LearnerState(
            version=int(meta["version"]), policy=read("adapter", read_lora_adapter),
            value=read("value.safetensors", lambda p: load_file(str(p))),
            policy_optimizer=optim["policy"], value_optimizer=optim["value"],
            rng=rng["learner"], cuda_rng=rng.get("learner_cuda", []),
            policy_scheduler=optim.get("policy_scheduler"), value_scheduler=optim.get("value_scheduler"),
            kl_coef=optim.get("kl_coef"))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {ckpt} is incomplete or corrupt: missing or bad entry {e}") from e
    # the step where the learning-rate schedule ends: the saved config's steps for checkpoints
    # written before the trainer recorded it
    # max_staleness: the adapters of the batches that were in flight (none before they were kept)
    behaviour = {int(v): read(f"{BEHAVIOUR}/v{int(v):06d}", read_lora_adapter) for v in meta.get("behaviour_versions", [])}
    trainer_state = {"planned_steps": saved.steps, **meta, "data_rng": rng["data"], "behaviour": behaviour}
    return ckpt, learner_state, trainer_state
