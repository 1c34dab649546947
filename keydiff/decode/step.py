"""The model runner and the decode step: `decode_step` picks every running sequence's next token, then runs one evicting
pass of those still going; `ModelRunner.run(plan)` executes a plan. Design: docs/design/decode.md#the-step-steppy"""

from __future__ import annotations

import contextlib
import time
import weakref

import torch

from keydiff.attention import base_implementation
from keydiff.decode.graphs import calls_for
from keydiff.decode.plan import StepOutput, StepPlan
from keydiff.decode.rows import BatchCache
from keydiff.decode.sequence import Sequence
from keydiff.decode.static import StaticStep, StepStats
from keydiff.device import sync
from keydiff.kernels import batch_invariant


def choose_greedy(sequences: list[Sequence]) -> None:
    """The next tokens of every plainly greedy sequence in one argmax and one read back (rather than an argmax and
    a device sync per sequence): the same tokens, since an argmax of a row does not depend on the rows beside it."""
    if not sequences:
        return
    tokens = torch.cat([sequence.logits for sequence in sequences]).argmax(dim=-1).tolist()
    start = 0
    for sequence in sequences:
        sequence.take(tokens[start : start + sequence.row_count])
        start += sequence.row_count


def choose_tokens(active: list[Sequence]) -> None:
    """Every running sequence's next tokens (the token rule: keydiff.decode.sequence.Sequence)."""
    greedy = [sequence for sequence in active if not sequence.done and sequence.plain_greedy]
    choose_greedy(greedy)
    chosen = set(map(id, greedy))
    for sequence in active:
        if not sequence.done and id(sequence) not in chosen:
            sequence.choose()


class ModelRunner:
    """Runs the plans the scheduler hands it (`run`): a fixed-shape step kept per owner of rows and replayed, or the
    batch cache over each sequence's own cache; the plan says where entries live. Outputs are the same either way."""

    def __init__(self, model: torch.nn.Module, group_rows: bool = True, fixed_shapes: bool | None = None,
                 batch_invariant: bool = False, stats: StepStats | None = None):
        self.model = model
        self.stats = stats if stats is not None else StepStats()  # what its steps did (captures included)
        self.device = next(model.parameters()).device
        self.batch_invariant = bool(batch_invariant)
        if self.batch_invariant:
            check_invariant_model(model, self.device)
        self.batch = BatchCache(model.config.get_text_config().num_hidden_layers, group_rows)
        self.fixed_shapes = fixed_shapes_default(self.device) if fixed_shapes is None else bool(fixed_shapes)
        # owner of rows (an arena) -> {q: (the StepKey it was built for, the StaticStep)}
        self.steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # where graphs are captured (CUDA, or a CPU under keydiff.decode.graphs.stand_in_graphs), the CUDA layout
        self.full_width = FULL_WIDTH.get(self.device.type, False) or calls_for(self.device) is not None

    def invariant(self):
        """The context the decoding steps run in: the batch-invariant mode for this device, or nothing."""
        return batch_invariant.for_device(self.device) if self.batch_invariant else contextlib.nullcontext()

    def run(self, plan: StepPlan) -> StepOutput:
        """One forward pass of the plan's tokens, each row at its own position, then eviction."""
        return self._run_fixed(plan) if plan.shape == "fixed" else self._run_general(plan)

    def forget(self, owner) -> None:
        """Drop the fixed-shape steps built over `owner`'s rows (a prompt's own arena, once its prefill ended)."""
        self.steps.pop(owner, None)

    def fixed_steps(self) -> list[StaticStep]:
        """Every fixed-shape step it keeps (what a GPU replays as CUDA graphs)."""
        return [step for held in self.steps.values() for _, step in held.values()]

    def _run_general(self, plan: StepPlan) -> StepOutput:
        """Through the batch cache: every sequence over its own cache."""
        batch = self.batch
        batch.bind(list(plan.caches), list(plan.row_counts))
        try:
            output = self.model(input_ids=plan.ids, position_ids=plan.positions, cache=batch, use_cache=True,
                                logits_to_keep=1)
            if batch.group_rows:
                self.stats.grouped([group.members for group in batch.groups])
            batch.evict()
            return StepOutput(output.logits[:, -1, :].float(), tuple(batch.spans))
        finally:
            batch.release()

    def _run_fixed(self, plan: StepPlan) -> StepOutput:
        """In fixed shapes: every row of the step's W, those of no going sequence parked (inactive, discarded)."""
        step = self._fixed_step(plan)
        logits = step.run(plan.ids, plan.positions, plan.active)
        self.stats.runs[step.rows.width, plan.q] += 1
        for arena, slot in plan.slots:  # the host half of the pass the step wrote and evicted
            arena.begin_pass(slot, plan.q, evicted=True)
        return StepOutput(logits, plan.spans)

    def _fixed_step(self, plan: StepPlan) -> StaticStep:
        """The step for the plan's key, built over the plan's rows if it has none for that key (other buffers, rows,
        policy or N than its last one for this owner and q)."""
        held = self.steps.get(plan.owner)
        built = None if held is None else held.get(plan.q)
        if built is None or built[0] != plan.key:
            key = plan.key
            step = StaticStep(self.model, plan.rows, key.policy, key.budget, key.q, stats=self.stats)
            self.stats.built.append((step.rows.width, key.q))
            if held is None:
                held = self.steps[plan.owner] = {}
            built = held[plan.q] = (key, step)
        return built[1]


# Whether the fixed-shape step runs, by device type (docs/performance.md); others (mps, ...) run the ordinary step.
FIXED_SHAPES_DEFAULT = {"cuda": True, "cpu": True}
# Whether a block's fixed-shape step runs every slot (one shape for a CUDA graph) or only the going ones' slots.
FULL_WIDTH = {"cuda": True, "cpu": False}


def decode_step(scheduler, active: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
    """One decoding step of every active sequence: choose each one's next tokens, then one evicting forward pass of
    those still going, planned by `scheduler` and run by its model runner; returns (still going, stopped)."""
    runner = scheduler.runner
    device = runner.device
    sync(device)
    start = time.perf_counter()
    choose_tokens(active)
    going = [sequence for sequence in active if not sequence.done]
    chosen = time.perf_counter() - start
    if going:
        plan = scheduler.plan(going)
        output = runner.run(plan)
        scheduler.advance(going, plan.q)
        rows = sum(plan.row_counts)
        runner.stats.steps += 1
        for sequence, span in zip(going, output.spans):
            sequence.logits = output.logits[span]
            sequence.batch_sizes.append(rows)
            if sequence.request.record_steps:
                sequence.step_entries.append(max(layer.num_entries for layer in sequence.cache.layers))
    sync(device)
    step = time.perf_counter() - start
    for sequence in active:
        sequence.seconds += chosen if sequence.done else step
    return going, [sequence for sequence in active if sequence.done]


def check_invariant_model(model: torch.nn.Module, device: torch.device) -> None:
    """Refuse batch_invariant=True in one line where it has no form (device, spread model, flash_attention_2)."""
    batch_invariant.check_device(device)
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ValueError(f"batch_invariant=true runs a model on one device, this one is spread over {len(devices)} "
                         "(valid: model.device_map=null)")
    if base_implementation(model) == "flash_attention_2":
        raise ValueError("batch_invariant=true does not combine with attn_implementation=flash_attention_2 (valid: "
                         "sdpa, eager)")


def fixed_shapes_default(device: torch.device) -> bool:
    """Whether this device runs the fixed-shape step by default (FIXED_SHAPES_DEFAULT; unlisted: no)."""
    return FIXED_SHAPES_DEFAULT.get(device.type, False)
