"""A flow's parameters from its command line: one flag per field of its pydantic model, over a settings file.

Values come, in increasing priority, from the model's defaults, one section of a YAML file (``--config
params.yaml``: :mod:`flows.config_file`), that file's ``profiles.<profile>.<section>`` overrides for its selected
``profile`` (or ``--profile NAME``), and the flags. A flag's value is read as YAML, so ``--limit 20``, ``--stop
'["</answer>"]'`` and ``--seed null`` all work; pydantic validates the result and a bad value exits with its
message. Flags are never abbreviated. ``--show-config`` prints the settings so resolved, each with where its value
came from, and exits without running anything.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NoReturn

import yaml
from pydantic import ValidationError

from a5core.runtime.settings import Settings, setting_location
from flows.config_file import ConfigError, Params, config_layers, deep_merge, hidden_problems, load_yaml


def _refuse(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Exit status 2 with one line (no usage: the message names the file, the place or the flag)."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def parse_params(model: type[Params], section: str, argv: list[str] | None = None, description: str = "") -> Params:
    """Build ``model`` from defaults < ``--config FILE`` section ``section`` < its profile's overrides <
    command-line flags. ``--show-config``: print the settings and where each came from
    (:func:`show_config`), then exit 0."""
    parser = _parser(model, section, description)
    args = vars(parser.parse_args(argv))
    config, profile, show = args.pop("config"), args.pop("_profile"), args.pop("_show_config")
    if profile is not None and config is None:
        _refuse(parser, f"--profile {profile}: a profile of a settings file; give the file with --config")
    sources: dict[str, str] = {}  # setting → where its value came from, for --show-config
    layers = [] if config is None else _config_layers(parser, model, section, config, profile, sources)
    layers.append(("", _flag_values(parser, args, sources)))
    values: dict[str, Any] = {}
    for _, layer in layers:
        values = deep_merge(values, layer)
    try:
        params = model(**values)
    except ValidationError as e:
        problems = "; ".join(map(_flag_problem, e.errors()))
        _refuse(parser, f"invalid parameters: {problems}")
    hidden = hidden_problems(model, values, layers)
    if hidden:
        _refuse(parser, f"invalid parameters: {hidden}")
    if show:
        print(show_config(params, section, sources))
        parser.exit(0)
    return params


def argument_parser(description: str | None) -> argparse.ArgumentParser:
    """Every command line's parser: a flag is taken only as it is spelt in full (argparse would take a prefix of
    one, and ``--epochs 3`` set ``epochs_per_rollout_batch``)."""
    return argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )


def _parser(model: type[Settings], section: str, description: str) -> argparse.ArgumentParser:
    """The command line of a flow of parameters ``model``: --config, --profile, --show-config, a flag a field."""
    parser = argument_parser(description)
    parser.add_argument("--config", type=Path, help=f"YAML file whose `{section}` section sets parameters")
    parser.add_argument(
        "--profile",
        dest="_profile",
        metavar="NAME",
        help="with --config: use this profile's overrides instead of the file's `profile`",
    )
    parser.add_argument(
        "--show-config",
        dest="_show_config",
        action="store_true",
        help="print the settings a run would take, each with where its value comes from, and exit without running",
    )
    for name, field in model.flat_fields().items():
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            metavar="VALUE",
            help=f"{field.description or name} (default: {field.default!r})",
        )
    return parser


def _config_layers(
    parser: argparse.ArgumentParser,
    model: type[Settings],
    section: str,
    config: Path,
    profile_flag: str | None,
    sources: dict[str, str],
) -> list[tuple[str, dict[str, Any]]]:
    """:func:`config_layers`, each key's source (the file's section, or the profile) recorded in ``sources``; a
    file that cannot be read, or a key ``model`` has no field for, exits (:func:`_refuse`)."""
    try:
        profile, layers = config_layers(model, section, config, profile_flag)
    except ConfigError as error:
        _refuse(parser, str(error))
    (_, base), (_, overrides) = layers
    sources.update({**dict.fromkeys(base, f"{config} {section}"), **dict.fromkeys(overrides, f"profile {profile}")})
    return layers


def yaml_value(raw: str) -> Any:
    """A flag's value read as YAML (an argparse ``type=``); ``argparse.ArgumentTypeError`` saying why when it is not
    YAML."""
    try:
        return load_yaml(raw)
    except (yaml.YAMLError, RecursionError) as error:
        raise argparse.ArgumentTypeError(f"not a YAML value ({getattr(error, 'problem', None) or error})") from None


def _flag_values(parser: argparse.ArgumentParser, args: dict[str, Any], sources: dict[str, str]) -> dict[str, Any]:
    """The flags given, each value read as YAML (a value that is not YAML exits), recorded in ``sources``."""
    values = {}
    for name, raw in args.items():
        if raw is None:
            continue
        flag = f"--{name.replace('_', '-')}"
        try:
            values[name] = yaml_value(raw)
        except argparse.ArgumentTypeError as error:
            _refuse(parser, f"{flag} {raw!r}: {error}")
        sources[name] = flag
    return values


def _flag_problem(error: Any) -> str:
    """One of pydantic's errors as the flag it names: ``--flag[index] 'value': message``."""
    loc = setting_location(error["loc"])
    if not loc:  # a check across fields: no single flag to name
        return error["msg"]
    index = "".join(f"[{i}]" for i in loc[1:] if isinstance(i, int))
    flag = f"--{str(loc[0]).replace('_', '-')}{index}"
    return f"{flag} {error.get('input')!r}: {error['msg']}"


def declared_in(model: type[Settings], name: str) -> str:
    """The class whose body gives setting ``name`` of ``model`` its default (module and name)."""
    cls = model.declaring_class(name)
    return f"{cls.__module__}.{cls.__qualname__}"


def _flow_yaml(value: Any) -> str:
    """``value`` (JSON-like) as one line of YAML flow style: ``1.0e-05``, ``[128, full]``, ``null``."""
    return yaml.safe_dump([value], default_flow_style=True, width=float("inf")).strip()[1:-1]


def show_config(params: Settings, section: str, sources: dict[str, str]) -> str:
    """``params`` as YAML, section ``section``, each setting commented with where its value came from: a
    ``default`` (the class that declares it), the file's section, a profile or a flag; then, for an ablation
    (``params.ablation``), what each of its children sets (:mod:`flows.ablations`)."""
    values = params.flat(mode="json")
    rows: list[tuple[str, str | None]] = [
        ("# The settings this command runs with, each followed by where its value comes from", None),
        (f"{section}:", None),
    ]
    rows += [
        (f"  {name}: {_flow_yaml(value)}", sources.get(name) or f"default ({declared_in(type(params), name)})")
        for name, value in values.items()
    ]
    ablation = getattr(params, "ablation", None)
    if ablation:  # the grpo flow's: its children run the settings above but what the ablation sets
        from flows.ablations import ablation_overrides, ablation_settings

        children = ablation_settings(ablation, params)
        rows.append((f"ablation {ablation}:", None))
        for setting, overrides in ablation_overrides(ablation, params).items():
            child = children[setting].flat(mode="json")
            rows.append((f"  {setting}:", None))
            rows += [(f"    {key}: {_flow_yaml(child[key])}", f"ablation {ablation}") for key in overrides]
    width = min(max(len(text) for text, source in rows if source), 48)  # a long list stands out on its own
    return "\n".join(text if source is None else f"{text:{width}}  # {source}" for text, source in rows)
