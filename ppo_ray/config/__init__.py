"""PPOConfig: one config tree for a PPO run.

A config is built three ways, all validated the same way (in ``__post_init__``):

    PPOConfig(kl_coef=0.05)                      # Python
    PPOConfig.from_yaml("configs/tiny.yaml")     # a YAML file, or a preset's name: "tiny"
    PPOConfig.from_args(["--config", "tiny", "--kl_coef", "0.05"])  # the CLI

Invalid values and unknown keys raise ``ConfigError`` naming the field (and, for an
unknown key, the closest valid name).

A field declares itself once, where it is declared: ``knob(default, section, *roles, ...)``
says its section, the actors that read it, whether a resume must keep it, whether it names a
path or a model or puts a role on GPUs, its choices and its range rules; its doc is the
attribute docstring under it. Everything else is derived: the actors' config slices
(``role_fields``), resume matching and path handling (``MUST_MATCH``, ``PATH_FIELDS``,
``MODEL_FIELDS``), ``GPU_FIELDS``, the checks, ``launch.py --help`` (``ConfigParser``) and
docs/CONFIG.md's tables (``fields_markdown()``). The seeds' names stay flat (one dataclass, not
nested sections): a field is ``PPOConfig(kl_coef=0.05)``, ``--kl_coef`` and ``kl_coef:`` in YAML
alike, and every checkpoint's config.yaml keeps loading. A registered advantage estimator's or
policy loss's own parameters (learner.algos.Param) are declared at their registration and added
as fields of the learner (``_registered_params``); the choices of ``advantage_estimator`` and
``policy_loss`` are the registries' names. Each registered estimator, policy loss and loss
aggregation also declares the knobs it shares with the others and reads; a knob the selected
ones do not read, set away from its default, is refused (``ignored_knobs``, the one check),
except a file's knob that an override's selection leaves behind, and knobs an older run saved,
which go back to their defaults with a warning (``from_yaml``, ``from_saved``, ``replace``).

The package, one subject per module, each importing only the ones above it:

    knobs.py       the declaration machinery: knob(), sections, roles, the rules (at_least,
                   within, ...), ConfigError, coercion of a value to a field's type
    sync_modes.py  the LoRA sync modes' registry: each mode's class and what it can hold
                   (SYNC_MODES, SyncCapabilities; PPOConfig.sync_capabilities)
    fields.py      PPOConfig's fields and the checks that relate them, the enumerations, loading
                   (YAML, presets, renamed keys), config slices, knobs a selection ignores
    cli.py         the command line: ConfigParser (launch.py --help), parse_overrides
    docs.py        docs/CONFIG.md's generated tables: fields_markdown, write_config_docs

Every name is imported from here (``from ppo_ray.config import PPOConfig``), not from the
modules. Of ours, the package imports only the pure-math registries (learner.algos,
learner.losses: torch and the standard library).
"""

from ppo_ray.config.knobs import (ALGORITHM, DATA, EVALUATION, FAULTS, GENERATION, GENERATOR, LEARNER, LOGGING, MODEL,
                                  REFERENCE, RESOURCES, REWARD, REWARDS, ROLES, SECTIONS, SPEED, STAGES, ConfigError,
                                  at_least, at_most, custom_resources, default_text, each, finite, fresh, knob,
                                  not_empty, type_name, within)
from ppo_ray.config.sync_modes import SYNC_MODES, SyncCapabilities, modes_with, sync_mode
from ppo_ray.config.fields import (ALL_PROJECTIONS, DATA_FILE_SUFFIXES, DTYPE_NAMES, GPU_FIELDS, LOG_LEVELS,
                                   LOGPROB_GAP_TOLERANCE, LORA_SYNC_MODES, MAX_STALENESS, MIN_TEMPERATURE, MODEL_FIELDS,
                                   MUST_MATCH, PATH_FIELDS, PRESETS_DIR, RENAMED, REPORT_TO, TASKS, TINY_MODEL,
                                   TRUNCATION_MODES, VLLM_LORA_RANKS, ConfigSlice, PPOConfig, field_docs,
                                   field_sections, fields_where, ignored_knobs, one_split_per_file, preset_names,
                                   read_yaml, resolve_config, reward_source, role_fields, selection_reads)
from ppo_ray.config.cli import ConfigParser, parse_overrides
from ppo_ray.config.docs import CONFIG_DOCS_MARKERS, fields_markdown, write_config_docs

__all__ = [
    # the config and its errors
    "PPOConfig", "ConfigError", "ConfigSlice",
    # the declaration machinery and its rules
    "knob", "fresh", "at_least", "at_most", "within", "finite", "not_empty", "each", "custom_resources",
    "one_split_per_file", "reward_source", "SECTIONS", "MODEL", "ALGORITHM", "GENERATION", "REWARDS", "DATA",
    "STAGES", "EVALUATION", "RESOURCES", "FAULTS", "LOGGING", "SPEED", "ROLES", "LEARNER", "GENERATOR",
    "REFERENCE", "REWARD",
    # the enumerations and constants the fields and the roles share
    "ALL_PROJECTIONS", "DTYPE_NAMES", "TRUNCATION_MODES", "LORA_SYNC_MODES", "LOGPROB_GAP_TOLERANCE",
    "DATA_FILE_SUFFIXES", "TINY_MODEL", "PRESETS_DIR", "VLLM_LORA_RANKS", "MIN_TEMPERATURE", "MAX_STALENESS",
    "RENAMED", "REPORT_TO", "LOG_LEVELS", "TASKS",
    # the LoRA sync modes and what each can hold
    "SYNC_MODES", "SyncCapabilities", "sync_mode", "modes_with",
    # derived from the declarations
    "MUST_MATCH", "PATH_FIELDS", "MODEL_FIELDS", "GPU_FIELDS", "field_docs", "field_sections", "fields_where",
    "role_fields", "selection_reads", "ignored_knobs", "type_name", "default_text",
    # files, the command line, the docs
    "preset_names", "resolve_config", "read_yaml", "ConfigParser", "parse_overrides", "fields_markdown",
    "CONFIG_DOCS_MARKERS", "write_config_docs",
]
