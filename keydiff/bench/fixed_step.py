"""The decoding step of full caches, per form: ordinary, fixed-shape eager, fixed-shape under torch.compile.

Decides which form a device runs by default (keydiff.decode.step.FIXED_SHAPES_DEFAULT). W forks of one
prefill decode --steps timed steps in interleaved rounds; reported: median per-step time, ratio to the ordinary
step, warm-up wall time (a compile's cost), token agreement and time over the step's floor (keydiff.bench.floor).
`--forms ...,model` adds the model's own forward over a transformers cache of N entries.

    python -m keydiff.bench fixed_step --model random-smollm2 --threads 2 --widths 1,8 --repeats 5 --json out.json

Design: docs/design/benchmarks.md#prefill-decode-throughput
"""

from __future__ import annotations

import statistics
import sys

import torch

from keydiff import Request, build_policy, generate_batch, prefill
from keydiff.attention import keydiff_attention
from keydiff.decode.scheduler import read_cache
from keydiff.decode.static import StaticStep
from keydiff.bench import common, floor, runner


FORMS = ("ordinary", "fixed", "compiled", "model")


def compiled_form(model, state, width: int, budget: int, args, device: str) -> dict:
    """Per-step time of the fixed-shape step compiled by torch.compile over `width` forks (their block; one fork:
    its own stack), the step alone with its argmax (generate_batch never compiles it)."""
    forks = state.fork(width)
    cache = forks[0].cache
    place = read_cache(cache)  # the scheduler's record: the forks' shared arena, or the one fork's own
    step = StaticStep(model, place.cut(0, place.slots), cache.policy, budget, compiled=True)
    ids = state.logits.argmax(-1, keepdim=True).expand(width, 1).to(device)  # the first token, as generate picks it
    active = torch.ones(width, dtype=torch.bool, device=device)
    position = state.prompt_length

    def one() -> torch.Tensor:
        nonlocal ids, position
        ids = step.run(ids, torch.full((width, 1), position, device=device), active).argmax(-1, keepdim=True)
        position += 1
        return ids[:, 0]

    with torch.inference_mode(), keydiff_attention(model, None):
        warm = common.timed(device, lambda: [one() for _ in range(args.warm_up)])[0]
        times, tokens = steps_timed(device, one, args.steps)
    return {"ms_per_step": 1e3 * statistics.median(times), "warm_up_s": warm, "tokens": tokens}


def steps_timed(device: str, step, count: int) -> tuple[list[float], list[list[int]]]:
    """Seconds of each of `count` calls of step() (`common.timed`) and the tokens each returned."""
    runs = [common.timed(device, step) for _ in range(count)]
    return [seconds for seconds, _ in runs], [token.tolist() for _, token in runs]


def model_form(model, prompt, width: int, budget: int, args, device: str) -> dict:
    """Per-step time of the model's own forward alone over a transformers DynamicCache that holds the prompt's first
    N entries (W copies), greedy: the model pass every form's step contains, with no eviction and no harness (the
    anchor for how much of a step is the model itself; its cache grows by one entry a step, N + 1 at the first)."""
    from transformers import DynamicCache

    ids = prompt[:, :budget].expand(width, -1).contiguous()
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        token = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(
            -1, keepdim=True)

        def one() -> torch.Tensor:
            nonlocal token
            token = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            return token[:, 0]

        steps_timed(device, one, args.warm_up)
        times, tokens = steps_timed(device, one, args.steps)
    return {"ms_per_step": 1e3 * statistics.median(times), "tokens": tokens}


def decoded_form(model, state, width: int, args, device: str, fixed: bool) -> dict:
    """Per-step time of keydiff.generate_batch over `width` greedy forks, ordinary (fixed=False) or fixed-shape step: a
    run of warm-up + steps + 1 tokens minus one of warm-up + 1, over the steps (warm-up not counted, token choice and
    bookkeeping counted)."""
    def decode(tokens: int) -> tuple[float, dict]:
        requests = [Request(fork, max_new_tokens=tokens, key=i) for i, fork in enumerate(state.fork(width))]
        return common.timed(device, lambda: dict(generate_batch(model, requests, width, fixed_shapes=fixed)))

    short, _ = decode(args.warm_up + 1)
    long, out = decode(args.warm_up + args.steps + 1)
    tokens = [[out[i].token_ids[0][1 + args.warm_up + s] for i in range(width)] for s in range(args.steps)]
    return {"ms_per_step": 1e3 * (long - short) / args.steps, "tokens": tokens}


