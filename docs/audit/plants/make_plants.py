"""Make the planted-bug patches from PLANTS (exact text edits), in a worktree given as argv[1] (default: cwd).

Each plant: ID, one-line description, where (file: function, so it can be re-planted by hand after a move),
the pytest arguments expected to catch it (';'-separated groups run in one pytest call), and its edits
(file, old text, new text; the old text must occur exactly once). Writes <ID>.patch and INDEX.tsv beside this
file; every file is reverted with `git checkout --` after its diff is taken. Nothing is committed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

FX = "tests/test_fixed_shapes.py"
DEC = "tests/test_decoder.py"
BK = "tests/test_bookkeeping.py"
RS = "tests/test_run_scheduling.py"
BR = "tests/test_batched_runs.py"
BAT = "tests/test_batching.py"

PLANTS = [
    # ---------------------------------------------------------------- §4 bookkeeping / scheduling (P1-P11)
    ("P1", "a row that stops in a step is counted in that step's batch_sizes (decode_step counts `active`, not `going`)",
     "keydiff/decode/step.py: decode_step (rows = sum(plan.row_counts)); was Stepper.forward",
     [f"{BK} -k batch_sizes"],
     [("keydiff/decode/step.py",
       "        rows = sum(plan.row_counts)",
       "        rows = sum(sequence.row_count for sequence in active)")]),
    ("P1b", "Stepper.forward counts sequences, not rows, in batch_sizes (a multi-row sequence counts 1)",
     "keydiff/decode/step.py: decode_step (rows = sum(plan.row_counts)); was Stepper.forward",
     [f"{BAT} -k multi_row", f"{BK} -k batch_sizes"],
     [("keydiff/decode/step.py",
       "        rows = sum(plan.row_counts)",
       "        rows = len(plan.row_counts)")]),
    ("P2", "follow_up reports the old held suffix plus the new one",
     "keydiff/engine.py: follow_up (replace(..., held_suffix=0))",
     [f"{BK} -k follow_up"],
     [("keydiff/engine.py",
       "    turn = replace(state, seconds=0.0, held_suffix=0, decoded=False)",
       "    turn = replace(state, seconds=0.0, decoded=False)")]),
    ("P3", "ruler_shared asking order seeded from the depths' stream",
     "keydiff/tasks/ruler_shared.py: RulerShared.asking_order (sub_seed name)",
     [f"{RS} -k asking_order"],
     [("keydiff/tasks/ruler_shared.py",
       'random.Random(sub_seed("ruler_shared/asking_order", self.seed, self.length, context)).shuffle(order)',
       'random.Random(sub_seed("ruler_shared/depths", self.seed, self.length, context)).shuffle(order)')]),
    ("P4a", "a copy of a placed storage deep-copies the block views (holds the whole block)",
     "keydiff/cache/arena.py: Arena.copied (shared branch: the slot's entries moved out, not the whole buffers "
     "deep-copied); was Storage.__deepcopy__",
     [f"{BK} -k copy_of_a_fork"],
     [("keydiff/cache/arena.py",
       "        if self.shared:\n            arena = self.moved(slot)\n            arena.reserved = 0\n            return arena\n",
       "        if self.shared:\n"
       "            keys, values, positions, state = copy.deepcopy((self.keys, self.values, self.positions, self.state),"
       " memo)\n"
       "            cut = slice(slot, slot + 1)\n"
       "            arena = Arena(1, self.layers, (keys[cut], values[cut], positions[cut],\n"
       "                                           {name: s[cut] for name, s in state.items()}))\n"
       "            arena.host[0] = self.host[slot]\n"
       "            return arena\n")]),
    ("P4b", "a copy of a placed storage shares the original's placement (and so its block's buffers)",
     "keydiff/cache/storage.py: Storage.__deepcopy__ (twin.bind(Handle(...copied...)): the copy's own handle)",
     [f"{BK} -k copy_of_a_fork"],
     [("keydiff/cache/storage.py",
       "        twin.bind(Handle(self.handle.arena.copied(self.handle.slot, memo), 0))",
       "        twin.bind(self.handle if self.handle.shared\n"
       "                  else Handle(self.handle.arena.copied(self.handle.slot, memo), 0))")]),
    ("P4c", "a copy of a placed storage deep-copies its placement (the whole block with it)",
     "keydiff/cache/storage.py: Storage.__deepcopy__ (twin.bind(Handle(...copied...)): the handle itself is never "
     "deep-copied, VIEWS)",
     [f"{BK} -k copy_of_a_fork"],
     [("keydiff/cache/storage.py",
       "        twin.bind(Handle(self.handle.arena.copied(self.handle.slot, memo), 0))",
       # (the neighbours' storages mapped to None in the memo: deep-copying them would recurse into the half-built
       # arena copy and crash inside fork, before the test can look at what the copy holds)
       "        twin.bind(copy.deepcopy(self.handle, memo | {id(o): None for o in self.handle.arena.occupant"
       " if o is not self})\n"
       "                  if self.handle.shared\n"
       "                  else Handle(self.handle.arena.copied(self.handle.slot, memo), 0))")]),
    ("P5", "a held suffix's capacity planned one entry short (the first decoding step reallocates)",
     "keydiff/engine.py: prefill (EvictingCache block_size=max(step, held_suffix + 1))",
     [f"{BK} -k held_suffix_longer"],
     [("keydiff/engine.py",
       "block_size=max(step, held_suffix + 1) if held_suffix else step",
       "block_size=max(step, held_suffix) if held_suffix else step")]),
    ("P6", "a freed join-pool slot is never reused",
     "keydiff/decode/blocks.py: JoinPool.place (slot = min(self.stopped))",
     [f"{BK} -k freed_join_pool"],
     [("keydiff/decode/blocks.py",
       "        if slot is None and self.stopped:\n            slot = min(self.stopped)\n",
       "")]),
    ("P7a", "join pool hands on a slot still in use (the free-slot search takes the first slot not holding this stack)",
     "keydiff/decode/blocks.py: JoinPool.place (slot = next(... if occupant is None ...))",
     [f"{BK} -k 'keeps_its_slot or freed_join_pool'", f"{BAT} -k pooled"],
     [("keydiff/decode/blocks.py",
       "        slot = next((i for i, occupant in enumerate(arena.occupant) if occupant is None), None)",
       "        slot = next((i for i, occupant in enumerate(arena.occupant) if occupant is not stack), None)")]),
    ("P7b", "JoinPool.leave marks every occupied slot stopped, not only the leaving sequence's",
     "keydiff/decode/blocks.py: JoinPool.leave",
     [f"{BK} -k keeps_its_slot"],
     [("keydiff/decode/blocks.py",
       "if occupant is not None and occupant is stack)",
       "if occupant is not None)")]),
    ("P8", "_same_prompt compares prompt lengths, not token ids",
     "keydiff/run/batched.py: _same_prompt",
     [f"{RS} -k equal_length"],
     [("keydiff/run/batched.py",
       "    return own if own.input_ids == prompt.input_ids else None",
       "    return own if len(own.input_ids) == len(prompt.input_ids) else None")]),
    ("P9", "shard selection without the task's shard group (each sample its own group)",
     "keydiff/run/runner.py: run (shards.select(..., plan.task.shard_group))",
     [f"{RS} -k shard"],
     [("keydiff/run/runner.py",
       'shards.select(shards.parse_shard(cfg.get("shard")), samples, plan.task.shard_group)',
       'shards.select(shards.parse_shard(cfg.get("shard")), samples)')]),
    ("P10", "a resumed multi-turn conversation replays no earlier turn (only the wanted questions)",
     "keydiff/run/shared.py: shared_rows (samples = by_group[group])",
     [f"{RS} -k resumed_conversation"],
     [("keydiff/run/shared.py",
       "        samples = by_group[group]\n",
       "        samples = [sample for sample in by_group[group] if sample.id in wanted]\n")]),
    ("P11", "after out of memory the job whose prefill failed is not started again (only the ones in flight)",
     "keydiff/decode/scheduler.py: Decoder.generate (jobs = ... + [starting])",
     [f"{RS} -k forks_still_waiting", f"{BR} -k in_a_prefill"],
     [("keydiff/decode/scheduler.py",
       "                jobs = [sequence.request.job for sequence in active] + ([starting] if starting is not None else [])",
       "                jobs = [sequence.request.job for sequence in active]")]),
    # ---------------------------------------------------------------- §4 fixed-shape step / block manager (S1-S10)
    ("S1", "an idle row's eviction is not masked (fixed step moves the new entry into the dropped place everywhere)",
     "keydiff/cache/evict.py: evict (active given, n - budget == 1: torch.where(active, dropped, tail)); "
     "was StaticStep.evict",
     [f"{FX} -k 'junk or idle_slot'"],
     [("keydiff/cache/evict.py",
       "        move_entries(buffers, tail, torch.where(active[:, None, None], dropped, tail))",
       "        move_entries(buffers, tail, dropped)")]),
    ("S2", "the new positions are written into idle rows too",
     "keydiff/decode/static.py: StaticStep.evict (write_active(rows['positions'] ...))",
     [f"{FX} -k 'junk or idle_slot'"],
     [("keydiff/decode/static.py",
       '        write_active(rows["positions"][:, :, n:stop], new_positions, row_active)',
       '        rows["positions"][:, :, n:stop] = new_positions')]),
    ("S3", "the new positions go to the wrong slot (rows' positions taken in reverse slot order)",
     "keydiff/decode/static.py: StaticStep.evict (new_positions = positions[sequence_of])",
     [f"{FX} -k 'give_what_the_ordinary and keydiff'"],
     [("keydiff/decode/static.py",
       "        new_positions = positions[self.rows.sequence_of][:, None, :]",
       "        new_positions = positions.flip(0)[self.rows.sequence_of][:, None, :]")]),
    ("S4", "a row below N runs the fixed step (eligible accepts num_entries < budget)",
     "keydiff/decode/plan.py: SequenceRecord.ready (self.entries == self.budget); was static.eligible",
     [f"{FX} -k 'still_filling or give_what_the_ordinary'"],
     [("keydiff/decode/plan.py",
       "not self.held and self.entries == self.budget",
       "not self.held and self.entries <= self.budget")]),
    ("S5", "a slot decoding again (a follow-up turn) stays marked stopped, so the pool hands it on",
     "keydiff/decode/blocks.py: JoinPool.place (resident branch, arena.holds: self.stopped.discard)",
     [f"{BK} -k keeps_its_slot", f"{DEC} -k follow_up"],
     [("keydiff/decode/blocks.py",
       "                self.stopped.discard(slot)  # decoding again in its slot (a follow-up turn): not free\n",
       "")]),
    ("S6", "W computed from the going rows' count instead of their span (min(slots) + len(slots))",
     "keydiff/decode/scheduler.py: Decoder._fixed (first, stop = ...); was Stepper.fixed_step",
     ["tests/test_golden_batching.py -k keydiff", f"{BAT} -k 'pooled or any_batch_order or forks_lie'"],
     [("keydiff/decode/scheduler.py",
       "else (min(slots), max(slots) + 1)",
       "else (min(slots), min(slots) + len(slots))")]),
    ("S7", "a block's step is reused for another span of slots",
     "keydiff/decode/step.py: ModelRunner._fixed_step (built[0] != plan.key: StepKey's first, stop); "
     "was Stepper.fixed_step",
     [f"{BAT} -k 'pooled or any_batch_order or forks_lie'", f"{FX} -k give_what_the_ordinary"],
     [("keydiff/decode/step.py",
       "        if built is None or built[0] != plan.key:",
       "        if built is None or built[0] != type(plan.key)(plan.key.buffers, built[0].first, built[0].stop, "
       "plan.key.q,\n"
       "                                                       plan.key.policy, plan.key.budget):")]),
    ("S8", "eligible() is missing its eviction check (evicts_next_pass)",
     "keydiff/decode/scheduler.py: read_cache (evicting = evict and ...; held = ... not cache.evicts_next_pass()); "
     "was static.eligible",
     [f"{FX} -k 'still_filling or give_what_the_ordinary'", f"{BAT} -k statistics_modes"],
     [("keydiff/decode/scheduler.py",
       "    evicting = evict and cache.budget is not None\n"
       "    held = evicting and (not cache.evicts_next_pass() or (stack is not None and stack.fresh is not None))",
       "    evicting = cache.budget is not None\n"
       "    held = evicting and (stack is not None and stack.fresh is not None)")]),
    ("S9", "a sequence moved into a block keeps the step that holds its old buffers",
     "keydiff/decode/step.py: ModelRunner.__init__ (self.steps keyed weakly by arena: a step over the arena a "
     "sequence left goes with it); was Stepper.fixed_step (self.steps.pop(cache.stack))",
     [f"{FX} -k moves_into_a_block"],
     [("keydiff/decode/step.py",
       "        self.steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()",
       "        self.steps: dict = {}")]),
    ("S10", "eligible() is missing its profile check (a profiled run takes the fixed step)",
     "keydiff/decode/scheduler.py: read_cache (fixed_ok: not cache.profile); was static.eligible",
     [f"{FX} -k profiled"],
     [("keydiff/decode/scheduler.py",
       "                and not cache.profile  # a profiled run times its statistics and evictions apart: the ordinary step\n",
       "")]),
    # ---------------------------------------------------------------- mutation-audit categories (M01-)
    ("M01", "unmasked write of the new entry into idle rows (the fixed layer's update)",
     "keydiff/decode/static.py: _FixedLayer.update (write_active)",
     [f"{FX} -k 'junk or idle_slot'"],
     [("keydiff/decode/static.py",
       "        write_active(keys[:, :, self.kept : stop], key_states, self.active)\n"
       "        write_active(values[:, :, self.kept : stop], value_states, self.active)",
       "        keys[:, :, self.kept : stop] = key_states\n"
       "        values[:, :, self.kept : stop] = value_states")]),
    ("M02", "shared H2O state: one accumulated score for every row (mean over rows)",
     "keydiff/policies/h2o.py: H2O.observe",
     [f"{FX} -k 'junk and h2o'", "tests/test_golden.py -k 'recorded and h2o'"],
     [("keydiff/policies/h2o.py",
       '        layer.state["h2o"].add_(layer.attention)',
       '        layer.state["h2o"].add_(layer.attention.mean(dim=0, keepdim=True))')]),
    ("M03", "KeyDiff anchor averaged across rows (one anchor per head for all rows)",
     "keydiff/policies/keydiff.py: cosine_to_mean (normalized anchor)",
     [f"{BAT} -k 'batch_of_four and keydiff'", "tests/test_golden.py -k 'recorded and keydiff'"],
     [("keydiff/policies/keydiff.py",
       "        anchor = (inv_norms[..., None, :] @ keys) / keys.shape[-2]  # [..., 1, d]",
       "        anchor = ((inv_norms[..., None, :] @ keys) / keys.shape[-2]).mean(dim=0, keepdim=True)")]),
    ("M04", "W changes as sequences stop: a replayed (full-width) block step spans only up to the last going slot",
     "keydiff/decode/scheduler.py: Decoder._fixed (full_width: (0, lead.slots)); was Stepper.fixed_step",
     [f"{DEC} -k 'one_arena or forks_move'"],
     [("keydiff/decode/scheduler.py",
       "            first, stop = (0, lead.slots) if self.runner.full_width",
       "            first, stop = (0, max(slots) + 1) if self.runner.full_width")]),
    ("M05", "a branch on a tensor in the step (if bool(row_active.all()))",
     "keydiff/cache/evict.py: evict (active given, n - budget == 1); was StaticStep.evict",
     [f"{FX} -k 'compiles and keydiff'"],
     [("keydiff/cache/evict.py",
       "        move_entries(buffers, tail, torch.where(active[:, None, None], dropped, tail))",
       "        if bool(active.all()):\n            move_entries(buffers, tail, dropped)\n"
       "        else:\n"
       "            move_entries(buffers, tail, torch.where(active[:, None, None], dropped, tail))")]),
    ("M06", "`.item()`-style read in the step: int(active.sum())",
     "keydiff/decode/static.py: StaticStep.eager",
     [f"{FX} -k 'compiles and keydiff'"],
     [("keydiff/decode/static.py",
       "        logits = self.forward(ids, positions)\n        self.evict(positions, active)\n        return logits",
       "        logits = self.forward(ids, positions)\n        if int(active.sum()) == 0:\n            return logits\n"
       "        self.evict(positions, active)\n        return logits")]),
    ("M07", "a host read of a float in the step: float(keys.abs().amax())",
     "keydiff/decode/static.py: StaticStep.evict",
     [f"{FX} -k 'compiles and keydiff'"],
     [("keydiff/decode/static.py",
       "        rows = self.rows.buffers()\n",
       "        rows = self.rows.buffers()\n"
       "        if float(rows[\"keys\"].abs().amax()) < 0:\n            raise RuntimeError(\"negative magnitude\")\n")]),
    ("M08", "golden: the keydiff preset's anchor changed (conf/policy/keydiff.yaml normalized_mean -> mean)",
     "conf/policy/keydiff.yaml: params.anchor",
     ["tests/test_golden.py -k 'recorded and keydiff'"],
     [("conf/policy/keydiff.yaml",
       "  anchor: normalized_mean   # normalized_mean",
       "  anchor: mean   # normalized_mean")]),
    ("M08b", "golden: KeyDiff's Python default anchor changed (normalized_mean -> mean; what the API uses)",
     "keydiff/policies/keydiff.py: KeyDiff.anchor default",
     ["tests/test_golden_batching.py -k keydiff"],
     [("keydiff/policies/keydiff.py",
       '    anchor: str = "normalized_mean"',
       '    anchor: str = "mean"')]),
    ("M09", "golden: sampling temperature applied slightly off (temperature * 0.9)",
     "keydiff/decode/sequence.py: next_token (softmax(logits / temperature))",
     ["tests/test_golden_batching.py -k recorded"],
     [("keydiff/decode/sequence.py",
       "    probs = torch.softmax(logits / max(temperature, 1e-6), dim=-1)",
       "    probs = torch.softmax(logits / max(temperature * 0.9, 1e-6), dim=-1)")]),
    ("M10", "golden: H2O state accumulates a transformed statistic (sqrt of the attention)",
     "keydiff/policies/h2o.py: H2O.observe",
     ["tests/test_golden.py -k 'recorded and h2o'"],
     [("keydiff/policies/h2o.py",
       '        layer.state["h2o"].add_(layer.attention)',
       '        layer.state["h2o"].add_(layer.attention.sqrt())')]),
    ("M11", "golden: report tables' default decimals changed (write_table precision 2 -> 3)",
     "keydiff/report/render.py: write_table (precision=2)",
     ["tests/test_golden_reports.py", "tests/test_tables.py"],
     [("keydiff/report/render.py",
       "def write_table(table: pd.DataFrame, mask: pd.DataFrame | None, out: Path, name: str, caption: str, precision=2,",
       "def write_table(table: pd.DataFrame, mask: pd.DataFrame | None, out: Path, name: str, caption: str, precision=3,")]),
    ("M12", "FLOP count: attention's FLOPs over the entries left out",
     "keydiff/bench/floor.py: step_flops",
     ["tests/test_floor.py"],
     [("keydiff/bench/floor.py",
       "    return 2 * rows * (matrices + attention)",
       "    return 2 * rows * matrices")]),
    ("M13", "FLOP count: an untied input embedding counted as a matmul",
     "keydiff/bench/floor.py: step_flops (tie_word_embeddings)",
     ["tests/test_floor.py"],
     [("keydiff/bench/floor.py",
       "    if not getattr(config, \"tie_word_embeddings\", False):\n"
       "        matrices -= model.get_input_embeddings().weight.numel()\n",
       "")]),
    ("M14", "byte count: only the keys of each row's entries (values left out)",
     "keydiff/bench/floor.py: step_bytes",
     ["tests/test_floor.py"],
     [("keydiff/bench/floor.py",
       "    return weights + kv_cache_bytes(None, model, entries, rows)",
       "    return weights + kv_cache_bytes(None, model, entries, rows) // 2")]),
    ("M15", "byte count: the weights counted once per row",
     "keydiff/bench/floor.py: step_bytes",
     ["tests/test_floor.py"],
     [("keydiff/bench/floor.py",
       "    return weights + kv_cache_bytes(None, model, entries, rows)",
       "    return weights * rows + kv_cache_bytes(None, model, entries, rows)")]),
    ("M16", "the fixed-shape step rebuilt on every call",
     "keydiff/decode/step.py: ModelRunner._fixed_step (if built is None or ...); was Stepper.fixed_step",
     [f"{DEC} -k 'one_arena'", f"{FX} -k run_the_one_step"],
     [("keydiff/decode/step.py",
       "        if built is None or built[0] != plan.key:",
       "        if True or built is None or built[0] != plan.key:")]),
    ("M17", "the out-of-memory back-off goes to width - 1 instead of halving",
     "keydiff/decode/scheduler.py: Decoder._back_off (self.width = max(1, failed_width // 2))",
     [f"{BR} -k half_the_width"],
     [("keydiff/decode/scheduler.py",
       "            self.width = max(1, failed_width // 2)",
       "            self.width = max(1, failed_width - 1)")]),
    ("M18", "jobs abandoned by a back-off are not started again",
     "keydiff/decode/scheduler.py: Decoder.generate (again.extendleft)",
     [f"{BR} -k half_the_width"],
     [("keydiff/decode/scheduler.py",
       "                again.extendleft(reversed([job for job in jobs if id(job) not in given_up]))\n",
       "")]),
    ("M19", "the back-off keeps the failed width's stepper/pool/blocks alive while rebuilding",
     "keydiff/decode/scheduler.py: Decoder._back_off (self._drop(): runner, pool, blocks)",
     [f"{BR} -k no_block_of_the_failed"],
     [("keydiff/decode/scheduler.py",
       "        try:\n            self._drop()\n            release_memory()",
       "        try:\n            self._previous = (self.runner, self.pool, self.blocks)\n"
       "            self._drop()\n            release_memory()")]),
    ("M20", "a second step function at width 1 (one going sequence takes the ordinary step)",
     "keydiff/decode/scheduler.py: Decoder.plan (fixed = self._fixed(records) if ...); was Stepper.forward",
     [f"{FX} -k 'still_filling or run_the_one_step'"],
     [("keydiff/decode/scheduler.py",
       "        fixed = self._fixed(records) if self.runner.fixed_shapes else None",
       "        fixed = self._fixed(records) if self.runner.fixed_shapes and len(records) > 1 else None")]),
    ("M21", "keydiff.generate does not take the fixed step by default (fixed_shapes=None read as False)",
     "keydiff/engine.py: generate (Decoder(model, 1, fixed_shapes=...))",
     [f"{FX} -k 'still_filling or run_the_one_step'"],
     [("keydiff/engine.py",
       "        decoder = Decoder(model, 1, fixed_shapes=fixed_shapes, batch_invariant=batch_invariant)",
       "        decoder = Decoder(model, 1, fixed_shapes=bool(fixed_shapes), batch_invariant=batch_invariant)")]),
    ("M22", "a recompile per step: the step reads a Python int that changes every call",
     "keydiff/decode/static.py: StaticStep.eager",
     [f"{FX} -k 'compiles and keydiff'"],
     [("keydiff/decode/static.py",
       "        logits = self.forward(ids, positions)\n        self.evict(positions, active)\n        return logits",
       "        logits = self.forward(ids, positions + 0 * self.calls)\n        self.evict(positions, active)\n"
       "        return logits")]),
    ("M23", "ownership by data_ptr: RowBlock.holds compares key-buffer pointers",
     "keydiff/cache/arena.py: Arena.holds; was RowBlock.holds",
     ["tests/test_layering.py"],
     [("keydiff/cache/arena.py",
       "        return self.occupant[slot] is storage and storage.handle == Handle(self, slot)",
       "        return (self.occupant[slot] is storage and storage.handle.arena.keys.data_ptr() == self.keys.data_ptr()\n"
       "                and storage.handle.slot == slot)")]),
    ("M24", "a data_ptr comparison outside any function (module level)",
     "keydiff/decode/blocks.py: module level (before placed)",
     ["tests/test_layering.py"],
     [("keydiff/decode/blocks.py",
       "def placed(stack: Storage) -> bool:",
       "SAME_BUFFER = (lambda a, b: a.data_ptr() == b.data_ptr())\n\n\ndef placed(stack: Storage) -> bool:")]),
    ("M25", "an import circle written as a function-level relative import (cache -> batching)",
     "keydiff/cache/storage.py: a function importing ..decode.blocks (before class Count; batching is now decode)",
     ["tests/test_layering.py"],
     [("keydiff/cache/storage.py",
       "\nclass Count:\n",
       "\ndef _decode_blocks():\n    from ..decode import blocks\n    return blocks\n\n\nclass Count:\n")]),
    ("M26", "the runner gives each sample its own Decoder (generate and prefill without the run's decoder)",
     "keydiff/run/samples.py: decode/prefill calls (decoder=ctx.decoder)",
     [f"{DEC} -k batch_one_run"],
     [("keydiff/run/samples.py",
       "    out = generate(ctx.model, state, **decode_settings(ctx, prompt.generation, seed), decoder=ctx.decoder)",
       "    out = generate(ctx.model, state, **decode_settings(ctx, prompt.generation, seed))"),
      ("keydiff/run/samples.py",
       "held_suffix=held,\n                    decoder=ctx.decoder)",
       "held_suffix=held)")]),
    ("M27", "a back-off keeps the shared prefill's forks not yet taken (memory not freed)",
     "keydiff/run/batched.py: SharedPrefill.abandon",
     [f"{BR} -k holds_no_fork"],
     [("keydiff/run/batched.py",
       "        the back-off frees), and every member still to start prefills alone.\"\"\"\n"
       "        self.broken, self.forks = True, {}",
       "        the back-off frees), and every member still to start prefills alone.\"\"\"\n"
       "        self.broken = True")]),
    ("M28", "a capture that fails is not recorded (Graphs.fail not called)",
     "keydiff/decode/static.py: StaticStep.record (self.stats.fail; was self.graphs.fail)",
     [f"{DEC} -k records_its_graph"],
     [("keydiff/decode/static.py",
       '            self.stats.fail(f"q={self.q}, W={self.rows.width}, {self.policy.name}: {reason}")\n',
       "            self.stats.stopped = True\n")]),
    ("M29", "greedy tokens mixed up: every sequence takes the first rows' tokens",
     "keydiff/decode/step.py: choose_greedy (start += row_count)",
     [f"{BAT} -k 'any_batch_order or batch_of_four'"],
     [("keydiff/decode/step.py",
       "        start += sequence.row_count\n",
       "")]),
    ("M30", "values written flipped across a group's rows",
     "keydiff/decode/blocks.py: write_groups (group.arena.values[...] = values)",
     [f"{BAT} -k 'any_batch_order or forks_lie'"],
     [("keydiff/decode/blocks.py",
       "        group.arena.values[group.first:stop, plane, 0, :, n - q : n] = values",
       "        group.arena.values[group.first:stop, plane, 0, :, n - q : n] = values.flip(0)")]),
    ("M31", "row order ignored: a group's rows assumed consecutive in the batch",
     "keydiff/decode/blocks.py: write_groups (rows == list(range(...)))",
     [f"{BAT} -k 'any_batch_order'"],
     [("keydiff/decode/blocks.py",
       "        if rows == list(range(rows[0], rows[-1] + 1)):",
       "        if True:")]),
    ("M32", "copy-out skipped: a vacated slot's occupant keeps pointing into the block",
     "keydiff/cache/arena.py: Arena.vacate (occupant.bind(Handle(self.moved(slot), 0))); was RowBlock.vacate",
     [f"{BAT} -k pooled", f"{BK} -k 'freed_join_pool or keeps_its_slot'"],
     [("keydiff/cache/arena.py",
       "        occupant.bind(Handle(self.moved(slot), 0))\n",
       "")]),
    ("M33", "the new entries' policy state goes to the wrong rows (fixed step, rows reversed)",
     "keydiff/cache/evict.py: init_fresh (active given: the fixed step's fresh entry state); was StaticStep.evict",
     [f"{FX} -k 'give_what_the_ordinary and keydiff'"],
     [("keydiff/cache/evict.py",
       "            value = torch.zeros_like(buffer[:, :, start:n]) if value is None else value.to(buffer.dtype)",
       "            value = torch.zeros_like(buffer[:, :, start:n]) if value is None else value.to(buffer.dtype).flip(0)")]),
    ("M34", "the attention statistic buffer is never written (policies observe zeros)",
     "keydiff/attention.py: StatisticBuffer write",
     [f"{FX} -k 'give_what_the_ordinary and h2o'"],
     [("keydiff/attention.py",
       "        (self.buffer[:, plane] if self.slot_major else self.buffer[plane]).copy_(statistic)\n",
       "")]),
]


def git(tree: Path, *args: str, check: bool = True) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], check=check, capture_output=True, text=True).stdout


def main() -> None:
    tree = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    only = set(sys.argv[2:])
    index = ["id\tdescription\twhere\ttests"]
    for pid, description, where, tests, edits in PLANTS:
        index.append("\t".join([pid, description, where, " ; ".join(tests)]))
        if only and pid not in only:
            continue
        if not edits:
            print(f"{pid}: no edits, skipped")
            continue
        files = sorted({f for f, _, _ in edits})
        try:
            for path, old, new in edits:
                text = (tree / path).read_text()
                if text.count(old) != 1:
                    raise SystemExit(f"{pid}: {path}: the old text occurs {text.count(old)} times")
                (tree / path).write_text(text.replace(old, new))
            (HERE / f"{pid}.patch").write_text(git(tree, "diff", "--", *files))
        finally:
            git(tree, "checkout", "--", *files)
        print(f"{pid}: {', '.join(files)}")
    if not only:
        (HERE / "INDEX.tsv").write_text("\n".join(index) + "\n")


if __name__ == "__main__":
    main()
