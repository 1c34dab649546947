"""Offline haystack text for needle-in-a-haystack style tasks: by default the pinned prose of CPython 3.11.7's
pydoc_data/topics.py (sha256 checked); `Haystack.kind` names the source in results.

Design: docs/design/tasks.md#the-haystack
"""

from __future__ import annotations

import hashlib
import importlib
import json
import string
from dataclasses import dataclass
from pathlib import Path

_PUNCT = string.punctuation + "“”‘’"
# Markers of code, grammar productions, doctest sessions and reST section underlines.
_CODE_MARKERS = ("::=", ">>>", "***", "===", "---", "~~~", "^^^")


@dataclass(frozen=True)
class Haystack:
    """Haystack text plus the name -> sha256 of every file it was made from."""

    text: str
    sources: dict[str, str]
    description: str
    kind: str = "txt_dir"  # "pydoc_pinned", "pydoc", "txt_dir" or "ruler_json"


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_prose_paragraph(lines: list[str], min_words: int = 8, min_alpha_fraction: float = 0.8) -> bool:
    """True for a paragraph of running prose (the filter of tasks.md §5): unindented lines free of code/grammar
    markers, at least `min_words` words, ending with "." or ":", at least `min_alpha_fraction` alphabetic words."""
    if not lines or any(not line.strip() or line[0].isspace() for line in lines):
        return False
    if any(marker in line for line in lines for marker in _CODE_MARKERS):
        return False
    words = " ".join(line.strip() for line in lines).split()
    if len(words) < min_words or not words[-1].endswith((".", ":")):
        return False
    alphabetic = sum(1 for word in words if word.strip(_PUNCT).isalpha())
    return alphabetic >= min_alpha_fraction * len(words)


def prose_paragraphs(text: str) -> list[str]:
    """Prose paragraphs of a plain-text document, each re-flowed onto one line."""
    paragraphs: list[str] = []
    block: list[str] = []
    for line in text.splitlines() + [""]:
        if line.strip():
            block.append(line.rstrip())
            continue
        if block and is_prose_paragraph(block):
            paragraphs.append(" ".join(" ".join(part.split()) for part in block))
        block = []
    return paragraphs


PINNED = Path(__file__).resolve().parent / "data" / "pydoc_prose.txt"
PINNED_NAME = "keydiff/tasks/data/pydoc_prose.txt"
PINNED_SHA256 = "a92bd30d61cfb0874b98a666bb37dda4c055a6eaaa524331393cc9d9ab03c473"
HAYSTACK_SOURCES = ("pinned", "interpreter")  # the default haystack: the repository's text, or this Python's


def pinned_haystack() -> Haystack:
    """The repository's prose (pydoc_data/topics.py of CPython 3.11.7, filtered as `pydoc_haystack` does), the
    same bytes on every Python; refused if its sha256 is not PINNED_SHA256 (the file was changed)."""
    data = PINNED.read_bytes()
    digest = _sha256_bytes(data)
    if digest != PINNED_SHA256:
        raise RuntimeError(f"{PINNED_NAME} has sha256 {digest}, not the pinned {PINNED_SHA256}: restore it "
                           "(git checkout) or choose another haystack (task.haystack_dir)")
    return Haystack(text=data.decode("utf-8"), sources={PINNED_NAME: digest},
                    description="prose of CPython 3.11.7's pydoc_data/topics.py (pinned)", kind="pydoc_pinned")


def pydoc_haystack() -> Haystack:
    """Prose paragraphs of the running interpreter's pydoc_data/topics.py, topics in sorted order."""
    module = importlib.import_module("pydoc_data.topics")
    source = Path(module.__file__)
    paragraphs: list[str] = []
    for key in sorted(module.topics):
        paragraphs.extend(prose_paragraphs(module.topics[key]))
    if not paragraphs:
        raise RuntimeError(f"no prose paragraphs found in {source}")
    return Haystack(
        text="\n\n".join(paragraphs) + "\n\n",
        sources={"pydoc_data/topics.py": _sha256_bytes(source.read_bytes())},
        description=f"prose of {source}",
        kind="pydoc",
    )


RULER_ESSAYS = "PaulGrahamEssays.json"


def ruler_json_haystack(path: str | Path) -> Haystack:
    """The ``text`` of RULER's ``PaulGrahamEssays.json`` (``{"text": ...}``), exactly as RULER's niah.py reads it."""
    file = Path(path).expanduser()
    data = file.read_bytes()
    try:
        text = json.loads(data)["text"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"haystack_dir {str(path)!r} is not RULER's essay file ({{'text': ...}}): {error!r}") from None
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"haystack_dir {str(path)!r} holds no essay text")
    return Haystack(text=text, sources={f"haystack/{file.name}": _sha256_bytes(data)},
                    description=f"RULER's {file.name}", kind="ruler_json")


def directory_haystack(folder: str | Path) -> Haystack:
    """All ``*.txt`` files of `folder` (not recursive), concatenated in sorted file-name order; a folder
    without .txt files that holds RULER's ``PaulGrahamEssays.json`` (or that file itself) gives its text."""
    root = Path(folder).expanduser()
    if root.is_file() and root.suffix == ".json":
        return ruler_json_haystack(root)
    if not root.is_dir():
        raise ValueError(f"haystack_dir {str(folder)!r} is not a directory (nor RULER's {RULER_ESSAYS})")
    files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix == ".txt")
    if not files and (root / RULER_ESSAYS).is_file():
        return ruler_json_haystack(root / RULER_ESSAYS)
    if not files:
        raise ValueError(f"haystack_dir {str(folder)!r} contains no .txt files (nor RULER's {RULER_ESSAYS})")
    parts: list[str] = []
    sources: dict[str, str] = {}
    for path in files:
        data = path.read_bytes()
        sources[f"haystack/{path.name}"] = _sha256_bytes(data)
        text = data.decode("utf-8")
        parts.append(text if text[-1:].isspace() else text + "\n")
    text = "".join(parts)
    if not text.strip():
        raise ValueError(f"haystack_dir {str(folder)!r} holds only empty .txt files")
    return Haystack(text=text, sources=sources, description=f"{len(files)} .txt files of {root}")


def check_source(source: str) -> None:
    if source not in HAYSTACK_SOURCES:
        raise ValueError(f"task.haystack_source={source!r} is not valid; valid: {', '.join(HAYSTACK_SOURCES)}")


def load_haystack(haystack_dir: str | None, source: str = "pinned") -> Haystack:
    """`haystack_dir`'s text when given, else the default haystack of `source` (HAYSTACK_SOURCES)."""
    if haystack_dir is not None:
        return directory_haystack(haystack_dir)
    check_source(source)
    return pinned_haystack() if source == "pinned" else pydoc_haystack()
