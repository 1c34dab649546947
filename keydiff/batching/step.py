"""The decoding step: every running sequence picks its next token, then one forward pass of those still going,
which evicts; in fixed shapes where every row is full and alike (keydiff.batching.static), else through the batch
cache (keydiff.batching.rows). Design: docs/design/decode.md#the-step-steppy
"""

from __future__ import annotations

import contextlib
import time
import weakref

import torch

from keydiff.attention import base_implementation
from keydiff.batching.graphs import calls_for
from keydiff.batching.rows import BatchCache
from keydiff.batching.sequence import Sequence
from keydiff.batching.static import StaticStep, StepStats, eligible
from keydiff.cache.arena import Arena, layout
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
    """Every running sequence's next tokens (the token rule: keydiff.batching.sequence.Sequence)."""
    greedy = [sequence for sequence in active if not sequence.done and sequence.plain_greedy]
    choose_greedy(greedy)
    chosen = set(map(id, greedy))
    for sequence in active:
        if not sequence.done and id(sequence) not in chosen:
            sequence.choose()


class Stepper:
    """What runs a step's forward pass: the batch cache, or, where every going sequence is full and alike, a
    fixed-shape step kept per block (or stack) and replayed. fixed_shapes: None = device default, False = never.
    batch_invariant: run under keydiff.kernels.batch_invariant's mode. Outputs are the same either way."""

    def __init__(self, model: torch.nn.Module, group_rows: bool = True, fixed_shapes: bool | None = None,
                 batch_invariant: bool = False, stats: StepStats | None = None):
        self.model = model
        self.stats = stats if stats is not None else StepStats()  # what its steps did (captures included)
        self.device = next(model.parameters()).device
        self.batch_invariant = bool(batch_invariant)
        if self.batch_invariant:
            check_invariant_model(model, self.device)
        self.batch = BatchCache(model.config.get_text_config().num_hidden_layers, group_rows)
        self.group_rows = group_rows
        self.fixed_shapes = fixed_shapes_default(self.device) if fixed_shapes is None else bool(fixed_shapes)
        # arena -> (the slots its step was built on, first and stop; the StaticStep)
        self.steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # where graphs are captured (CUDA, or a CPU under keydiff.batching.graphs.stand_in_graphs), the CUDA layout
        self.full_width = FULL_WIDTH.get(self.device.type, False) or calls_for(self.device) is not None

    def invariant(self):
        """The context the decoding steps run in: the batch-invariant mode for this device, or nothing."""
        return batch_invariant.for_device(self.device) if self.batch_invariant else contextlib.nullcontext()

    def forward(self, going: list[Sequence]) -> None:
        """One forward pass of the sequences' last tokens, each row at its own position, then eviction; each
        sequence gets its next-token logits."""
        fixed = self.fixed_step(going) if self.fixed_shapes else None
        if fixed is not None:
            self.forward_fixed(going, *fixed)
        else:
            self.forward_rows(going)
        rows = sum(sequence.row_count for sequence in going)
        self.stats.steps += 1
        for sequence in going:
            sequence.batch_sizes.append(rows)
            if sequence.request.record_steps:
                sequence.step_entries.append(max(layer.num_entries for layer in sequence.cache.layers))

    def forward_rows(self, going: list[Sequence]) -> None:
        """Through the batch cache: every sequence over its own cache."""
        device, batch = self.device, self.batch
        ids = torch.tensor([[token] for sequence in going for token in sequence.last], dtype=torch.long, device=device)
        positions = torch.tensor([[sequence.cache.get_seq_length()] for sequence in going
                                  for _ in range(sequence.row_count)], dtype=torch.long, device=device)
        batch.bind([sequence.cache for sequence in going], [sequence.row_count for sequence in going])
        try:
            output = self.model(input_ids=ids, position_ids=positions, cache=batch, use_cache=True, logits_to_keep=1)
            if batch.group_rows:
                self.stats.grouped([group.members for group in batch.groups])
            batch.evict()
            logits = output.logits[:, -1, :].float()
            for sequence, span in zip(going, batch.spans):
                sequence.logits = logits[span]
        finally:
            batch.release()

    def fixed_step(self, going: list[Sequence]) -> tuple[StaticStep, list[int]] | None:
        """The fixed-shape step the going sequences can share, and each one's first row in it; None if they
        cannot (not all full and alike, or not all in one block / one sequence alone in its own stack)."""
        caches = [sequence.cache for sequence in going]
        if not eligible(caches) or (not self.group_rows and len(caches) > 1):  # group_rows=False: each on its own
            return None
        handles = [cache.stack.handle for cache in caches]
        arena = handles[0].arena
        if all(handle.arena is arena for handle in handles) and (arena.shared or len(caches) == 1):
            slots = [handle.slot for handle in handles]
            # A CUDA graph is replayed for every slot of a shared arena (one shape for the run); elsewhere only the
            # consecutive slots the going sequences span run (idle rows would be work for nothing).
            first, stop = (0, arena.slots) if self.full_width else (min(slots), max(slots) + 1)
            starts = [slot - first for slot in slots]
        else:
            return None
        built, step = self.steps.get(arena, (None, None))
        policy, budget = caches[0].policy, caches[0].stack.budget
        # Built for these buffers and rows, this policy and N: a stack may have moved to other buffers, the going
        # sequences may span other slots, and a block's rows of another policy (a neighbour that joined its
        # slots) may be the ones going now.
        if step is None or built != (first, stop) or step.policy != policy or step.budget != budget:
            step = StaticStep(self.model, arena.rows(first, stop), policy, budget, stats=self.stats)
            self.stats.built.append((step.rows.width, step.q))
            self.steps[arena] = ((first, stop), step)
        return step, starts

    def forward_fixed(self, going: list[Sequence], step: StaticStep, starts: list[int]) -> None:
        """In fixed shapes: every row of the step's W, those of no going sequence parked (inactive, discarded)."""
        width = step.rows.width
        ids, positions, active = [0] * width, [0] * width, [False] * width
        for sequence, start in zip(going, starts):
            position = sequence.cache.get_seq_length()
            for row, token in enumerate(sequence.last):
                ids[start + row], positions[start + row], active[start + row] = token, position, True
        device = self.device
        logits = step.run(torch.tensor(ids, device=device)[:, None], torch.tensor(positions, device=device)[:, None],
                          torch.tensor(active, device=device))
        self.stats.runs[width, 1] += 1
        for sequence, start in zip(going, starts):
            sequence.logits = logits[start : start + sequence.row_count]
            sequence.cache.note_fixed_step(1)


