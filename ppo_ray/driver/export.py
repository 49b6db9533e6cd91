"""A finished run's LoRA, for use outside ppo-ray: `launch.py export` (docs/EXPORT.md).

    source = find_source("runs/x")            # a run directory, a checkpoint, or a PEFT adapter directory
    export(source, merged="/tmp/m")           # the base with the LoRA merged: safetensors + config + tokenizer
    export(source, adapter="/tmp/a")          # the PEFT adapter, its base named by hub id or absolute path

What is read, and where from:
- the adapter: a run directory's final ``adapter/`` (trainer.save_adapter), a checkpoint's
  ``adapter/`` (ppo_ray.driver.checkpoint; the checkpoint is verified against its checksums first), or
  a directory holding ``adapter_config.json`` itself. Tensors load with safetensors only.
- the base model: the PPO stage's config (the checkpoint's config.yaml: the newest intact
  checkpoint of a run directory), its ``model_name`` resolved (ppo_ray.paths: embedded:* to
  its directory, ${run_dir}/sft to where the run directory is now) to a hub id or an absolute
  path; and, when the checkpoint recorded the base's fingerprint, checked to hold the weights
  it was trained on. Without a config (a bare adapter directory) the adapter's own
  ``base_model_name_or_path``, which must then be a hub id or an existing directory.
- for the model card: the LoRA spec (adapter_config.json), the config's key fields, the
  report's headline numbers (report.json / report-ppo.json, only when the exported adapter is
  the run's final one), the step's metrics, run.json's run tags, and the checkpoint lineage
  (run id, checkpoint id, the chain of parents).

Every output directory is written whole or not at all (ppo_ray.atomic: a temp directory beside
it, renamed at the end); bad input is an ExportError naming the bad thing, raised before
anything is written.

Driver layer: imports ppo_ray.driver.checkpoint and the bottom (config, modeling, paths, tracking, atomic).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from ppo_ray.atomic import atomic_dir
from ppo_ray.driver.checkpoint import (CHECKSUMS, CheckpointError, ancestry, checkpoint_root, file_sha256, model_fingerprint,
                                read_meta, resolve_checkpoint, resumed_config, verify_checkpoint)
from ppo_ray.config import VLLM_LORA_RANKS, PPOConfig
from ppo_ray.modeling import DTYPES
from ppo_ray.paths import resolve_model_path
from ppo_ray.tracking import read_run_file

log = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
CARD = "README.md"
REPORTS = ("report.json", "report-ppo.json")  # the pipeline's, then the PPO stage's alone
# The config fields a model card names (the whole config is in the run directory).
CARD_FIELDS = ("task", "dataset", "reward_funcs", "reward_weights", "reward_model_name", "advantage_estimator",
               "policy_loss", "steps", "batch_size", "samples_per_prompt", "ppo_epochs", "learning_rate", "kl_coef",
               "kl_target", "clip_epsilon", "temperature", "max_prompt_length", "max_new_tokens", "dtype", "seed")


class ExportError(ValueError):
    """Input an export cannot use (a directory with no adapter, an output that exists, an
    unknown dtype, a base model that is missing or changed): the message names it."""


@dataclass
class ExportSource:
    """What an export reads: the adapter, its base, and what the model card says about them."""

    path: Path                          # what was named (absolute)
    adapter: Path                       # the PEFT adapter directory
    adapter_config: dict                # its adapter_config.json
    base_model: str                     # a hub id or an absolute directory
    model_name: Optional[str]           # the base as the run's config names it (embedded:tiny, ${run_dir}/sft, ...)
    run_dir: Optional[Path] = None
    checkpoint: Optional[Path] = None   # the checkpoint this adapter is (or is identical to)
    config: Optional[PPOConfig] = None  # the PPO stage's config
    final: bool = False                 # the run's final adapter (its report describes this adapter)
    notes: list[str] = field(default_factory=list)  # what the card should say about how the source was found

    @property
    def dtype(self) -> str:
        """The run's dtype (config.dtype), else the base's stored one, else float32."""
        if self.config is not None:
            return self.config.dtype
        stored = _base_config(self.base_model).get("dtype") or _base_config(self.base_model).get("torch_dtype")
        return stored if stored in DTYPES else "float32"


# --------------------------------------------------------------------------- finding the source
def _base_config(base: str) -> dict:
    try:
        return json.loads((Path(base) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _looks_like_path(name: str) -> bool:
    """A model name that can only be a local path (a hub id is `name` or `org/name`)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def _check_adapter(adapter: Path) -> dict:
    """adapter_config.json of a LoRA adapter directory with safetensors weights, or ExportError."""
    config_path, weights = adapter / ADAPTER_CONFIG, adapter / ADAPTER_WEIGHTS
    if not config_path.is_file():
        raise ExportError(f"{adapter} is not a PEFT adapter: no {ADAPTER_CONFIG}")
    if not weights.is_file():
        other = sorted(p.name for p in adapter.glob("adapter_model.*"))
        raise ExportError(f"{adapter} has no {ADAPTER_WEIGHTS}" + (
            f" (it has {', '.join(other)}: weights load with safetensors only)" if other else ""))
    try:
        config = json.loads(config_path.read_text())
    except ValueError as e:
        raise ExportError(f"{config_path} is not JSON: {e}") from e
    if config.get("peft_type") != "LORA":
        raise ExportError(f"{config_path}: peft_type {config.get('peft_type')!r}, not a LoRA adapter")
    return config


