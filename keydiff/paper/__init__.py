"""The paper: which experiments feed which of its tables (registry), its published values (reference, read
from results/paper/*.csv, written by transcribe), and our numbers next to them (compare)."""
