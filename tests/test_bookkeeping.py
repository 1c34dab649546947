"""What must stay right when the tokens do: what a batch records of each sequence, what a state reports of its held
suffix, what memory a copy or a decode holds, and which slot of the join pool a sequence lives in.

The token tests (tests/test_batching.py) compare every sequence with decoding it alone; each bug these tests
guard against leaves the tokens as they are (issue #29, part 4): a stopped row counted in a step's batch size,
a follow-up turn reporting the earlier suffix too, a copy of a fork pinning a copy of the fork's whole block, a
held suffix planned one entry short (the first decoding step reallocates), a freed join-pool slot never reused,
and a slot still in use (a decoding sequence's, a follow-up turn's) handed to a second sequence (the first is
copied out while it decodes). They read public fields only (results, `kv_cache_bytes`, `allocations`, a layer's
buffers, `decoder.stats`), so they hold across a refactor of the batching code.
"""

from __future__ import annotations

import pytest
import torch

import keydiff
from keydiff import build_policy, copy_state, follow_up, generate, prefill
from keydiff.run.batched import batch_record

pytestmark = pytest.mark.integration

BUDGET, BLOCK = 40, 16  # N + B = 56: prompts of 56 tokens or more share the join pool's slot shape


def prompts(lengths) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (1, n), generator=generator) for n in lengths]


def where(cache) -> int:
    """The address of a cache's key buffer: where its entries live now."""
    return cache.layers[0].keys.data_ptr()


def allocation(cache) -> int:
    """The address of the allocation a cache's key buffer is part of (one block holds several sequences)."""
    return cache.layers[0].keys.untyped_storage().data_ptr()


# --------------------------------------------------------------------------------- batch sizes


@pytest.mark.extended
def test_batch_sizes_count_only_the_rows_of_each_pass(model):
    """`batch_sizes` lists the rows of each decoding pass a sequence took part in: a row that takes its last token
    in a step stops there and is not in that step's pass. Three forks of 2, 4 and 6 tokens at batch 3 (a sequence
    of m tokens runs m - 1 passes), then a refill at batch 2 (a third sequence joins when the first stops); the
    recorded `decode_batch_size` is the mean of these."""
    state = prefill(model, prompts((90,))[0], "keydiff", BUDGET, BLOCK)
    requests = [keydiff.Request(fork, max_new_tokens=m, key=m) for fork, m in zip(state.fork(3), (2, 4, 6))]
    got = dict(keydiff.generate_batch(model, requests, 3))
    assert {m: got[m].batch_sizes for m in got} == {2: [3], 4: [3, 2, 2], 6: [3, 2, 2, 1, 1]}
    assert batch_record(got[6], 1)["decode_batch_size"] == 9 / 5

    states = [prefill(model, ids, "keydiff", BUDGET, BLOCK) for ids in prompts((90, 130, 75))]
    requests = [keydiff.Request(s, max_new_tokens=m, key=k) for k, (s, m) in enumerate(zip(states, (3, 5, 3)))]
    got = dict(keydiff.generate_batch(model, requests, 2))
    # 0 and 1 run two passes together; 0 stops at its third token, 1 runs alone, 2 joins; 1 stops at its fifth
    assert [got[k].batch_sizes for k in range(3)] == [[2, 2], [2, 2, 1, 2], [2, 1]]
    assert [len(got[k].token_ids[0]) for k in range(3)] == [3, 5, 3]


# --------------------------------------------------------------------------------- held suffix


@pytest.mark.extended
def test_a_follow_up_turn_reports_its_own_suffix_only(model, prompt):
    """A state prefilled with a held suffix of 20, decoded, then fed a 10-token follow-up: the new turn holds 10
    (what it fed), not the earlier 20 as well; `feed` on an undecoded state adds to what it holds."""
    state = prefill(model, prompt[:, :150], "keydiff", BUDGET, BLOCK, held_suffix=20)
    assert state.held_suffix == 20
    generate(model, state, 4)
    turn = follow_up(model, state, prompt[:, 150:160])
    assert turn.held_suffix == 10 and not turn.decoded
    again = keydiff.feed(model, prefill(model, prompt[:, :150], "keydiff", BUDGET, BLOCK, held_suffix=20),
                         prompt[:, 150:160])
    assert again.held_suffix == 30


