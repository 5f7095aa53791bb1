"""Command lines for flows: one flag per field of a flow's pydantic parameter model.

Values come, in increasing priority, from the model's defaults, one section of a YAML file
(``--config params.yaml``, the file DVC tracks), that file's ``profiles.<profile>.<section>``
overrides for its selected ``profile`` (or ``--profile NAME``), and the flags. A flag's value is read as YAML, so
``--limit 20``, ``--stop '["</answer>"]'`` and ``--seed null`` all work; pydantic validates the result
and a bad value exits with its message.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

Params = TypeVar("Params", bound=BaseModel)


def parse_params(model: type[Params], section: str, argv: list[str] | None = None, description: str = "") -> Params:
    """Build ``model`` from defaults < ``--config FILE`` section ``section`` < command-line flags."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, help=f"YAML file whose `{section}` section sets parameters")
    parser.add_argument("--profile", dest="_profile", metavar="NAME",
                        help="with --config: use this profile's overrides instead of the file's `profile`")
    for name, field in model.model_fields.items():
        parser.add_argument(
            "--" + name.replace("_", "-"), dest=name, metavar="VALUE",
            help=f"{field.description or name} (default: {field.default!r})",
        )
    args = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    config, profile_flag = args.pop("config"), args.pop("_profile")
    if config is not None:
        if not config.is_file():
            parser.error(f"--config {config}: no such file")
        document = yaml.safe_load(config.read_text()) or {}
        if section not in document:
            parser.error(f"--config {config}: no `{section}` section")
        values.update(document[section])
        profile = profile_flag or document.get("profile")
        if profile_flag and profile_flag not in (document.get("profiles") or {}) and profile_flag != document.get("profile"):
            parser.error(f"--profile {profile_flag}: no such profile in {config}")
        values.update(((document.get("profiles") or {}).get(profile) or {}).get(section) or {})
    values.update({name: yaml.safe_load(raw) for name, raw in args.items() if raw is not None})
    try:
        return model(**values)
    except ValidationError as e:
        parser.error(f"invalid parameters:\n{e}")
