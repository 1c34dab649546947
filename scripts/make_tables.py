#!/usr/bin/env python3
"""Every paper table from results/runs into results/tables, then the RULER table (what `make tables` runs).

    python scripts/make_tables.py [--runs results/runs] [--out results/tables] [--collect]

The options go to keydiff.report.tables; the RULER table (keydiff.report.ruler) uses its defaults.
"""

from keydiff.report import ruler, tables

if __name__ == "__main__":
    tables.cli()
    ruler.cli([])