def _base_from_config(config: PPOConfig, where: Path) -> str:
    """The config's model_name as a hub id or an absolute directory that exists."""
    try:
        resolved = resolve_model_path(config.model_name)
    except FileNotFoundError as e:
        raise ExportError(f"the base model of {where}: {e}") from e
    path = Path(resolved).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if _looks_like_path(resolved):
        raise ExportError(f"the base model of {where}, model_name {config.model_name!r} ({resolved}), is missing: "
                          "the run's base (its SFT stage, for the pipeline) must be where the run left it")
    return resolved  # a hub id


def _base_from_adapter(adapter_config: dict, adapter: Path) -> str:
    """A bare adapter's base_model_name_or_path, if it is usable as written."""
    name = adapter_config.get("base_model_name_or_path")
    if not name:
        raise ExportError(f"{adapter / ADAPTER_CONFIG} names no base_model_name_or_path, and no run config says "
                          "which base it was trained on")
    path = Path(name).expanduser()
    if path.is_absolute() and path.is_dir():
        return str(path)
    if not _looks_like_path(name) and not path.exists():
        return name  # a hub id
    raise ExportError(f"{adapter / ADAPTER_CONFIG} names its base {name!r}, which is not a hub id or an existing "
                      "absolute directory; export the run directory or checkpoint it came from (its config names "
                      "the base), or fix base_model_name_or_path")


def _adapter_digest_in(ckpt: Path) -> Optional[str]:
    try:
        return json.loads((ckpt / CHECKSUMS).read_text()).get(f"{ADAPTER_DIR}/{ADAPTER_WEIGHTS}")
    except (OSError, ValueError, AttributeError):
        return None


def find_source(path: str | Path) -> ExportSource:
    """The adapter, base and card facts of a run directory, a checkpoint or an adapter directory
    (see the module docstring); ExportError naming what is wrong."""
    named = Path(path).expanduser()
    if not named.exists():
        raise ExportError(f"{path}: no such directory")
    if not named.is_dir():
        raise ExportError(f"{path} is not a directory (expected a run directory, a checkpoint or an adapter)")
    named = named.resolve()
    try:
        if (named / "trainer.json").is_file() or (named / CHECKSUMS).is_file():
            return _from_checkpoint(named)
        if (named / ADAPTER_CONFIG).is_file() or (named / ADAPTER_WEIGHTS).is_file():
            config = _check_adapter(named)
            return ExportSource(named, named, config, _base_from_adapter(config, named), None,
                                notes=["a bare adapter directory: no run config or lineage"])
        if (named / ADAPTER_DIR).is_dir():
            return _from_run_dir(named)
    except CheckpointError as e:
        raise ExportError(str(e)) from e
    hint = ""
    if any(checkpoint_root(named).glob("step-*")):
        with contextlib.suppress(CheckpointError):
            hint = (f"; it has checkpoints but no final {ADAPTER_DIR}/ (a run that has not finished): export a "
                    f"checkpoint, e.g. launch.py export {resolve_checkpoint(named)}")
    raise ExportError(f"{path} holds no adapter: expected a run directory with {ADAPTER_DIR}/ (written when the "
                      f"PPO stage finishes), a checkpoint (checkpoints/step-N, with {ADAPTER_DIR}/ and trainer.json) "
                      f"or a PEFT adapter directory ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}){hint}")


def _from_checkpoint(ckpt: Path) -> ExportSource:
    verify_checkpoint(ckpt)  # a damaged checkpoint is named, never exported
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None
    adapter = ckpt / ADAPTER_DIR
    adapter_config = _check_adapter(adapter)
    config = resumed_config(ckpt, run_dir or ckpt.parent)
    base = _base_from_config(config, ckpt)
    _check_fingerprint(ckpt, config)
    final = run_dir is not None and (run_dir / ADAPTER_DIR / ADAPTER_WEIGHTS).is_file() and \
        file_sha256(run_dir / ADAPTER_DIR / ADAPTER_WEIGHTS) == file_sha256(adapter / ADAPTER_WEIGHTS)
    return ExportSource(ckpt, adapter, adapter_config, base, config.model_name, run_dir, ckpt, config, final)


