"""A settings file (``--config params.yaml``): read strictly, one section of it, and its profile's overrides.

The YAML is read safely, refusing a key given twice in one mapping, aliases that expand past
:data:`MAX_YAML_VALUES` values and files past :data:`MAX_CONFIG_BYTES`; a section and its profile's overrides are
deep-merged; a key no setting has, and a value a later layer hides but that would not validate, are refused with
the file and place named (:class:`ConfigError`).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import ValidationError

from a5core.runtime.settings import Settings, describe, setting_location, unknown_setting

Params = TypeVar("Params", bound=Settings)


class ConfigError(ValueError):
    """A ``--config`` file that cannot be read as settings: missing, not UTF-8, malformed YAML (a key given twice
    in one mapping, aliases that expand past :data:`MAX_YAML_VALUES` values), a section or profile that is not a
    mapping, a profile it does not define, a key no flow parameter has. The message names file and place."""


# The most values a settings document (or a flag's value) may expand to through its aliases: params.yaml holds a
# few hundred; an "alias bomb" of a few lines expands to billions, and reading it would never end.
MAX_YAML_VALUES = 100_000


# The largest settings file read (params.yaml: 23 kB): a bigger file is not settings, and parsing megabytes of YAML
# takes minutes.
MAX_CONFIG_BYTES = 1_000_000


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a key given twice in one mapping (the safe loader keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, str | int | float | bool) and key in first:
                problem = f"key {key!r} given twice in one mapping (first on line {first[key]})"
                raise yaml.constructor.ConstructorError(None, None, problem, key_node.start_mark)
            first.setdefault(key, key_node.start_mark.line + 1)
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, lambda loader, node: loader.construct_mapping(node)
)


def load_yaml(text: str) -> Any:
    """The YAML value of ``text``, read strictly: a key twice in one mapping, or aliases that expand past
    :data:`MAX_YAML_VALUES` values (or refer to themselves), raise ``yaml.YAMLError`` with the place."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_expansion(root: yaml.Node) -> None:
    """``yaml.YAMLError`` when the node graph, aliases expanded, holds more than :data:`MAX_YAML_VALUES` nodes
    or an alias inside its own anchor. Each node is sized once (an alias is the node it names)."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    open_nodes: set[int] = set()
    while stack:
        node, children_done = stack.pop()
        children = _children(node)
        if children_done:
            open_nodes.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in children)
            if sizes[id(node)] > MAX_YAML_VALUES:
                what = (  # each node is sized once: as many sized as that, the text itself holds them
                    "holds more than {:,} values: not a settings file"
                    if len(sizes) > MAX_YAML_VALUES
                    else "its aliases expand to more than {:,} values; write the values out"
                )
                raise yaml.YAMLError(f"at line {node.start_mark.line + 1}: {what.format(MAX_YAML_VALUES)}")
            continue
        if id(node) in sizes:
            continue
        if id(node) in open_nodes:
            raise yaml.YAMLError(f"at line {node.start_mark.line + 1}: an alias inside its own anchor")
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in sizes)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [item for pair in node.value for item in pair]
    return []


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The YAML document of a settings file (``params.yaml``), a mapping of sections; an empty file is {}."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"--config {path}: {size / 1e6:.1f} MB, not a settings file (those hold at most "
            f"{MAX_CONFIG_BYTES / 1e6:.0f} MB; params.yaml holds a few kB): give the settings file"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"--config {path}: not UTF-8 text (byte {error.start}: {error.object[error.start : error.start + 1]!r})"
        ) from None
    try:
        document = load_yaml(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        raise ConfigError(
            f"--config {path}{where}: malformed YAML ({getattr(error, 'problem', None) or error})"
        ) from None
    except RecursionError:
        raise ConfigError(f"--config {path}: malformed YAML (nested too deeply to read)") from None
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ConfigError(
            f"--config {path}: expected a mapping of sections (baseline_eval:, grpo:, ...), "
            f"got a {type(document).__name__}"
        )
    check_sections(document, path)
    return document


# The sections a settings file may hold: each flow's (the section its command line's --config reads), params.yaml's
# data files (flows.prepare_data), and the profile chosen and the profiles. A profile holds sections only.
FLOW_SECTIONS = (
    "baseline_eval",
    "compare",
    "data",
    "difficulty",
    "expert_iteration",
    "grpo",
    "leaderboard",
    "report",
    "sft_data",
    "sft_experiment",
    "verdicts",
)
TOP_LEVEL = (*FLOW_SECTIONS, "profile", "profiles")


def check_sections(document: dict[str, Any], path: str | os.PathLike) -> None:
    """ConfigError naming the first key of ``document`` that is no section (:data:`TOP_LEVEL`), or of one of its
    profiles that is no flow's section (:data:`FLOW_SECTIONS`), with the nearest name: a misspelt section was
    read by nothing, and the settings in it (``dvc exp run -S profiles.cpu.baseline_evl.limit=4``) changed
    nothing."""
    profiles = document.get("profiles")
    places = [("", key, TOP_LEVEL) for key in document]
    if isinstance(profiles, dict):
        for name, profile in profiles.items():
            if isinstance(profile, dict):
                places += [(f"profiles.{name}.", key, FLOW_SECTIONS) for key in profile]
    for prefix, key, known in places:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"the sections are {', '.join(known)}"
            raise ConfigError(f"--config {path}: unknown section `{prefix}{str(key)[:80]}`, read by no flow ({hint})")


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``override``'s keys on top; a mapping under the same key is merged key by key."""
    out = dict(base)
    for key, value in override.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# The profile of the settings as a file's sections give them, without a profile's overrides (params.yaml: the
