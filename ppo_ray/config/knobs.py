"""How a PPOConfig field declares itself, and the rules its value is checked by.

``knob(default, section, *roles, ...)`` is a field's one declaration (ppo_ray/config/fields.py
holds the fields): its section, the actors that read it, whether a resume must keep it, whether
it names a path or a model or puts a role on GPUs, its choices and its rules. A rule is
``rule(value, **others) -> why it is invalid, or None`` (at_least, at_most, within, finite,
not_empty, each, custom_resources); PPOConfig checks every declared rule, and keeps in its own
``_validate`` only the rules that relate fields. Also here: ConfigError, a value's coercion to a
field's type (``coerce``), and a field's type and default as --help and docs/CONFIG.md show them.
Imports nothing of ours.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import field
from typing import Any, Callable, Optional, Sequence

import yaml


class ConfigError(ValueError):
    """A config value, key or file that cannot be used. The message names it."""


# ---------------------------------------------------------------------- how a field declares itself
# The sections of --help and docs/CONFIG.md, in their order.
MODEL = "model and LoRA"
ALGORITHM = "PPO algorithm"
GENERATION = "generation"
REWARDS = "rewards"
DATA = "data"
STAGES = "SFT and reward-model stages"
EVALUATION = "evaluation"
RESOURCES = "resources and placement"
FAULTS = "fault tolerance"
LOGGING = "checkpoints and logging"
SPEED = "learner speed (same math up to rounding; defaults = the options measured faster)"
SECTIONS = (MODEL, ALGORITHM, GENERATION, REWARDS, DATA, STAGES, EVALUATION, RESOURCES, FAULTS, LOGGING, SPEED)
# The roles whose actors read fields (each actor gets a slice of the config: PPOConfig.slice,
# role_fields); the driver, the stages and the pipeline read the whole config.
LEARNER, GENERATOR, REFERENCE, REWARD = "learner", "generator", "reference", "reward"
ROLES = (LEARNER, GENERATOR, REFERENCE, REWARD)


class fresh(typing.NamedTuple):
    """knob's default for a mutable value: a new one from ``make()`` for every config."""

    make: Any


def knob(default: Any, section: str, *roles: str, must_match: bool = False, path: bool = False,
         model: bool = False, gpu: bool = False, choices: Any = None, check: Any = (),
         owner: Optional[tuple[str, str]] = None, doc: Optional[str] = None) -> Any:
    """A PPOConfig field, and everything the system does with it by kind, declared once, here:

    section: its --help / docs/CONFIG.md section (one of SECTIONS);
    roles: the actors that read it (their config slices: role_fields);
    must_match: a resume must keep it (it decides what the checkpoint's tensors are or how the
        run samples and learns: checkpoint.check_compatible);
    path: it may name a path inside the run directory (checkpoints store it as ${run_dir}/...);
    model: it names a model whose content a checkpoint fingerprints (implies path);
    gpu: it puts a role or stage on GPUs (PPOConfig.uses_gpus);
    choices: its valid values (a tuple, or a registry dict: its names; a list field's every entry);
        None passes for Optional fields;
    check: a rule, or a tuple of rules, each ``rule(value, **others) -> why it is invalid, or None``,
        called with the fields its keyword-only parameters name (at_least, at_most, within, finite,
        not_empty, each); a rule on the field's own value lives here, not in PPOConfig._validate,
        which keeps the rules that relate fields;
    owner: (selector, name) for a registered estimator's or policy loss's own parameter
        (learner.algos.Param), which applies when that one is selected;
    doc: the field's doc where it is not an attribute docstring (a registered Param's).
    A mutable default is ``fresh(list)``: a new one for every config."""
    if section not in SECTIONS:
        raise ValueError(f"knob: section {section!r} is not one of {SECTIONS}")
    unknown = set(roles) - set(ROLES)
    if unknown:
        raise ValueError(f"knob: unknown roles {sorted(unknown)}; roles: {ROLES}")
    meta = {"section": section, "roles": tuple(roles), "must_match": must_match, "path": path or model,
            "model": model, "gpu": gpu, "choices": choices, "owner": owner, "doc": doc,
            "check": tuple(check) if isinstance(check, (tuple, list)) else (check,)}
    if isinstance(default, fresh):
        return field(default_factory=default.make, metadata=meta)
    return field(default=default, metadata=meta)


def at_least(low: float, *, strict: bool = False, null: Optional[str] = None, finite: bool = True,
             why: str = "") -> Callable:
    """knob's rule: value >= low (> low when strict), finite unless `finite` is False (then inf
    passes); None passes where null is given (its text says what null means; "" for nothing);
    `why` is added to the message."""
    def rule(value: Any) -> Optional[str]:
        if value is None and null is not None:
            return None
        if (math.isfinite(value) or not finite) and (value > low if strict else value >= low):
            return None
        return (f"must be {'>' if strict else '>='} {low:g}" + (" or null" if null is not None else "")
                + (f" ({null})" if null else "") + why)
    return rule


