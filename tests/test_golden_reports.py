"""Golden reports: `make collect tables figures-runs` on the fixed run directories of tests/golden/runs writes exactly
tests/golden/reports/ (PNG figures by sha256 in figures.sha256). An intended change of output is recorded again with
`python -m tests.test_golden_reports --record`, its diff reviewed in the commit that changes the output."""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

import pytest

from keydiff.report import collect, figures, ruler, tables

pytestmark = [pytest.mark.unit, pytest.mark.extended]

ROOT = Path(__file__).resolve().parent.parent
RUNS = Path(__file__).resolve().parent / "golden" / "runs"
GOLDEN = Path(__file__).resolve().parent / "golden" / "reports"
IMAGES = {".png", ".pdf", ".svg"}

# The report pipeline, as `make collect tables figures-runs` runs it ({runs}, {out}: folders of this test); in this
# process, so that coverage sees the lines it runs.
COMMANDS = [
    (collect.main, ["--runs", "{runs}", "--out", "{out}/summary.csv"]),
    (tables.cli, ["--summary", "{out}/summary.csv", "--runs", "{runs}", "--out", "{out}/tables"]),
    (ruler.cli, ["--runs", "{runs}", "--out", "{out}/tables"]),
    (figures.cli, ["--summary", "{out}/summary.csv", "--runs", "{runs}", "--out", "{out}/figures"]),
]


def build(out: Path) -> None:
    """Copy the fixed runs next to `out` and run every report command on them."""
    runs = out.parent / "runs"
    shutil.copytree(RUNS, runs)
    for command, arguments in COMMANDS:
        command([part.format(runs=runs, out=out) for part in arguments])


def outputs(out: Path) -> dict[str, bytes]:
    """Every file written under `out`, by relative path: text with this run's folders replaced, images by hash."""
    files = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.suffix in IMAGES:
            data = hashlib.sha256(data).hexdigest().encode()
        else:
            data = data.replace(str(out.parent).encode(), b"<tmp>")
        files[str(path.relative_to(out))] = data
    return files


def recorded() -> dict[str, bytes]:
    files = {str(p.relative_to(GOLDEN)): p.read_bytes() for p in GOLDEN.rglob("*") if p.is_file()}
    hashes = files.pop("figures.sha256", b"").decode().splitlines()
    for line in hashes:
        digest, name = line.split("  ", 1)
        files[name] = digest.encode()
    return files


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("golden") / "out"
    build(out)
    return outputs(out)


def test_reports_write_exactly_the_recorded_files_byte_for_byte(built):
    expected = recorded()
    differing = [name for name in sorted(built) if name in expected and built[name] != expected[name]]
    assert not differing, f"{len(differing)} report files differ from tests/golden/reports: {differing[:20]}"
    assert sorted(built) == sorted(expected)


def record() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        build(out)
        files = outputs(out)
    shutil.rmtree(GOLDEN, ignore_errors=True)
    hashes = []
    for name, data in files.items():
        if Path(name).suffix in IMAGES:
            hashes.append(f"{data.decode()}  {name}")
            continue
        target = GOLDEN / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    (GOLDEN / "figures.sha256").write_text("\n".join(hashes) + "\n")
    print(f"recorded {len(files)} files in {GOLDEN.relative_to(ROOT)} ({len(hashes)} images by hash)")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python -m tests.test_golden_reports --record")
    record()
