"""Grid points larger than one job: a run's samples split into n shards (`shard=i/n`), each an ordinary run.

Round robin over `Task.shard_group`; a shard lives in `<grid point>/shards/<i>of<n>/` with its manifest
`shard.json`. Needs neither torch nor a model. Design: docs/design/runs.md#shards
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from keydiff.run.results import atomic_write_json, latest_rows, read_rows

SHARDS = "shards"  # <grid point>/shards/<i>of<n>/
MANIFEST = "shard.json"
MERGE_RECORD = "merged.json"  # <grid point>/shards/merged.json (keydiff.run.shard_merge)
SPEC = re.compile(r"^([1-9][0-9]*)/([1-9][0-9]*)$")
ALL = re.compile(r"^all/([1-9][0-9]*)$")
DIRNAME = re.compile(r"^([1-9][0-9]*)of([1-9][0-9]*)$")
VALID = ("valid: shard=i/n with 1 <= i <= n (shard=2/8: the second of 8 shards), shard=all/n in a sweep "
         "(-m: one job per shard), or null (the whole grid point)")


@dataclass(frozen=True)
class Shard:
    """Shard `index` (1-based) of `count`."""

    index: int
    count: int

    @property
    def spec(self) -> str:
        """As written on the command line: "2/8"."""
        return f"{self.index}/{self.count}"

    @property
    def dirname(self) -> str:
        """Its directory under `<grid point>/shards/`: "2of8" (keydiff.config.shard_suffix names the same)."""
        return f"{self.index}of{self.count}"

    def takes(self, group: int) -> bool:
        """Whether group number `group` (0-based, in the task's order) is this shard's."""
        return group % self.count == self.index - 1


def parse_shard(value: Any) -> Shard | None:
    """`shard` from the configuration: None (the whole grid point) or "i/n"; anything else raises ValueError
    in one line naming the valid form (run before any model loads: keydiff.run.checks.check_run_config)."""
    if value is None:
        return None
    match = SPEC.match(value) if isinstance(value, str) else None
    if match is None:
        hint = ""
        if isinstance(value, str) and ALL.match(value):
            hint = f" ({value} makes one job per shard: add -m for a sweep, or run one of them: shard=1/{value[4:]})"
        raise ValueError(f"shard={value!r} is not valid{hint}; {VALID}")
    index, count = int(match.group(1)), int(match.group(2))
    if index > count:
        raise ValueError(f"shard={value!r} is not valid: shard {index} of {count} does not exist; {VALID}")
    return Shard(index, count)


def expand_all(value: Any) -> list[str] | None:
    """"all/8" -> ["1/8", ..., "8/8"] (the sweeper's grid); None for any other value."""
    match = ALL.match(value) if isinstance(value, str) else None
    if match is None:
        return None
    count = int(match.group(1))
    return [f"{index}/{count}" for index in range(1, count + 1)]


def sample_digest(ids: Sequence[str]) -> str:
    """sha256 of a grid point's sample ids in their order: shards of the same data share it."""
    return hashlib.sha256("\n".join(ids).encode("utf-8")).hexdigest()


@dataclass
class Selection:
    """The samples one run covers: every sample of the grid point, or those of one shard."""

    shard: Shard | None
    samples: list  # the task's samples this run covers, in the task's order
    positions: list[int]  # their places among the grid point's samples
    total: int  # samples of the grid point
    digest: str  # sample_digest of the grid point's ids

    def manifest(self) -> dict[str, Any]:
        return {"shard": self.shard.spec, "index": self.shard.index, "count": self.shard.count,
                "total_samples": self.total, "samples_sha256": self.digest,
                "sample_ids": [sample.id for sample in self.samples], "positions": self.positions}

    def write_manifest(self, run_dir: str | Path) -> None:
        """Write `shard.json` into a shard's run directory (nothing for a whole grid point). Rewritten by every
        start of the shard (with the lock held), so it always describes the samples the shard runs now."""
        if self.shard is not None:
            atomic_write_json(Path(run_dir) / MANIFEST, self.manifest())


def select(shard: Shard | None, samples: Sequence, group_of: Callable[[Any], str] | None = None) -> Selection:
    """The samples of `shard` (None: all of them): every n-th group, starting with the i-th (module doc).
    `group_of(sample)` names a sample's group (Task.shard_group); by default each sample is its own."""
    samples = list(samples)
    digest = sample_digest([sample.id for sample in samples])
    if shard is None:
        return Selection(None, samples, list(range(len(samples))), len(samples), digest)
    groups: dict[str, int] = {}
    chosen = [(position, sample) for position, sample in enumerate(samples)
              if shard.takes(groups.setdefault(group_of(sample) if group_of else sample.id, len(groups)))]
    return Selection(shard, [sample for _, sample in chosen], [position for position, _ in chosen], len(samples), digest)




def is_shard_dir(path: str | Path) -> bool:
    """A shard's run directory (`<grid point>/shards/<anything>`, a moved-aside `2of8.old-<time>` too): not a
    grid point's result, so the report never reads it as one."""
    return Path(path).parent.name == SHARDS


def shard_dirs(point_dir: str | Path) -> dict[int, dict[int, Path]]:
    """count -> index -> directory of every shard under a grid point's directory (moved-aside ones excluded)."""
    found: dict[int, dict[int, Path]] = {}
    folder = Path(point_dir) / SHARDS
    if folder.is_dir():
        for path in sorted(folder.iterdir()):
            match = DIRNAME.match(path.name)
            if match and path.is_dir() and int(match.group(1)) <= int(match.group(2)):
                found.setdefault(int(match.group(2)), {})[int(match.group(1))] = path
    return dict(sorted(found.items()))


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # absent, or being written right now: counts as not there yet


def read_manifest(shard_dir: str | Path) -> dict[str, Any] | None:
    return _read(Path(shard_dir) / MANIFEST)


def merge_record(point_dir: str | Path) -> dict[str, Any] | None:
    """`<grid point>/shards/merged.json`, written by keydiff.run.shard_merge when it merged the point's shards."""
    return _read(Path(point_dir) / SHARDS / MERGE_RECORD)


@dataclass
class ShardState:
    """Where one shard stands, from its manifest and its rows."""

    shard: Shard
    path: Path
    manifest: dict[str, Any] | None
    rows: dict[str, dict[str, Any]]  # sample id -> latest row, for the manifest's samples

    @property
    def total(self) -> int | None:
        return None if self.manifest is None else len(self.manifest["sample_ids"])

    @property
    def complete(self) -> bool:
        return self.manifest is not None and len(self.rows) == self.total

    def describe(self) -> str:
        if self.manifest is None:
            return f"{self.shard.spec} not started" if not self.rows else f"{self.shard.spec} partial"
        return f"{self.shard.spec} " + ("complete" if self.complete else f"partial ({len(self.rows)} of {self.total})")


def shard_state(shard: Shard, path: Path) -> ShardState:
    manifest = read_manifest(path) if path.is_dir() else None
    latest = latest_rows(read_rows(path)) if path.is_dir() else {}
    if manifest is not None:
        wanted = set(manifest["sample_ids"])
        latest = {sid: row for sid, row in latest.items() if sid in wanted}
    return ShardState(shard, path, manifest, latest)


def shard_states(point_dir: str | Path, count: int) -> list[ShardState]:
    """Every shard 1..count of a grid point, present on disk or not."""
    base = Path(point_dir) / SHARDS
    return [shard_state(Shard(i, count), base / Shard(i, count).dirname) for i in range(1, count + 1)]


def describe_shards(states: list[ShardState]) -> str:
    """"3 of 4 shards complete; missing: 2/4 partial (3 of 12)" (what `make status` prints)."""
    done = sum(state.complete for state in states)
    missing = [state.describe() for state in states if not state.complete]
    text = f"{done} of {len(states)} shards complete"
    return text + (f"; missing: {', '.join(missing)}" if missing else "")