@pytest.mark.extended
def test_a_held_suffix_longer_than_the_block_decodes_in_the_buffers_of_its_prefill(model, prompt):
    """The cache is planned for N + S + 1 entries (the suffix and the first generated token, written before the
    first decoding step's eviction): decoding allocates nothing and moves nothing, at batch 1 and in a batch."""
    for name in ("keydiff", "snapkv"):
        for batched in (False, True):
            state = prefill(model, prompt, build_policy(name), BUDGET, BLOCK, held_suffix=37)  # S = 37 > B = 16
            cache = state.cache
            before = (cache.kv_cache_bytes, cache.allocations, [layer.keys.data_ptr() for layer in cache.layers])
            if batched:
                out = dict(keydiff.generate_batch(model, [keydiff.Request(state, max_new_tokens=6, key=0)], 2))[0]
            else:
                out = generate(model, state, 6)
            assert out.max_cache_entries == BUDGET + 37 + 1, (name, batched)  # the first step did hold N + S + 1
            after = (cache.kv_cache_bytes, cache.allocations, [layer.keys.data_ptr() for layer in cache.layers])
            assert after == before, (name, batched)


# --------------------------------------------------------------------------------- copies of forks


def storage_sizes(cache) -> list[int]:
    """Bytes of every allocation a cache's buffers (keys, values, positions, policy state) are views of."""
    sizes = {}
    for layer in cache.layers:
        for buffer in (layer.keys, layer.values, layer.positions, *layer.state.values()):
            storage = buffer.untyped_storage()
            sizes[storage.data_ptr()] = storage.nbytes()
    return sorted(sizes.values())


def entries(cache) -> tuple[list, list]:
    """What a cache holds: every layer's kept positions and kept keys."""
    return ([positions.tolist() for positions in cache.kept_positions()],
            [layer.keys[:, :, : layer.num_entries].tolist() for layer in cache.layers])


@pytest.mark.parametrize("fixed_shapes", [True, False], ids=["fixed", "ordinary"])
def test_a_copy_of_a_fork_holds_its_own_entries_not_its_block(model, fixed_shapes):
    """Forks lie side by side in one block; a copy of one (copy_state: a fork of a fork) gets buffers of its own of
    one sequence's size, exactly what a copy of the unforked state holds, and none of them is part of the block
    (the block is not kept alive by the copy, nor a copy of the whole block made for it). The copy then decodes in
    those buffers of its own, in the fixed-shape step (which runs on the block a placed stack lives in) and the
    ordinary one: it never writes into the fork's slot nor into any block, and ends holding what the fork holds
    after the same decode."""
    state = prefill(model, prompts((90,))[0], "keydiff", BUDGET, BLOCK)
    plain = copy_state(state, model)
    forks = state.fork(4)
    assert len({allocation(fork.cache) for fork in forks}) == 1  # the forks share one block
    block = forks[0].cache.layers[0].keys.untyped_storage()
    copy = copy_state(forks[1], model)
    assert storage_sizes(copy.cache) == storage_sizes(plain.cache) == storage_sizes(state.cache)
    assert copy.cache.kv_cache_bytes == plain.cache.kv_cache_bytes == state.cache.kv_cache_bytes
    assert block.nbytes() >= 4 * copy.cache.layers[0].keys.untyped_storage().nbytes()
    start, stop = block.data_ptr(), block.data_ptr() + block.nbytes()
    assert not any(start <= layer.keys.data_ptr() < stop for layer in copy.cache.layers)
    # the copy decodes like the fork it was copied from, in its own buffers, and leaves the fork as it was
    fork, before = forks[1].cache, entries(forks[1].cache)
    out = generate(model, copy, 6, fixed_shapes=fixed_shapes)
    assert entries(fork) == before
    assert out.token_ids == generate(model, forks[1], 6, fixed_shapes=fixed_shapes).token_ids
    assert entries(fork) != before  # the decode moved the fork's entries on (what the copy's must match)
    assert entries(copy.cache) == entries(fork)


# --------------------------------------------------------------------------------- join pool slots


