"""Reporting: results/summary.csv from the run directories (collect), the paper tables (tables) and ours beside the paper's, cell by cell (against_paper), the
per-experiment tables (generic), figures, the RULER table, the results index, the W&B report specifications
(wandb), and how every number is shown (render). Each module with a command line runs as
`python -m keydiff.report.<module>`."""