# handout's); any other profile is one the file's ``profiles`` defines.
BASE_PROFILE = "a5"


def profile_name(
    document: dict[str, Any], chosen: str | None = None, path: str | os.PathLike = "params.yaml"
) -> str | None:
    """The profile whose overrides apply: ``chosen`` (``--profile``), else the document's ``profile``.
    ConfigError for either naming a profile the document does not define (nor :data:`BASE_PROFILE`)."""
    profiles = document.get("profiles") or {}
    if not isinstance(profiles, dict):
        raise ConfigError(
            f"--config {path}: `profiles` must be a mapping of profile names, got {type(profiles).__name__}"
        )
    known = [BASE_PROFILE, *(name for name in profiles if name != BASE_PROFILE)]
    defined = f"(it has: {', '.join(map(str, known))})"
    if chosen is not None and chosen not in known:
        raise ConfigError(f"--profile {chosen}: no such profile in {path} {defined}")
    selected = document.get("profile")
    if selected is not None and selected not in known:  # the file's own choice: never silently the base settings
        raise ConfigError(f"--config {path}: `profile: {selected}` names no profile of the file {defined}")
    return chosen or selected


def section_layers(
    document: dict[str, Any], section: str, profile: str | None, path: str | os.PathLike = "params.yaml"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Section ``section`` of a settings document, and ``profiles.<profile>.<section>``'s overrides of it ({}
    each where the document has none)."""

    def mapping(value: Any, where: str) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(
                f"--config {path}: `{where}` must be a mapping of settings, got {type(value).__name__} {value!r}"
            )
        return value

    base = mapping(document.get(section), section)
    overrides = mapping((document.get("profiles") or {}).get(profile), f"profiles.{profile}") if profile else {}
    return base, mapping(overrides.get(section), f"profiles.{profile}.{section}")


def section_settings(
    document: dict[str, Any], section: str, profile: str | None, path: str | os.PathLike = "params.yaml"
) -> dict[str, Any]:
    """Section ``section`` of a settings document with ``profiles.<profile>.<section>`` deep-merged on top
    (a profile may override one key of a nested mapping). {} when neither has the section."""
    return deep_merge(*section_layers(document, section, profile, path))


def _unknown_keys(model: type[Settings], values: dict[str, Any], where: str) -> str | None:
    """A message naming the keys of ``values`` that ``model`` has no field for (typos), or None."""
    settings = model.flat_fields()
    unknown = [unknown_setting(key, model) for key in values if key not in settings]
    return f"{where}: {'; '.join(unknown)}" if unknown else None


def config_layers(
    model: type[Settings], section: str, config: str | os.PathLike, profile_flag: str | None = None
) -> tuple[str | None, list[tuple[str, dict[str, Any]]]]:
    """The profile that applies, and section ``section`` of settings file ``config`` and that profile's overrides
    of it, each with where it is (``--config FILE section `NAME```, ``--config FILE profile NAME``). ConfigError
    for a file that cannot be read, no such section, or a key ``model`` has no field for."""
    document = read_config(config)
    if section not in document:
        raise ConfigError(f"--config {config}: no `{section}` section")
    profile = profile_name(document, profile_flag, config)
    base, overrides = section_layers(document, section, profile, config)
    where = f"--config {config} section `{section}`" + (f" (with profile {profile})" if profile else "")
    unknown = _unknown_keys(model, deep_merge(base, overrides), where)
    if unknown:
        raise ConfigError(unknown)
    return profile, [
        (f"--config {config} section `{section}`", base),
        (f"--config {config} profile {profile}", overrides),
    ]


def settings_from_file(
    model: type[Params], section: str, config: str | os.PathLike, profile_flag: str | None = None
) -> Params:
    """``model`` from section ``section`` of settings file ``config`` with its profile's overrides
    (:func:`config_layers`), every value checked, those the profile replaces too (:func:`hidden_problems`);
    ConfigError naming file and place otherwise."""
    _, layers = config_layers(model, section, config, profile_flag)
    values = deep_merge(layers[0][1], layers[1][1])
    try:
        params = model(**values)
    except ValidationError as error:
        raise ConfigError(f"--config {config}: invalid `{section}`: {describe(error)}") from None
    hidden = hidden_problems(model, values, layers)
    if hidden:
        raise ConfigError(hidden)
    return params


def hidden_problems(model: type[Settings], values: dict[str, Any], layers: list[tuple[str, dict[str, Any]]]) -> str:
    """The invalid values a later layer hides (a section's value its profile or a flag replaces: ``dvc exp run -S
    baseline_eval.limit=abc`` under a profile that sets ``limit``), each named with its place; "" when none. A
    value is checked where it was written, whether or not it is the one that runs."""
    problems = []
    for index, (where, layer) in enumerate(layers[:-1]):
        later = {key for _, above in layers[index + 1 :] for key in above}
        hidden = {key: value for key, value in layer.items() if key in later and values.get(key) != value}
        if not hidden:
            continue
        try:
            model(**{**values, **hidden})
        except ValidationError as error:
            for problem in error.errors():
                loc = setting_location(problem["loc"])
                if loc and loc[0] in hidden:
                    name = "".join([str(loc[0]), *(f"[{i}]" for i in loc[1:] if isinstance(i, int))])
                    problems.append(
                        f"{where}: {name} {problem.get('input')!r}: {problem['msg']} (a later value replaces it, "
                        "but it is wrong: fix or remove it)"
                    )
    return "; ".join(problems)