def check(args) -> None:
    args.form_list = [form.strip() for form in args.forms.split(",") if form.strip()]
    if set(args.form_list) - set(FORMS) or set(args.form_list) <= {"model"}:
        raise ValueError(f"--forms {args.forms!r}: valid forms are {', '.join(FORMS)}, at least one besides model")


def run(args) -> dict:
    forms, device, dtype = args.form_list, args.device, args.torch_dtype
    model, prompt = common.model_and_prompt(args)
    print(common.setting_line(device, dtype, model=args.model, L=args.length, N=args.budget), flush=True)
    state = prefill(model, prompt, build_policy("keydiff"), args.budget, args.block_size)
    rates = floor.measure(device, dtype)
    print(f"  bandwidth {common.fmt(rates.bandwidth and rates.bandwidth / 1e9, '.1f')} GB/s ({rates.bandwidth_source}), matmul "
          f"{rates.matmul_flops / 1e9:.1f} GFLOP/s ({rates.dtype})", file=sys.stderr, flush=True)
    rows = []
    for width in [int(w) for w in args.widths.split(",")]:
        measure = {form: (lambda form=form: compiled_form(model, state, width, args.budget, args, device)
                          if form == "compiled" else model_form(model, prompt, width, args.budget, args, device)
                          if form == "model" else decoded_form(model, state, width, args, device, form == "fixed"))
                   for form in forms}  # interleaved, round by round (the machine's speed drifts); each warms up
        rounds = common.interleaved_rounds({f"W={width} {form}": fn for form, fn in measure.items()}, args.repeats,
                                           device, warm_up=False)
        rounds = {form: rounds[f"W={width} {form}"] for form in forms}
        reference = rounds[next(form for form in forms if form != "model")][0]["tokens"]
        for form, results in rounds.items():
            row = {"width": width, "form": form, "ms_per_step": statistics.median(r["ms_per_step"] for r in results),
                   "per_round_ms": [r["ms_per_step"] for r in results],
                   "warm_up_s": results[0].get("warm_up_s"),
                   # the model alone decodes another cache (no eviction), so its tokens are its own
                   "same_tokens": None if form == "model" else all(r["tokens"] == reference for r in results),
                   **floor.floor_ms(model, width, args.budget + 1, rates)}
            row["x_floor"] = common.ratio(row["ms_per_step"], row["floor_ms"])
            if "ordinary" in rounds:  # the median of the per-round ratios: drift cancels within a round
                row["x_ordinary"] = statistics.median(r["ms_per_step"] / o["ms_per_step"]
                                                      for r, o in zip(results, rounds["ordinary"]))
            rows.append(row)
    common.print_table([("W", 3), ("form", 9), ("ms/step", 8), ("x ordinary", 10), ("warm-up s", 9),
                        ("same tokens", 11), ("floor ms", 8), ("bandwidth / compute", 19), ("x floor", 7)],
                       [[str(r["width"]), r["form"], f"{r['ms_per_step']:.1f}", common.fmt(r.get("x_ordinary"), ".3f"),
                         common.fmt(r["warm_up_s"], ".1f"), "-" if r["same_tokens"] is None else str(r["same_tokens"]), common.fmt(r["floor_ms"], ".1f"),
                         f"{common.fmt(r['bandwidth_floor_ms'], '.1f')} / {common.fmt(r['compute_floor_ms'], '.1f')}",
                         common.fmt(r["x_floor"], ".2f")] for r in rows], 2)
    settings = {k: v for k, v in vars(args).items() if k not in ("started", "torch_dtype", "form_list")}
    return {"results": rows, "settings": settings, "device_rates": rates.record()}


CASE = runner.Case("fixed_step", run, __doc__, runner.RUN + runner.SIZES, check=check,
                   defaults={"model": "random-smollm2", "length": 2048}, options=(
    runner.option("--widths", default="1,8", help="sequences decoding together (comma list)"),
    runner.option("--steps", type=int, default=16),
    runner.option("--warm-up", type=int, default=3),
    runner.option("--forms", default="ordinary,fixed,compiled",
                  help="comma list of ordinary, fixed, compiled, model (the model's forward alone, no eviction)")))


main = runner.entry(CASE, __spec__.name, __name__)  # `python -m keydiff.bench fixed_step`: this case
