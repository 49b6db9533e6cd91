"""The command line built from PPOConfig: ConfigParser (launch.py's options, --help by
section) and parse_overrides (``--config FILE|PRESET`` then ``--field VALUE`` overrides).
"""

from __future__ import annotations

import argparse
import typing
from typing import Any, Sequence

import yaml

from ppo_ray.config.fields import PPOConfig, check_keys, field_docs, field_sections, preset_names
from ppo_ray.config.knobs import ConfigError, default_text, type_name


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """`--name TYPE   doc (default: ...)`: a field's first spelling only (its dashed alias,
    --name-with-dashes, works too), the description (launch.py's docstring) as written."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        return f"{action.option_strings[0]} {action.metavar}"


def _yaml_value(text: str) -> Any:
    """argparse `type` of a field's option: the text as a YAML scalar or flow collection
    (`null`, `true`, `0.1`, `{gpu_node: 0.01}`); "" stays "". PPOConfig coerces it to the
    field's type and checks it (errors name the field)."""
    if text == "":
        return ""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:  # argparse names the option
        raise argparse.ArgumentTypeError(f"{text!r} is not a YAML value ({getattr(e, 'problem', None) or e})") from e


class ConfigParser(argparse.ArgumentParser):
    """The command line built from PPOConfig: `--config FILE|PRESET`, then one `--field VALUE` option
    per field (also spelled `--field-name`; `--field=VALUE` too), grouped by SECTIONS, each
    with its type, default and doc in --help. Values are YAML (`--value_clip null`,
    `--reward_funcs a:f,b:g`, `--generator_resources '{gpu_node: 0.01}'`).

    Every error raises ConfigError naming the option (argparse would print and exit): an
    unknown option names the closest field; abbreviations are not accepted (a prefix of a
    field must not silently pick one). The caller may add options of its own (launch.py's
    --run_dir, --resume) before parse(). `config_option=False`: --config is still parsed (so
    that the caller can refuse it with its reason) but not listed in --help.
    """

    def __init__(self, config_option: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("usage", "%(prog)s [--config FILE|PRESET] [--<field> VALUE ...]")
        super().__init__(allow_abbrev=False, exit_on_error=False, add_help=False, formatter_class=_HelpFormatter,
                         **kwargs)
        self.add_argument("-h", "--help", action="store_true", help="show this message and exit")
        self.add_argument("--config", metavar="FILE|PRESET",
                          help="YAML file of field: value pairs, or a shipped preset's name "
                               f"({', '.join(preset_names())}), loaded first; the --<field> options override it"
                          if config_option else argparse.SUPPRESS)
        hints, docs = typing.get_type_hints(PPOConfig), field_docs()
        for title, fields in field_sections():
            group = self.add_argument_group(title)
            for f in fields:
                dashed = f.name.replace("_", "-")
                group.add_argument(f"--{f.name}", *([f"--{dashed}"] if dashed != f.name else []), dest=f.name,
                                   metavar=type_name(hints[f.name]), type=_yaml_value,
                                   default=argparse.SUPPRESS,
                                   help=f"{docs[f.name]} (default: {default_text(f)})".replace("%", "%%"))

    def error(self, message: str) -> typing.NoReturn:  # argparse's own: it would print usage and exit
        raise ConfigError(f"command line: {message}")

    def parse(self, argv: Sequence[str]) -> tuple[argparse.Namespace, dict[str, Any], list[str]]:
        """(the options that are not fields, the fields given, the positional arguments)."""
        try:
            args, rest = self.parse_known_args(list(argv))
        except argparse.ArgumentError as e:
            option = (e.argument_name or "").split("/")[0]  # argparse joins the spellings: --a_b/--a-b
            if e.message == "expected one argument":
                raise ConfigError(f"command-line option {option} needs a value") from None
            raise ConfigError(f"command-line option {option}: {e.message}") from None
        fields = set(PPOConfig.field_names())
        overrides = {k: v for k, v in vars(args).items() if k in fields}
        options = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in fields})
        if options.help:
            return options, overrides, []
        unknown = {arg.split("=", 1)[0][2:].replace("-", "_"): None for arg in rest if arg.startswith("--")}
        check_keys(unknown, source="command line", prefix="--")
        return options, overrides, rest


def parse_overrides(argv: Sequence[str]) -> tuple[PPOConfig, list[str]]:
    """Parse `--config FILE` and `--field value` / `--field=value` options (ConfigParser):
    the config (the file's fields, then the options on top) and the positional arguments."""
    options, overrides, positional = ConfigParser().parse(argv)
    if options.config is None:
        return PPOConfig(**overrides), positional
    return PPOConfig.from_yaml(options.config, **overrides), positional