def _from_run_dir(run_dir: Path) -> ExportSource:
    adapter = run_dir / ADAPTER_DIR
    adapter_config = _check_adapter(adapter)
    notes: list[str] = []
    newest = None
    if any(checkpoint_root(run_dir).glob("step-*")):
        newest = resolve_checkpoint(run_dir)  # the PPO stage's config, which names the policy's base
    if newest is None:
        base = _base_from_adapter(adapter_config, adapter)
        notes.append("the run directory has no checkpoint: the base is the adapter's base_model_name_or_path, and "
                     "no training config or lineage is known")
        return ExportSource(run_dir, adapter, adapter_config, base, None, run_dir, None, None, True, notes)
    config = resumed_config(newest, run_dir)
    base = _base_from_config(config, run_dir)
    _check_fingerprint(newest, config)
    digest = file_sha256(adapter / ADAPTER_WEIGHTS)
    same = next((c for c in ancestry(newest) if _adapter_digest_in(c) == digest), None)
    if same is None:
        notes.append(f"{ADAPTER_DIR}/ is identical to none of the run's checkpoints still present (newest: "
                     f"{newest.name}); the config is {newest.name}'s")
    return ExportSource(run_dir, adapter, adapter_config, base, config.model_name, run_dir, same, config,
                        True, notes)


def _check_fingerprint(ckpt: Path, config: PPOConfig) -> None:
    """ExportError when the base now holds other weights than the ones the checkpoint was
    trained on (a stage re-run since): the LoRA would be merged onto the wrong model."""
    saved = ((read_meta(ckpt) or {}).get("fingerprints") or {}).get("model_name")
    if saved is None:
        return
    now = model_fingerprint(config.model_name)
    if now != saved:
        raise ExportError(f"checkpoint {ckpt} was trained on {config.model_name} holding {saved}; it now holds "
                          f"{now} (a stage re-run since?): its LoRA does not belong on that base")


