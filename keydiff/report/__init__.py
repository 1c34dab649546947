"""Reporting, from the run directories to tables, figures and dashboards. Each module with a command line runs
as `python -m keydiff.report.<module>`.

    collect        results/summary.csv from the run directories (one row per run)
    selection      the one reader of summary.csv and which runs a table shows
    render         how every number is shown: intervals, formats, marks, md/tex
    tables         every paper table summary.csv can fill (`make tables`)
    against_paper  ours next to the paper's numbers, cell by cell
    generic        per-experiment tables of whatever ran
    figures        the paper's figures (`make figures`)
    ruler          the RULER results table
    leaderboard    the kvpress-style leaderboard: RULER score vs the share of the prompt kept
    protocol       one score per method and budget under each way of asking about a compressed context
    compare_runs   two runs of one grid point side by side (wall time, identical predictions)
    index          results/README.md: every table and figure and how complete it is
    wandb          one W&B report per experiment
    gpu_hours      GPU-hours of the paper's experiments from measured GPU rates (`make gpu-hours`)
"""
