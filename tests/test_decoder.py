"""A run's Decoder (keydiff.decode.scheduler): one width, one arena and one fixed-shape step per shape across a run's
calls. FULL_WIDTH set for the CPU stands for a GPU's arrangement (every sequence in the arena's slots, one graph
replayed): the tokens of a decoder-less run, one step per shape."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import keydiff
from keydiff import Decoder, generate, prefill
from keydiff.decode import step
from keydiff.decode.static import stand_in_graphs
from tests.conftest import tiny_llama
from tests.test_batched_runs import lengths_cfg, run_at, tiny  # noqa: F401 - tiny: the runner's model fixture

pytestmark = pytest.mark.integration

BUDGET, BLOCK = 40, 16


@pytest.fixture(scope="module")
def model():
    return tiny_llama("sdpa")


def prompts(lengths=(90, 130, 75, 101, 88)) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (1, n), generator=generator) for n in lengths]


@pytest.mark.extended
@pytest.mark.parametrize("name, width", [("keydiff", 1), ("keydiff", 2), ("h2o", 1), ("tova", 1), ("snapkv", 1)])
def test_a_run_decoder_builds_one_arena_and_one_step_for_all_its_calls(model, monkeypatch, name, width):
    """Five samples one or two per call: a decoder-less run's results, one arena and one step (width 1: any policy)."""
    def run(decoder) -> list:
        got = []
        for start in range(0, 5, width):
            states = [prefill(model, ids, name, BUDGET, BLOCK, fixed_shapes=False)
                      for ids in prompts()[start:start + width]]
            if decoder is None:
                tokens = [generate(model, s, 8, fixed_shapes=False).token_ids for s in states]
            else:
                out = dict(decoder.generate([keydiff.Request(s, 8, key=i) for i, s in enumerate(states)]))
                tokens = [out[i].token_ids for i in range(len(states))]
            got += [(t, [p.tolist() for p in s.cache.kept_positions()]) for t, s in zip(tokens, states)]
        return got

    expected = run(None)
    monkeypatch.setitem(step.FULL_WIDTH, "cpu", True)
    decoder = Decoder(model, width)
    assert run(decoder) == expected
    assert decoder.stats.arenas == [width] and decoder.stats.built == [(width, 1)] and decoder.widths == [width]


@pytest.mark.extended
def test_a_batch_one_run_decodes_every_sample_through_the_runs_decoder(tmp_path, tiny, monkeypatch):
    """A batch-1 run hands every sample to its one decoder: one step per shape (only this count shows it)."""
    monkeypatch.setitem(step.FULL_WIDTH, "cpu", True)
    summary, rows = run_at(lengths_cfg(tmp_path, "b1"))
    assert summary["complete"] and len(rows) == 6
    steps = summary["invocations"][-1]["decode_steps"]
    # The slot's block step and the arena's decode step once each; the 47-token prompt (< N + B) decodes apart.
    assert steps["built"] == [[1, BLOCK], [1, 1], [1, 1]] and steps["arenas"] == [1, 1], steps


@pytest.mark.extended
def test_a_run_records_its_graph_captures_and_runs_a_step_that_cannot_be_captured_eagerly(tmp_path, tiny):
    """A capture refused at its end stops capturing (the same rows, eagerly); summary.json's `decode_graphs` says so."""
    from tests.test_batched_runs import same_rows

    plain, plain_rows = run_at(lengths_cfg(tmp_path, "plain"))
    assert plain["invocations"][-1]["decode_graphs"] == {"captured": 0, "failed": 0, "reasons": [], "stopped": False,
                                                         "capture_s": 0.0, "warm_up_s": 0.0, "pool_bytes": 0}
    with stand_in_graphs() as cuda:
        captured, captured_rows = run_at(lengths_cfg(tmp_path, "captured"))
    same_rows(plain_rows, captured_rows)
    graphs = captured["invocations"][-1]["decode_graphs"]
    assert graphs["captured"] >= 2 and graphs["failed"] == 0 and graphs["capture_s"] > 0, graphs
    assert graphs["pool_bytes"] == sum(capture["bytes"] for capture in cuda.captures) > 0
    assert cuda.replays > 0 and cuda.clean()
    with stand_in_graphs(fail="end") as cuda:
        summary, rows = run_at(lengths_cfg(tmp_path, "refused"))
    same_rows(plain_rows, rows)
    graphs = summary["invocations"][-1]["decode_graphs"]
    assert graphs["captured"] == 0 and graphs["failed"] == 1 and graphs["stopped"], graphs
    assert len(cuda.captures) == 1 and cuda.replays == 0 and cuda.clean(), cuda.captures
    assert [reason.split(": ", 1)[1] for reason in graphs["reasons"]] == [
        "RuntimeError: CUDA error: operation failed due to a previous error during capture (stand-in)"]


