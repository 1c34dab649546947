"""Every policy preset's capabilities as data: keydiff/policies/capabilities.json, one row per conf/policy preset.

    python -m keydiff.policies.capabilities --write     # rewrite the file after a policy's capabilities change
    python -m keydiff.policies.capabilities             # print it

Modules that must not import torch (keydiff.run.checks, keydiff.report.gpu_hours) read it; a test checks it is
fresh. Design: docs/design/policies.md#capabilities
"""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from pathlib import Path

from keydiff.policies.base import Needs

PATH = Path(__file__).resolve().with_name("capabilities.json")
DERIVED = ("capturable", "chooses_pools", "groupable")  # Needs' properties, written for the readers without torch


def preset_policies() -> dict[str, tuple[str, dict]]:
    """preset -> (policy name, parameters) for every conf/policy preset but `custom`, composed through Hydra."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from keydiff.grids import CONF

    presets = {}
    with initialize_config_dir(str(CONF), version_base="1.3"):
        for path in sorted((CONF / "policy").glob("*.yaml")):
            if path.stem == "custom":
                continue
            policy = compose("config", overrides=[f"policy={path.stem}"]).policy
            params = OmegaConf.to_container(policy.get("params"), resolve=True) or {}
            presets[path.stem] = (str(policy.name), params)
    return presets


def capabilities() -> dict[str, dict]:
    """preset -> {"policy": its name, each Needs field and derived property: its value}."""
    from keydiff.policies import build_policy

    table = {}
    for preset, (name, params) in preset_policies().items():
        policy = build_policy(name, **params)
        needs = policy.needs
        row = {"policy": name}
        for flag in [f.name for f in fields(Needs)] + list(DERIVED):
            value = getattr(needs, flag)
            row[flag] = list(value) if isinstance(value, tuple) else value
        table[preset] = row
    return table


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
