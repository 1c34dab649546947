#!/usr/bin/env python3
"""The figures from results/runs (heatmaps, TTFT, prompt lengths, generic) into results/figures, no model
(what `make figures-runs` runs; the analysis figures that load a model: `make analysis`).

    python scripts/make_figures.py [--runs results/runs] [--out results/figures] [--collect]
"""

from keydiff.report import figures

if __name__ == "__main__":
    figures.cli()
