"""The code that writes the made-up offline fixtures under tasks/fixtures/ (deterministic, byte for byte).

    python -m keydiff.tasks.fixture_builders.longbench   # tasks/fixtures/longbench/data/*.jsonl
    python -m keydiff.tasks.fixture_builders.math500     # tasks/fixtures/math500/test.jsonl
    python -m keydiff.tasks.fixture_builders.ruler       # tasks/fixtures/ruler/{squad,hotpotqa}.json

The tests check that each builder still writes exactly the committed files.
"""

from pathlib import Path

# The committed fixtures of the checkout that holds this package: each builder's default output folder.
FIXTURES = Path(__file__).resolve().parents[3] / "tasks" / "fixtures"