@pytest.mark.extended
def test_a_freed_join_pool_slot_is_reused_so_later_prompts_group(model):
    """Batch 2, four prompts of N + B tokens or more decoding the same number of tokens: the first two share the
    pool's block; when they stop, the next two take their slots (one block again), so they too decode as one
    group; each sequence still gives its tokens alone."""
    lengths = (90, 130, 75, 61)
    expected = [generate(model, prefill(model, ids, "keydiff", BUDGET, BLOCK), 5).token_ids[0]
                for ids in prompts(lengths)]
    states = [prefill(model, ids, "keydiff", BUDGET, BLOCK) for ids in prompts(lengths)]
    seen = {}

    def requests():
        for key, state in enumerate(states):
            yield keydiff.Request(state, max_new_tokens=5, key=key)

    for key, out in keydiff.generate_batch(model, requests(), 2):
        seen[key] = allocation(states[key].cache)  # before the next prompt may take its slot
        assert out.token_ids[0] == expected[key], key
    assert seen[0] == seen[1] and seen[2] == seen[3]  # each pair in one allocation: they grouped


@pytest.mark.extended
def test_a_decoding_sequence_keeps_its_slot_until_it_stops(model):
    """A sequence in the join pool owns its slot while it decodes: no later sequence is handed it (the first would
    be copied out mid-decode). Batch 2, sequences stopping at different steps so that slots free one at a time
    and are reused while their neighbours still decode: every sequence's buffers stay where they were from the
    first time they are seen until it stops, and each gives its tokens alone."""
    lengths, new = (90, 130, 75, 61, 100), (3, 12, 20, 4, 6)
    expected = [generate(model, prefill(model, ids, "keydiff", BUDGET, BLOCK), m).token_ids[0]
                for ids, m in zip(prompts(lengths), new)]
    states, pulled, finished, places = {}, [], set(), {}

    def requests():
        for key, (ids, m) in enumerate(zip(prompts(lengths), new)):
            states[key] = prefill(model, ids, "keydiff", BUDGET, BLOCK)
            pulled.append(key)
            yield keydiff.Request(states[key], max_new_tokens=m, key=key)

    for key, out in keydiff.generate_batch(model, requests(), 2):
        assert out.token_ids[0] == expected[key], key
        for other in pulled:  # every sequence still decoding, and the one that just stopped
            if other not in finished:
                places.setdefault(other, []).append(where(states[other].cache))
        finished.add(key)
    assert sorted(finished) == list(range(len(lengths)))
    assert all(len(set(seen)) == 1 for seen in places.values()), places
    assert len({allocation(states[k].cache) for k in (2, 4)}) == 1  # slots were reused: the late ones share a block


@pytest.mark.extended
def test_a_follow_up_turn_keeps_its_slot_while_a_new_sequence_joins(model):
    """A follow-up turn that decodes again in its join-pool slot owns it like any decoding sequence. One run
    decoder at batch 2: a and b decode together (a in one slot, b in the other); then a's follow-up turn decodes
    while a new prompt c joins with every slot occupied (the turn's, and stopped b's). c must take b's slot: b is
    copied out, c copied in, and the turn's entries stay where they were until it stops, in one block with c (they
    group). Handed the turn's slot instead, c would copy the running turn out mid-decode."""
    a_ids, b_ids, c_ids = prompts((90, 130, 75))
    decoder = keydiff.Decoder(model, 2)
    a, b = (prefill(model, ids, "keydiff", BUDGET, BLOCK) for ids in (a_ids, b_ids))
    dict(decoder.generate([keydiff.Request(a, max_new_tokens=4, key="a"), keydiff.Request(b, max_new_tokens=4,
                                                                                          key="b")]))
    turn = follow_up(model, a, torch.randint(0, 256, (1, 3), generator=torch.Generator().manual_seed(8)))
    c = prefill(model, c_ids, "keydiff", BUDGET, BLOCK)
    before, copies = where(turn.cache), (decoder.stats.slot_copies_in, decoder.stats.slot_copies_out)
    seen = []
    for key, _ in decoder.generate([keydiff.Request(turn, max_new_tokens=6, key="turn"),
                                    keydiff.Request(c, max_new_tokens=4, key="c")]):
        seen.append((key, where(turn.cache) == before, allocation(c.cache) == allocation(turn.cache)))
    assert seen == [("c", True, True), ("turn", True, True)]
    assert (decoder.stats.slot_copies_in - copies[0], decoder.stats.slot_copies_out - copies[1]) == (1, 1)
