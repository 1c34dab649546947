"""The README keeps its promises: it stays short, every link of it and of the docs leads somewhere, and every command
it tells a newcomer to type names a make target, module, file or config that exists (read from the real files)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_LIMIT_BYTES = 12 * 1024

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```[^\n]*\n.*?^```", re.S | re.M)
MAKE_TARGET = re.compile(r"^([A-Za-z0-9_.-]+(?:[ \t]+[A-Za-z0-9_.-]+)*)[ \t]*:(?!=)", re.M)
# `make VAR=value` variables that name a config: EXP is an experiment (Makefile: experiment=$(EXP)).
MAKE_VARIABLE_GROUPS = {"EXP": "experiment"}


def documentation_pages() -> list[Path]:
    """README.md, every page under docs/, and every other markdown file they link to (tasks/README.md, ...)."""
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    seen = set(pages)
    for page in pages:  # grows while iterating: pages linked from linked pages are followed too
        for target in links(page):
            path = resolve(page, target)[0]
            if path is not None and path.suffix == ".md" and path.is_file() and path not in seen:
                seen.add(path)
                pages.append(path)
    return pages


def links(page: Path) -> list[str]:
    """Markdown link targets outside code (fenced blocks and inline code are not links)."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def resolve(page: Path, target: str) -> tuple[Path | None, str]:
    """(file the link points to, anchor); file None for external links (http, mailto)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):
        return None, ""
    path, _, anchor = target.partition("#")
    return (page.parent / path).resolve() if path else page, anchor


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped except - and _, spaces to -, repeats -1, -2."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        unique, n = slug, 0
        while unique in found:
            n += 1
            unique = f"{slug}-{n}"
        found.add(unique)
    return found


def section(text: str, title: str) -> str:
    """The body of the level-2 section `## <title>` (up to the next level-2 heading)."""
    match = re.search(rf"^## {re.escape(title)}[ \t]*\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def commands(markdown: str) -> list[str]:
    """The command lines of the ```bash blocks in a piece of markdown, comments stripped."""
    lines = []
    for block in re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", markdown, re.S | re.M):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return {name for names in MAKE_TARGET.findall(text) for name in names.split()}


def module_exists(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def config_problems(overrides: list[str]) -> list[str]:
    """Hydra group choices (`policy=snapkv`, `experiment=table1`) whose conf/<group>/<choice>.yaml is missing."""
    problems = []
    for override in overrides:
        key, sep, value = override.partition("=")
        key = MAKE_VARIABLE_GROUPS.get(key, key).lstrip("+")
        group = ROOT / "conf" / key
        if not sep or not group.is_dir():
            continue  # a plain key (task.limit=5, block_size=256) or a make variable: not a config file
        for choice in value.split(","):
            if not (group / f"{choice}.yaml").is_file():
                problems.append(f"{override}: no conf/{key}/{choice}.yaml")
    return problems


def command_problems(line: str) -> list[str]:
    """What a README command names that does not exist; [] when everything it names does."""
    words = shlex.split(line)
    problems = []
    if words[0] == "make":
        settings = [w for w in words[1:] if "=" in w]
        targets = [w for w in words[1:] if "=" not in w and not w.startswith("-")]
        known = make_targets()
        problems += [f"make {t}: no such target in the Makefile" for t in targets if t not in known]
        for setting in settings:
            name, _, value = setting.partition("=")
            if name == "ARGS":
                problems += config_problems(shlex.split(value))
            else:
                problems += config_problems([setting])
        return problems
    if re.fullmatch(r"(\S*/)?python3?", words[0]):
        if words[1] == "-m":
            if words[2].startswith("keydiff") and not module_exists(words[2]):
                problems.append(f"python -m {words[2]}: no such module in the package")
            return problems + config_problems(words[3:])
        script = ROOT / words[1]
        if not script.is_file():
            problems.append(f"{words[1]}: no such file")
        return problems + config_problems(words[2:])
    return [f"not a make target, a python module or a script: {line}"]


def test_readme_is_a_front_door_of_at_most_12_kb():
    size = len(README.read_bytes())
    assert size <= README_LIMIT_BYTES, f"README.md is {size} bytes, more than {README_LIMIT_BYTES}: move text to docs/"


def test_readme_has_the_sections_a_newcomer_looks_for():
    text = README.read_text(encoding="utf-8")
    quickstart = commands(section(text, "Quickstart"))
    assert quickstart[:2] == ["make run", "make test"]  # the two commands on a fresh machine, in this order
    assert re.search(r"^make test\s*$", (ROOT / ".ci" / "run").read_text(), re.M)  # CI runs the README's test command
    assert len(commands(section(text, "Next"))) == 5
    layout = section(text, "Layout")
    for package in sorted(p.name for p in (ROOT / "keydiff").iterdir() if (p / "__init__.py").is_file()):
        assert f"{package}/" in layout, f"keydiff/{package}/ is missing from the README's Layout section"


def test_every_relative_link_resolves():
    broken = []
    for page in documentation_pages():
        for target in links(page):
            path, anchor = resolve(page, target)
            if path is None:
                continue
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not path.exists():
                broken.append(f"{where}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{where}: no heading '#{anchor}' in {path.relative_to(ROOT)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_docs_have_pages_and_the_readme_links_each():
    pages = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
    assert len(pages) >= 8
    linked = {resolve(README, target)[0] for target in links(README)}
    unlinked = [page for page in pages if ROOT / page not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_quickstart_and_next_commands_exist():
    text = README.read_text(encoding="utf-8")
    lines = commands(section(text, "Quickstart")) + commands(section(text, "Next"))
    problems = [p for line in lines if line.startswith(("make ", "python", ".venv/")) for p in command_problems(line)]
    assert not problems, "\n".join(problems)


def test_every_module_and_make_target_the_docs_name_exists():
    """`python -m keydiff....`, `make <target>` and `scripts/<file>` anywhere in README.md and docs/."""
    known = make_targets()
    problems = []
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for module in set(re.findall(r"python -m (keydiff[\w.]*\w)", text)):
            if not module_exists(module):
                problems.append(f"{page.relative_to(ROOT)}: python -m {module}: no such module")
        for target in set(re.findall(r"(?:`|^)make ([a-z][\w-]*)", text, re.M)):
            if target not in known:
                problems.append(f"{page.relative_to(ROOT)}: make {target}: no such target")
        for script in set(re.findall(r"\bscripts/(\w+\.(?:py|sh))", text)):
            if not (ROOT / "scripts" / script).is_file():
                problems.append(f"{page.relative_to(ROOT)}: scripts/{script}: no such script")
    assert not problems, "\n".join(problems)