# --------------------------------------------------------------------------- outputs
def check_output(out: str | Path, what: str) -> Path:
    """An output directory that does not exist, or exists empty; ExportError otherwise."""
    out = Path(out).expanduser().absolute()
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ExportError(f"{what} {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise ExportError(f"{what} {out} exists and is not empty: name a new directory (nothing is written over)")
    return out


def check_dtype(dtype: Optional[str]) -> Optional[str]:
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: unknown; one of {', '.join(DTYPES)}")
    return dtype


def load_lora_model(source: ExportSource):
    """The base (float32, safetensors only) with the source's LoRA on it, as a PeftModel in eval
    mode; ExportError when the adapter's tensors do not fit that base."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    from ppo_ray.modeling import load_causal_lm

    try:
        base = load_causal_lm(source.base_model, "float32", use_safetensors=True)
    except (OSError, ValueError) as e:
        raise ExportError(f"base model {source.base_model}: cannot be loaded with safetensors weights ({e})") from e
    lora = LoraConfig.from_pretrained(str(source.adapter))
    lora.inference_mode = True
    model = get_peft_model(base, lora)
    tensors = load_file(str(source.adapter / ADAPTER_WEIGHTS))
    expected = get_peft_model_state_dict(model)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    wrong = sorted(k for k in set(expected) & set(tensors) if expected[k].shape != tensors[k].shape)
    if missing or unexpected or wrong:
        raise ExportError(f"{source.adapter / ADAPTER_WEIGHTS} does not fit base {source.base_model}: "
                          + "; ".join(f"{what} {names[:3]}{' ...' if len(names) > 3 else ''}" for what, names in
                                      (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
                                      if names))
    set_peft_model_state_dict(model, tensors)
    model.eval()
    return model


def export(source: ExportSource, *, merged: Optional[str | Path] = None, adapter: Optional[str | Path] = None,
           dtype: Optional[str] = None, command: Sequence[str] = ()) -> dict:
    """Write the merged model and/or the portable adapter (see the module docstring); returns
    {"merged": dir, "adapter": dir, "base_model": ..., "dtype": ...}. Each output is written
    into a temp directory and renamed into place once every output is complete; on any error
    none is renamed and no temp directory is left."""
    if merged is None and adapter is None:
        raise ExportError("nothing to export: give --merged OUT and/or --adapter OUT")
    check_dtype(dtype)
    if dtype is not None and merged is None:
        raise ExportError(f"--dtype {dtype} applies to --merged (the adapter keeps its trained float32 tensors)")
    outs = {what: check_output(out, what) for what, out in (("--merged", merged), ("--adapter", adapter))
            if out is not None}
    if len(set(outs.values())) < len(outs):
        raise ExportError(f"--merged and --adapter name the same directory {outs['--merged']}")
    dtype = dtype or source.dtype
    summary: dict[str, Any] = {"source": str(source.path), "base_model": source.base_model}
    with contextlib.ExitStack() as stack:
        if merged is not None:
            model = load_lora_model(source)  # before any directory is made: a LoRA that does not fit writes nothing
            tmp = stack.enter_context(atomic_dir(outs["--merged"]))
            _write_merged(source, model, dtype, tmp)
            (tmp / CARD).write_text(model_card(source, "merged", dtype, command))
            summary.update(merged=str(outs["--merged"]), dtype=dtype)
        if adapter is not None:
            tmp = stack.enter_context(atomic_dir(outs["--adapter"]))
            _write_adapter(source, tmp)
            (tmp / CARD).write_text(model_card(source, "adapter", None, command))
            summary["adapter"] = str(outs["--adapter"])
    return summary


def _write_merged(source: ExportSource, model, dtype: str, out: Path) -> None:
    """PEFT's merge_and_unload (W0 + (alpha/r) B A, computed in float32), then cast to `dtype`
    and saved as safetensors with the training tokenizer (ppo_ray.modeling.load_tokenizer: the
    pad token the run used)."""
    from ppo_ray.modeling import load_tokenizer

    log.info("merging %s into %s (%s)", source.adapter, source.base_model, dtype)
    merged = model.merge_and_unload()
    merged.to(DTYPES[dtype])
    merged.save_pretrained(str(out), safe_serialization=True)
    load_tokenizer(source.base_model).save_pretrained(str(out))


def _write_adapter(source: ExportSource, out: Path) -> None:
    """The adapter's tensors as they are (bytes copied) and PEFT's own config writer with
    base_model_name_or_path set to the hub id or absolute path of the base."""
    from peft import LoraConfig

    (out / ADAPTER_WEIGHTS).write_bytes((source.adapter / ADAPTER_WEIGHTS).read_bytes())
    lora = LoraConfig.from_pretrained(str(source.adapter))
    lora.base_model_name_or_path = source.base_model
    lora.save_pretrained(str(out))


# --------------------------------------------------------------------------- the model card
def serving_rank(r: int) -> int:
    """vLLM's --max-lora-rank for an adapter of rank r: the smallest rank it accepts >= r."""
    return min(k for k in VLLM_LORA_RANKS if k >= r)


def headline(run_dir: Optional[Path]) -> dict[str, float]:
    """The finite numbers of the run's reports (report.json, then report-ppo.json's others)."""
    found: dict[str, float] = {}
    for name in REPORTS:
        try:
            report = json.loads((run_dir / name).read_text()) if run_dir is not None else {}
        except (OSError, ValueError):
            continue
        for key, value in report.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                    and key not in found:
                found[key] = value
    return found


def _step_metrics(run_dir: Optional[Path], step: int) -> dict:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines() if run_dir is not None else []
    except OSError:
        return {}
    for line in reversed(lines):
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if row.get("step") == step:
                return row
    return {}


def lineage(ckpt: Optional[Path]) -> list[str]:
    """Card lines: the checkpoint, its run and the chain of parents it continues."""
    if ckpt is None:
        return []
    meta = read_meta(ckpt) or {}
    lines = [f"- checkpoint: `{ckpt.name}` (step {meta.get('step')}, adapter version {meta.get('version')}, "
             f"checkpoint id `{meta.get('checkpoint_id')}`, run id `{meta.get('run_id')}`)"]
    chain = ancestry(ckpt)  # the parents still in the run directory (pruning keeps the newest few)
    names = [f"`{c.name}` (`{(read_meta(c) or {}).get('checkpoint_id')}`)" for c in chain[1:]]
    oldest = read_meta(chain[-1]) or {}
    if oldest.get("parent"):
        names.append(f"`{oldest['parent']}` (`{oldest.get('parent_id')}`, pruned)")
    lines.append("- continues: " + " <- ".join(names) if names else "- the run's first checkpoint (no parent)")
    return lines


def _value(value: Any) -> str:
    return f"`{json.dumps(value)}`" if not isinstance(value, str) else f"`{value}`"


def model_card(source: ExportSource, kind: str, dtype: Optional[str], command: Sequence[str]) -> str:
    """README.md of an export: what the base and the LoRA are, how the run was trained, what it
    scored, where it came from, and how to load it."""
    lora = source.adapter_config
    hub = not Path(source.base_model).is_absolute()
    front = ["---", f"library_name: {'peft' if kind == 'adapter' else 'transformers'}",
             *([f"base_model: {source.base_model}"] if hub else []), "tags: [ppo-ray, ppo, rlhf, lora]", "---", ""]
    title = "merged model (LoRA merged into the base)" if kind == "merged" else "LoRA adapter (PEFT)"
    lines = [*front, f"# ppo-ray export: {title}", "",
             f"- base model: `{source.base_model}`" + (f" (the run's model_name: `{source.model_name}`)"
                                                       if source.model_name and source.model_name != source.base_model
                                                       else ""),
             f"- LoRA: r={lora.get('r')}, lora_alpha={lora.get('lora_alpha')} (scaling "
             f"{lora.get('lora_alpha', 0) / max(lora.get('r') or 1, 1):g}), lora_dropout={lora.get('lora_dropout')}, "
             f"target modules: {', '.join(sorted(lora.get('target_modules') or []))}",
             *([f"- weights: {dtype}, safetensors (W = W0 + scaling * B @ A, merged in float32 by PEFT "
                "merge_and_unload, then cast)"] if kind == "merged" else
               ["- weights: adapter_model.safetensors as trained (float32)"]),
             f"- exported from: `{source.path}`", f"- made by: `{shlex.join(command) or 'ppo_ray.driver.export.export'}` "
             f"({time.strftime('%Y-%m-%d %H:%M:%S %Z')})", *[f"- note: {n}" for n in source.notes], ""]
    run = read_run_file(source.run_dir) if source.run_dir is not None else {}
    lines += ["## Lineage", "", f"- run directory: `{source.run_dir}`" if source.run_dir else "- run directory: none"]
    if run.get("run_tag"):
        lines.append(f"- run tag: `{run['run_tag']}`" + (f" (all: {', '.join(run.get('run_tags') or [])})"
                                                         if len(run.get("run_tags") or []) > 1 else ""))
    lines += lineage(source.checkpoint)
    if source.final:
        lines.append("- this is the run's final adapter")
    elif source.run_dir is not None and (source.run_dir / ADAPTER_DIR).is_dir():
        lines.append(f"- an intermediate checkpoint: the run's final {ADAPTER_DIR}/ differs from it")
    elif source.run_dir is not None:
        lines.append(f"- the run directory holds no final {ADAPTER_DIR}/ (a run that has not finished)")
    lines.append("")
    if source.config is not None:
        cfg = source.config
        lines += ["## Training config (key fields)", "", "| field | value |", "|---|---|"]
        lines += [f"| {name} | {_value(getattr(cfg, name))} |" for name in CARD_FIELDS
                  if getattr(cfg, name) not in (None, [], "")]
        lines.append("")
    numbers = headline(source.run_dir) if source.final else {}
    step = (read_meta(source.checkpoint) or {}).get("step") if source.checkpoint is not None else None
    metrics = _step_metrics(source.run_dir, step) if step is not None else {}
    if numbers or metrics:
        lines += ["## Results", ""]
    if numbers:
        lines += ["The run's report (" + ", ".join(n for n in REPORTS if (source.run_dir / n).is_file()) + "):", "",
                  "| | |", "|---|---|", *[f"| {k} | {v:.4g} |" for k, v in numbers.items()], ""]
    if metrics:
        keys = [k for k in ("reward_mean", "kl", "eval_reward", "gold_val", "pass1_val") if k in metrics]
        lines += [f"Step {step} (metrics.jsonl): " + ", ".join(f"{k} {metrics[k]:.4g}" for k in keys), ""]
    lines += ["## Use", ""]
    if kind == "merged":
        lines += ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
                  'model = AutoModelForCausalLM.from_pretrained("<this directory>")',
                  'tokenizer = AutoTokenizer.from_pretrained("<this directory>")', "```", "",
                  "`vllm serve <this directory>` serves it with no LoRA."]
    else:
        lines += ["```python", "from peft import PeftModel", "from transformers import AutoModelForCausalLM",
                  f'model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{source.base_model}"), '
                  '"<this directory>")', "```", "",
                  f"`vllm serve {source.base_model} --enable-lora --max-lora-rank {serving_rank(lora.get('r') or 1)} "
                  "--lora-modules ppo=<this directory>` serves it as model `ppo`."]
    return "\n".join(lines) + "\n"
