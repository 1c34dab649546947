"""What must stay right when the tokens do (bugs that keep every token): each pass's batch size, a held suffix,
the memory a copy or a decode holds, and the join-pool slot a sequence lives in. Public fields only."""

from __future__ import annotations

import pytest
import torch

import keydiff
from keydiff import build_policy, copy_state, follow_up, generate, prefill
from keydiff.run.batched import batch_record
from tests.test_batching import prompts

pytestmark = pytest.mark.integration

BUDGET, BLOCK = 40, 16  # prompts of N + B = 56 tokens or more share the join pool's slot shape


def where(cache) -> int:
    return cache.layers[0].keys.data_ptr()


def allocation(cache) -> int:
    return cache.layers[0].keys.untyped_storage().data_ptr()


@pytest.mark.extended
def test_batch_sizes_count_only_the_rows_of_each_pass(model):
    """A row that takes its last token in a step is not in that step's pass (m tokens: m - 1 passes), refills too."""
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


@pytest.mark.extended
def test_a_follow_up_turn_reports_its_own_suffix_only(model, prompt):
    """A follow-up turn holds what it fed, not the earlier suffix too; `feed` on an undecoded state adds to it."""
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
    """Planned for N + S + 1 entries (the first token lands before an eviction): decoding allocates nothing."""
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


def storage_sizes(cache) -> list[int]:
    sizes = {}
    for layer in cache.layers:
        for buffer in (layer.keys, layer.values, layer.positions, *layer.state.values()):
            storage = buffer.untyped_storage()
            sizes[storage.data_ptr()] = storage.nbytes()
    return sorted(sizes.values())


def entries(cache) -> tuple[list, list]:
    return ([positions.tolist() for positions in cache.kept_positions()],
            [layer.keys[:, :, : layer.num_entries].tolist() for layer in cache.layers])


@pytest.mark.parametrize("fixed_shapes", [True, False], ids=["fixed", "ordinary"])
def test_a_copy_of_a_fork_holds_its_own_entries_not_its_block(model, fixed_shapes):
    """A copy of a fork gets one sequence's buffers outside the block and decodes there (either step) as the fork."""
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
    fork, before = forks[1].cache, entries(forks[1].cache)
    out = generate(model, copy, 6, fixed_shapes=fixed_shapes)
    assert entries(fork) == before
    assert out.token_ids == generate(model, forks[1], 6, fixed_shapes=fixed_shapes).token_ids
    assert entries(fork) != before  # the decode moved the fork's entries on (what the copy's must match)
    assert entries(copy.cache) == entries(fork)


@pytest.mark.extended
def test_a_freed_join_pool_slot_is_reused_so_later_prompts_group(model):
    """Batch 2, four prompts of N + B or more: the second pair takes the first pair's slots, so it groups too."""
    lengths = (90, 130, 75, 61)
    expected = [generate(model, prefill(model, ids, "keydiff", BUDGET, BLOCK), 5).token_ids[0]
                for ids in prompts(lengths)]
    states = [prefill(model, ids, "keydiff", BUDGET, BLOCK) for ids in prompts(lengths)]
    requests, seen = [keydiff.Request(state, max_new_tokens=5, key=key) for key, state in enumerate(states)], {}
    for key, out in keydiff.generate_batch(model, requests, 2):
        seen[key] = allocation(states[key].cache)  # before the next prompt may take its slot
        assert out.token_ids[0] == expected[key], key
    assert seen[0] == seen[1] and seen[2] == seen[3]  # each pair in one allocation: they grouped


@pytest.mark.extended
def test_a_decoding_sequence_keeps_its_slot_until_it_stops(model):
    """Slots freed one at a time are reused beside sequences still decoding, whose buffers never move."""
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
    """a's follow-up turn decodes in its slot while c joins: c takes stopped b's slot (b out, c in), not the turn's."""
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
