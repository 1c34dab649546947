"""The paper: which experiments feed which of its tables (registry), its published values (reference, read from
results/paper/*.csv, written by scripts/transcribe_paper.py). It imports nothing above it: our numbers go next to
the paper's in keydiff.report.against_paper."""