@pytest.mark.extended
def test_a_prompt_shaped_unlike_the_slot_leaves_the_slots_step_in_place(model, monkeypatch):
    """A prompt of another N prefills with a step of its own, freed with it; the slot's step serves the next ones."""
    monkeypatch.setitem(step.FULL_WIDTH, "cpu", True)
    decoder = Decoder(model, 1)
    for ids, budget in zip(prompts()[:3], (BUDGET, 24, BUDGET)):
        reference = prefill(model, ids, "keydiff", budget, BLOCK, fixed_shapes=False)
        state = prefill(model, ids, "keydiff", budget, BLOCK, decoder=decoder)
        assert torch.equal(state.logits, reference.logits)
        keys = weakref.ref(state.cache.stack.keys)
        del state
        gc.collect()
        assert keys() is None, budget
    assert [q for _, q in decoder.stats.built] == [BLOCK, BLOCK]  # the slot's (once) and the other shape's


def test_the_width_must_be_a_positive_integer(model):
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=r"the width \(batch_size\) must be a positive integer"):
            Decoder(model, bad)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        list(keydiff.generate_batch(model, [], 0))


@pytest.mark.extended
def test_forks_move_into_the_arena_and_decode_on_its_one_step(model, monkeypatch):
    """Forks of two prompts (a block each) move into the arena's slots and run its one step, with their tokens alone."""
    ids = prompts()[:2]
    alone = [generate(model, prefill(model, p, "keydiff", BUDGET, BLOCK), 6, fixed_shapes=False).token_ids for p in ids]
    monkeypatch.setitem(step.FULL_WIDTH, "cpu", True)
    forks = [fork for p in ids for fork in prefill(model, p, "keydiff", BUDGET, BLOCK).fork(2)]
    decoder = Decoder(model, 4)
    out = dict(decoder.generate([keydiff.Request(f, 6, key=i) for i, f in enumerate(forks)]))
    assert [out[i].token_ids for i in range(4)] == [alone[0], alone[0], alone[1], alone[1]]
    assert decoder.stats.built == [(4, 1)] and decoder.stats.runs[4, 1] >= 4 and decoder.stats.arenas == [4]
    assert decoder.stats.slot_copies_in == 4


@pytest.mark.extended
def test_a_follow_up_that_outgrows_its_arena_slot_decodes_in_fixed_shapes_again(model, monkeypatch):
    """A second turn larger than its slot moves to buffers of its own, frees the slot and runs the fixed step again."""
    def conversation(decoder) -> list:
        state = prefill(model, prompts()[0], "keydiff", BUDGET, BLOCK)
        first = generate(model, state, 5, fixed_shapes=None if decoder else False, decoder=decoder).token_ids
        turn = keydiff.follow_up(model, state, torch.arange(3, 33)[None])  # 30 tokens > the slot's B = 16 spare
        second = generate(model, turn, 8, fixed_shapes=None if decoder else False, decoder=decoder).token_ids
        return [first, second]

    expected = conversation(None)
    monkeypatch.setitem(step.FULL_WIDTH, "cpu", True)
    decoder = Decoder(model, 1)
    got = conversation(decoder)
    assert got == expected
    assert decoder.pool.arena.occupant[0] is None  # the slot it grew out of is free again
    assert decoder.stats.runs[1, 1] >= 4 + 6  # turn 1: 4 fixed passes; turn 2: all but its first (which evicts to N)


def test_a_decoder_refuses_options_it_does_not_run_with(model):
    decoder = Decoder(model, 1, fixed_shapes=False)
    state = prefill(model, prompts()[0], "keydiff", BUDGET, BLOCK)
    with pytest.raises(ValueError, match="fixed_shapes=True, but the decoder runs fixed_shapes=False"):
        generate(model, state, 3, fixed_shapes=True, decoder=decoder)
    with pytest.raises(ValueError, match="batch_invariant=True, but the decoder runs without it"):
        generate(model, state, 3, batch_invariant=True, decoder=decoder)
    with pytest.raises(ValueError, match="fixed_shapes=True, but the decoder runs fixed_shapes=False"):
        prefill(model, prompts()[0], "keydiff", BUDGET, BLOCK, fixed_shapes=True, decoder=decoder)