def at_most(high: float, *, why: str = "") -> Callable:
    """knob's rule: value <= high; `why` is added to the message."""
    def rule(value: Any) -> Optional[str]:
        return None if value <= high else f"must be <= {high:g}{why}"
    return rule


def within(low: float, high: float, *, open_low: bool = False, open_high: bool = False) -> Callable:
    """knob's rule: low <= value <= high (an open end excludes it)."""
    def rule(value: Any) -> Optional[str]:
        if (value > low if open_low else value >= low) and (value < high if open_high else value <= high):
            return None
        return f"must be in {'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"
    return rule


def finite(null: Optional[str] = None) -> Callable:
    """knob's rule: a finite number; None passes where null is given (its text says what it means)."""
    def rule(value: Any) -> Optional[str]:
        if (value is None and null is not None) or (value is not None and math.isfinite(value)):
            return None
        return "must be finite" + (" or null" if null is not None else "") + (f" ({null})" if null else "")
    return rule


def not_empty(null: Optional[str] = None) -> Callable:
    """knob's rule: a string with more than white space, or a list with an entry; None passes
    where null says what it means."""
    def rule(value: Any) -> Optional[str]:
        if value is None:
            ok = null is not None
        else:
            ok = bool(value.strip()) if isinstance(value, str) else len(value) > 0
        return None if ok else "must not be empty" + (f" ({null})" if null else "")
    return rule


def each(rule: Callable[[Any], Optional[str]]) -> Callable:
    """knob's rule for a list: `rule` (of one value) holds for every entry; the message names
    the first entry that breaks it."""
    def every(values: Sequence[Any]) -> Optional[str]:
        for value in values:
            why = rule(value)
            if why is not None:
                return f"entry {value!r} {why}"
        return None
    return every


def custom_resources(value: Optional[dict[str, float]]) -> Optional[str]:
    """knob's rule for a Ray resources mapping: custom names only (CPU and GPU have their own
    fields, and Ray refuses them in `resources` too), amounts Ray can count (units of 1e-4)."""
    for key, amount in (value or {}).items():
        if key in ("CPU", "GPU", "memory", "object_store_memory"):
            return f"{key!r} is not a custom resource (use the *_num_cpus / *_num_gpus fields)"
        if not key.strip():
            return "resource names must not be empty"
        if not (math.isfinite(amount) and amount >= 1e-4):
            return f"{key}: amounts must be finite and >= 0.0001"
    return None


def type_name(hint: Any) -> str:
    """A field's type as --help and docs/CONFIG.md show it: `float|null`, `list[str]`, `{str: float}`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:  # Optional[X]
        return f"{type_name(next(a for a in args if a is not type(None)))}|null"
    if origin is list:
        return f"list[{type_name(args[0])}]"
    if origin is dict:
        return f"{{{type_name(args[0])}: {type_name(args[1])}}}"
    return hint.__name__


def default_text(f: dataclasses.Field) -> str:
    """A field's default as YAML writes it (`null`, `true`, `[tensorboard]`, `{}`)."""
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
    return yaml.safe_dump(value, default_flow_style=True, width=math.inf).removesuffix("...\n").strip()


def coerce(name: str, value: Any, hint: Any) -> Any:
    """Coerce a YAML/CLI value to the field's type, or raise ConfigError naming the field."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union:  # Optional[X]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        inner = [a for a in args if a is not type(None)][0]
        return coerce(name, value, inner)
    if origin is dict:  # YAML mapping; on the CLI a flow mapping: --generator_resources '{gpu_node: 0.01}'
        if value == "" or value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"config field '{name}' = {value!r} must be a mapping, e.g. {{name: 0.01}}")
        return {coerce(name, k, args[0]): coerce(name, v, args[1]) for k, v in value.items()}
    if origin is list:
        if isinstance(value, str):
            value = [v for v in (s.strip() for s in value.split(",")) if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config field '{name}' = {value!r} must be a list")
        return [coerce(name, v, args[0]) for v in value]
    try:
        if hint is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                return value.lower() in ("true", "1", "yes")
            raise TypeError
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            return int(value)
        if hint is float:
            if isinstance(value, bool):
                raise TypeError
            out = float(value)
            if math.isnan(out):
                raise TypeError
            return out
        if hint is str:
            if not isinstance(value, str):
                raise TypeError
            return value
    except (TypeError, ValueError):
        pass
    else:
        return value
    raise ConfigError(f"config field '{name}' = {value!r} must be of type {getattr(hint, '__name__', hint)}")
