"""Running experiments: one job end to end, and the sweeps made of them.

    runner       one run: plan (checked before the model loads), prefill + decode every sample, summary
    plan         what a run will do, decided from its configuration before any model is loaded
    samples      one sample of a run and what every sample of an invocation runs with (RunContext)
    batched      a run's samples decoded batch_size at a time, written as each finishes
    shared       several questions over one compressed context (multi_request, multi_turn)
    checks       the one configuration check (torch-free), the command-line check, the Hub probe
    results      the run directory's files: the one predictions reader, append-only rows, atomic summary
    invocations  which invocation computed which rows (summary.json's `invocations`; no torch)
    lock         one writer per run directory
    preemption   stopping cleanly on SLURM's signals and Ctrl-C
    progress     the sample loop's progress: a bar on a terminal, one log line per sample
    logfile      run.log, opened once the run directory is settled (after overwrite=true's move)
    eviction     whether a run's budget ever bound (summary.json's `nothing_evicted`)
    tracking     the Weights & Biases mirror of a run
    provenance   the one record of what produced a result (commit, packages, device, command, time)
    memory       a run's peak memory (CUDA's allocator, else the process's own VmHWM), for runner and benchmarks
    sweep        a sweep's grid, where each point stands, and its closing recap (no torch)
    status       `python -m keydiff.run.status EXP`: every grid point of an experiment
    submit       `make sweep-slurm EXP=...`: submit to SLURM, say the job id or why not
    shards       a grid point split into jobs (`shard=i/n`): which samples each takes, its manifest
    shard_merge  complete shards -> the grid point's result, exactly as one unsharded run (by collect)

Nothing is imported here, so `import keydiff.run.checks` stays free of torch.
"""
