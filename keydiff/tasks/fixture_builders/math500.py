"""Write tasks/fixtures/math500/test.jsonl: five made-up problems in the HuggingFaceH4/MATH-500 layout.

The fixture lets tests and smoke runs use `task.data_dir=tasks/fixtures/math500` offline. The answers
cover the shapes the scorers must handle: a fraction, a square root, a half-open interval, an ordered
pair with nested braces, and a `\\text{}` answer.

    python -m keydiff.tasks.fixture_builders.math500                 # -> tasks/fixtures/math500/test.jsonl
    python -m keydiff.tasks.fixture_builders.math500 --out /tmp/m    # -> /tmp/m/test.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from keydiff.tasks.fixture_builders import FIXTURES

PROBLEMS = [
    {
        "problem": "If $6x - 1 = 2$, what is $x$? Express your answer as a common fraction.",
        "solution": "Adding 1 to both sides gives $6x = 3$, so $x = \\boxed{\\frac{1}{2}}$.",
        "answer": "\\frac{1}{2}",
        "subject": "Algebra",
        "level": 1,
        "unique_id": "fixture/algebra/1.json",
    },
    {
        "problem": "What is the length of the space diagonal of a cube with edge length 1?",
        "solution": "By the Pythagorean theorem twice, the diagonal is $\\sqrt{1+1+1} = \\boxed{\\sqrt{3}}$.",
        "answer": "\\sqrt{3}",
        "subject": "Geometry",
        "level": 2,
        "unique_id": "fixture/geometry/2.json",
    },
    {
        "problem": "Find all $x$ such that $-2 \\le 4x + 2 < 8$. Express your answer in interval notation.",
        "solution": "Subtracting 2 gives $-4 \\le 4x < 6$, so $-1 \\le x < \\frac{3}{2}$, "
        "that is $x \\in \\boxed{\\left[ -1, \\frac{3}{2} \\right)}$.",
        "answer": "\\left[ -1, \\frac{3}{2} \\right)",
        "subject": "Intermediate Algebra",
        "level": 3,
        "unique_id": "fixture/intermediate_algebra/3.json",
    },
    {
        "problem": "Convert the point $(0,5)$ in rectangular coordinates to polar coordinates. Enter your "
        "answer in the form $(r,\\theta),$ where $r > 0$ and $0 \\le \\theta < 2 \\pi.$",
        "solution": "We have $r = 5$ and the point lies on the positive $y$-axis, so $\\theta = \\frac{\\pi}{2}$. "
        "The answer is $\\boxed{\\left( 5, \\frac{\\pi}{2} \\right)}$.",
        "answer": "\\left( 5, \\frac{\\pi}{2} \\right)",
        "subject": "Precalculus",
        "level": 2,
        "unique_id": "fixture/precalculus/4.json",
    },
    {
        "problem": "Today is Monday. What day of the week will it be 10 days from today?",
        "solution": "Since $10 = 7 + 3$, it is three days after Monday, which is $\\boxed{\\text{Thursday}}$.",
        "answer": "\\text{Thursday}",
        "subject": "Number Theory",
        "level": 1,
        "unique_id": "fixture/number_theory/5.json",
    },
]


def write_fixture(out: Path) -> Path:
    """Write `out/test.jsonl` (the folder is created); returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "test.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PROBLEMS), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=FIXTURES / "math500",
                        help="output folder (default: this checkout's tasks/fixtures/math500)")
    path = write_fixture(parser.parse_args(argv).out)
    print(f"wrote {len(PROBLEMS)} problems to {path}")


if __name__ == "__main__":
    main()
