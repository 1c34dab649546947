"""The paper: which experiments feed which of its tables (registry), its published values (reference, read
from results/paper/*.csv, written by scripts/transcribe_paper.py), and our numbers next to them (compare)."""
