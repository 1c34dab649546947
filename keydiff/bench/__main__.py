"""`python -m keydiff.bench CASE [options]`: keydiff.bench.runner."""

from keydiff.bench import runner

runner.command(runner.main)
