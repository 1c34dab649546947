"""Every policy preset's capabilities as data: keydiff/policies/capabilities.json, one row per conf/policy preset, for
modules that must not import torch. `python -m keydiff.policies.capabilities --write` rewrites it (without: prints it).
Design: docs/design/policies.md#capabilities"""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from pathlib import Path

from keydiff.policies.base import Needs

PATH = Path(__file__).resolve().with_name("capabilities.json")
DERIVED = ("capturable", "chooses_segments", "groupable")  # Needs' properties, written for the readers without torch


def preset_names() -> list[str]:
    """Every conf/policy preset but `custom`, sorted."""
    from keydiff.grids import CONF

    return sorted(path.stem for path in (CONF / "policy").glob("*.yaml") if path.stem != "custom")


def preset_policies(presets: list[str] | None = None) -> dict[str, tuple[str, dict]]:
    """preset -> (policy name, parameters) for `presets` (None: every one), composed through Hydra."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from keydiff.grids import CONF

    table = {}
    with initialize_config_dir(str(CONF), version_base="1.3"):
        for preset in preset_names() if presets is None else presets:
            policy = compose("config", overrides=[f"policy={preset}"]).policy
            params = OmegaConf.to_container(policy.get("params"), resolve=True) or {}
            table[preset] = (str(policy.name), params)
    return table


def capabilities(presets: list[str] | None = None) -> dict[str, dict]:
    """preset -> {"policy": its name, each Needs field and derived property: its value} (None: every preset)."""
    from keydiff.policies import build_policy

    table = {}
    for preset, (name, params) in preset_policies(presets).items():
        policy = build_policy(name, **params)
        needs = policy.needs
        row = {"policy": name}
        for flag in [f.name for f in fields(Needs)] + list(DERIVED):
            value = getattr(needs, flag)
            row[flag] = list(value) if isinstance(value, tuple) else value
        table[preset] = row
    return table


def completed(table: dict[str, dict]) -> dict[str, dict]:
    """The file's rows (`table`) and a row computed now for each preset it lacks, as `--write` would write it."""
    missing = [preset for preset in preset_names() if preset not in table]
    return {**table, **capabilities(missing)} if missing else table


def render(table: dict[str, dict]) -> str:
    """The file's text: one line per preset, so a change reads as a one-line diff."""
    lines = [f"  {json.dumps(preset)}: {json.dumps(row)}" for preset, row in table.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["--write"]):
        raise SystemExit(f"usage: python -m keydiff.policies.capabilities [--write] (got {' '.join(argv)})")
    text = render(capabilities())
    if argv:
        PATH.write_text(text, encoding="utf-8")
        print(f"wrote {PATH}")
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