# Whether the fixed-shape step runs where it can, by device type (measured: docs/performance.md); a device type
# not listed (mps, ...) runs the ordinary step.
FIXED_SHAPES_DEFAULT = {"cuda": True, "cpu": True}
# Whether a block's fixed-shape step always runs every slot (one shape for the run: what a CUDA graph replays),
# or only the consecutive slots the going sequences span (no graph to keep: idle rows would be work for nothing).
FULL_WIDTH = {"cuda": True, "cpu": False}


class BlockStepper:
    """A prefill's blocks in fixed shapes once its cache holds N entries (replayed as a CUDA graph on a GPU).
    keydiff.engine.prefill asks `run` per block and runs the ordinary pass where it answers None, then `finish`.
    arena: run in a one-slot shared arena kept across prompts (`slot`)."""

    def __init__(self, model: torch.nn.Module, fixed_shapes: bool | None = None, arena: bool = False,
                 stats: StepStats | None = None):
        self.model = model
        self.stats = stats if stats is not None else StepStats()  # what its steps did (captures included)
        device = next(model.parameters()).device
        self.enabled = fixed_shapes_default(device) if fixed_shapes is None else bool(fixed_shapes)
        self.keep_slot = arena
        self.slot: Arena | None = None
        # The step over the slot (kept across prompts: one graph per run) and, for a prompt in its own buffers
        # (no slot, or one shaped unlike the slot's), the step over those (dropped when its prefill ends).
        self.kept: tuple[tuple, StaticStep] | None = None
        self.own: tuple[tuple, StaticStep] | None = None

    def run(self, cache, ids: torch.Tensor, start: int, block: int) -> torch.Tensor | None:
        """Next-token logits [rows, vocab] after the block `ids` [rows, q] at `start`, in fixed shapes; None if it cannot."""
        q = ids.shape[1]
        if not self.enabled or q != block or not eligible([cache], q):
            return None
        stack = cache.stack
        in_slot = self.keep_slot and self.enter(stack)
        source = self.slot if in_slot else stack.handle.arena
        built = (source, q, cache.policy, stack.budget)
        held = self.kept if in_slot else self.own
        # Built for these buffers (a stack can move), this block length, policy and N.
        if held is None or held[0][0] is not source or held[0][1:] != built[1:]:
            held = (built, StaticStep(self.model, source.rows(), cache.policy, stack.budget, q, stats=self.stats))
            self.stats.built.append((held[1].rows.width, q))
            if in_slot:
                self.kept = held
            else:
                self.own = held
        step = held[1]
        positions = torch.arange(start, start + q, device=ids.device).expand(ids.shape[0], q)
        logits = step.run(ids, positions, step.active)
        self.stats.runs[step.rows.width, q] += 1
        cache.note_fixed_step(q)
        return logits

    def enter(self, stack) -> bool:
        """Move `stack` into the kept slot (it may be there already); False, nothing moved, if shaped otherwise."""
        if self.slot is not None and self.slot.holds(0, stack):
            return True
        if self.slot is None:
            self.slot = Arena.like(stack, 1, self.stats)
        elif self.slot.layout != layout(stack):
            return False
        self.slot.vacate(0)  # a prefill that ended without leaving gets its entries back first
        return self.slot.take(0, stack)

    @property
    def step(self) -> StaticStep | None:
        """The step over the kept slot (what a GPU replays for every prompt of the run), else the last prompt's own."""
        held = self.kept or self.own
        return None if held is None else held[1]

    def finish(self, cache, failed: bool = False) -> None:
        """The prefill of `cache` ended: leave the arena's slot (with its entries unless failed) or drop the step on its buffers."""
        self.own = None
        if self.slot is not None and cache.stack is not None and self.slot.occupant[0] is cache.stack:
            self.slot.vacate(0, keep=not failed)


def decode_step(stepper: Stepper, active: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
    """One decoding step of every active sequence: choose each one's next tokens, then one forward pass of those
    still going (which evicts); returns (still going, stopped)."""
    device = stepper.device
    sync(device)
    start = time.perf_counter()
    choose_tokens(active)
    going = [sequence for sequence in active if not sequence.done]
    chosen = time.perf_counter() - start
    if going:
        stepper.forward(going)
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
