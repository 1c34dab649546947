"""KVzip (keydiff.policies.kvzip) under block-wise prefill: every eviction against a hand-written forward, one block
against the paper's one-shot KVzip by stock transformers, kvpress's reconstruction prompt, the N + B + R + B bound,
the max statistic beside the kernel."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import keydiff.attention as attention_module
from keydiff.attention import attention_statistic, statistic_from_weights
from keydiff.engine import generate, prefill
from keydiff.policies import KVzip, build_policy
from keydiff.policies.kvzip import FIRST_PROMPT, NEXT_PROMPT
from tests.conftest import char_tokenizer, tiny_llama

pytestmark = pytest.mark.integration

N_SINK = 4


def prompt_ids(length: int, seed: int = 1) -> torch.Tensor:
    # Ids of the char tokenizer's printable characters, so that prompts and contexts share one vocabulary.
    return torch.randint(2, 98, (1, length), generator=torch.Generator().manual_seed(seed))


class ReferenceKVzip:
    """Block-wise KVzip by hand, batch 1: per layer and KV head, (position, key, value) entries and running maxima."""

    def __init__(self, model, budget: int):
        self.model, self.budget = model, budget
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.group, self.dim = self.heads // self.kv_heads, config.hidden_size // config.num_attention_heads
        layers = config.num_hidden_layers
        self.entries = [[[] for _ in range(self.kv_heads)] for _ in range(layers)]  # (position, key, value)
        self.scores = [[{} for _ in range(self.kv_heads)] for _ in range(layers)]  # position -> running max
        self.seen = 0

    def step(self, ids: torch.Tensor, keep: bool, record: bool, chunk_start: int | None = None) -> torch.Tensor:
        """Run `ids` after the held entries; keep: its entries join them (else a reconstruction pass); record: raise
        each held entry's running max (chunk_start: a softmax over the sinks and entries from there on); last logits."""
        model = self.model.model
        q_len = ids.shape[1]
        positions = torch.arange(self.seen, self.seen + q_len)
        hidden = model.embed_tokens(ids)
        cos, sin = model.rotary_emb(hidden, positions[None])
        for layer_idx, layer in enumerate(model.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(1, q_len, self.heads, self.dim).transpose(1, 2)
            k = attn.k_proj(x).view(1, q_len, self.kv_heads, self.dim).transpose(1, 2)
            v = attn.v_proj(x).view(1, q_len, self.kv_heads, self.dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            out = torch.empty(1, self.heads, q_len, self.dim)
            for head in range(self.kv_heads):
                held = self.entries[layer_idx][head]
                key_pos = torch.tensor([p for p, _, _ in held] + positions.tolist())
                keys = torch.stack([key for _, key, _ in held] + list(k[0, head]))
                values = torch.stack([value for _, _, value in held] + list(v[0, head]))
                group = q[0, head * self.group : (head + 1) * self.group]  # [g, q, d]
                logits = (group @ keys.T) * attn.scaling
                visible = key_pos[None, :] <= positions[:, None]
                weights = torch.softmax(logits.float().masked_fill(~visible, float("-inf")), dim=-1)
                out[0, head * self.group : (head + 1) * self.group] = weights @ values
                if keep:
                    held.extend((int(p), k[0, head, i], v[0, head, i]) for i, p in enumerate(positions))
                if record:  # the held entries (and the pass's own, when kept: decoding)
                    if chunk_start is not None:
                        scored = visible & ((key_pos < N_SINK) | (key_pos >= chunk_start))[None, :]
                        weights = torch.softmax(logits.float().masked_fill(~scored, float("-inf")), dim=-1)
                    received = weights.amax(dim=(0, 1))[: len(held)]
                    scores = self.scores[layer_idx][head]
                    for (position, _, _), value in zip(held, received.tolist()):
                        scores[position] = max(scores.get(position, 0.0), value)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(1, q_len, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        if keep:
            self.seen += q_len
        return self.model.lm_head(model.norm(hidden))[0, -1]

    def evict(self) -> None:
        """Keep the `budget` entries with the highest (protected, score, position) per layer and KV head."""
        for layer_entries, layer_scores in zip(self.entries, self.scores):
            for head, held in enumerate(layer_entries):
                if len(held) <= self.budget:
                    continue
                scores = layer_scores[head]
                order = sorted(held, key=lambda e: (e[0] < N_SINK, scores.get(e[0], 0.0), e[0]), reverse=True)
                layer_entries[head] = order[: self.budget]

    def kept(self) -> list[list[list[int]]]:
        return [[sorted(p for p, _, _ in held) for held in layer] for layer in self.entries]


def engine_kept(cache) -> list[list[list[int]]]:
    return [positions[0].tolist() for positions in cache.kept_positions()]


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.mark.extended
@pytest.mark.parametrize("budget, block, scoring_keys", [(40, 16, "cache"), (24, 32, "chunk")])
def test_kept_sets_equal_the_brute_force_reference_at_every_eviction(tokenizer, budget, block, scoring_keys):
    model = tiny_llama()
    ids = prompt_ids(150)
    policy = KVzip(scoring_keys=scoring_keys)
    seen: list = []
    with torch.no_grad():
        state = prefill(model, ids, policy, budget=budget, block_size=block, tokenizer=tokenizer,
                        on_block=lambda cache: seen.append(engine_kept(cache)))
        reference = ReferenceKVzip(model, budget)
        for index, start in enumerate(range(0, ids.shape[1], block)):
            chunk = ids[:, start : start + block]
            logits = reference.step(chunk, keep=True, record=False)
            reference.step(policy.reconstruction_input(chunk, ids[:, max(start - block, 0) : start], tokenizer),
                           keep=False, record=True, chunk_start=start if scoring_keys == "chunk" else None)
            reference.evict()
            assert seen[index] == reference.kept(), f"block {index} (tokens {start}..)"
        torch.testing.assert_close(state.logits[0], logits.float(), rtol=1e-4, atol=1e-4)
        # Decoding: no reconstruction; each token's attention raises the running max, then eviction to N.
        out = generate(model, state, 6)
        for token in out.token_ids[0][:-1]:
            reference.step(torch.tensor([[token]]), keep=True, record=True)
            reference.evict()
        assert engine_kept(state.cache) == reference.kept()


@pytest.mark.unit
def test_reconstruction_input_is_kvpress_prompt_then_block(tokenizer):
    policy = KVzip()
    ids = prompt_ids(40)
    first = policy.reconstruction_input(ids[:, :20], ids[:, :0], tokenizer)
    later = policy.reconstruction_input(ids[:, 20:], ids[:, :20], tokenizer)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert first[0].tolist() == encode(FIRST_PROMPT) + encode("\n") + ids[0, :20].tolist()
    assert later[0].tolist() == encode(NEXT_PROMPT) + ids[0, 12:20].tolist() + encode("\n") + ids[0, 20:].tolist()
    templated = char_tokenizer(chat_template="{% for m in messages %}<u>{{ m['content'] }}</u>{% endfor %}"
                                             "{% if add_generation_prompt %}<a>{% endif %}")
    assert policy.reconstruction_input(ids[:, :5], ids[:, :0], templated)[0].tolist()[-5 - 7 :] == \
        encode("</u><a>") + ids[0, :5].tolist()  # the chat template's assistant opening, as kvpress derives it
    assert torch.equal(policy.reconstruction_input(ids, ids[:, :0], None), ids)  # no tokenizer: the block alone


@pytest.mark.unit
def test_reconstruct_prefix_false_leaves_the_chat_templates_prefix_out_as_kvpress():
    """reconstruct_prefix=False repeats only what follows the chat template's prefix in the first block, as kvpress."""
    templated = char_tokenizer(chat_template="<sys>{% for m in messages %}<u>{{ m['content'] }}</u>{% endfor %}"
                                             "{% if add_generation_prompt %}<a>{% endif %}")
    encode = lambda text: torch.tensor([templated.encode(text, add_special_tokens=False)])  # noqa: E731
    prefix, context = encode("<sys><u>"), encode("the context, then more of it")
    ids = torch.cat([prefix, context], dim=1)
    head = encode(FIRST_PROMPT + "</u><a>")[0].tolist()
    kvpress = KVzip(reconstruct_prefix=False)
    assert kvpress.reconstruction_input(ids[:, :20], ids[:, :0], templated)[0].tolist() == head + ids[0, 8:20].tolist()
    assert KVzip().reconstruction_input(ids[:, :20], ids[:, :0], templated)[0].tolist() == head + ids[0, :20].tolist()
    assert torch.equal(kvpress.reconstruction_input(ids[:, 20:], ids[:, :20], templated),
                       KVzip().reconstruction_input(ids[:, 20:], ids[:, :20], templated))
    plain = context[:, :12]  # no template prefix at the start: nothing is left out
    assert kvpress.reconstruction_input(plain, plain[:, :0], templated)[0].tolist() == head + plain[0].tolist()
    assert build_policy("kvzip", reconstruct_prefix=False).describe()["reconstruct_prefix"] is False
    with pytest.raises(ValueError, match="reconstruct_prefix must be true or false"):
        build_policy("kvzip", reconstruct_prefix="no").check(32)


@pytest.mark.parametrize("length, budget, scoring_keys", [(120, 30, "cache"), (90, 64, "chunk")])
def test_one_block_equals_the_one_shot_kvzip_of_the_paper(tokenizer, length, budget, scoring_keys):
    """Whole prompt as one block: KVzip as the paper (and kvpress, chunk = whole context) computes it."""
    ids = prompt_ids(length, seed=3)
    sdpa, eager = tiny_llama(), tiny_llama(attn_implementation="eager")
    with torch.no_grad():
        state = prefill(sdpa, ids, build_policy("kvzip", scoring_keys=scoring_keys), budget=budget,
                        block_size="inf", tokenizer=tokenizer)
        cache = DynamicCache(config=eager.config)
        eager(input_ids=ids, cache=cache, use_cache=True)
        repeat = KVzip().reconstruction_input(ids, ids[:, :0], tokenizer)
        attentions = eager(input_ids=repeat, cache=cache, use_cache=True, output_attentions=True).attentions
    kv_heads = eager.config.num_key_value_heads
    for layer, weights in enumerate(attentions):  # [1, H, R + L, L + R + L]
        scores = weights[0, :, :, :length].amax(dim=1).view(kv_heads, -1, length).amax(dim=1)  # [kv_heads, L]
        scores[:, :N_SINK] = float("inf")
        expected = scores.topk(budget, dim=-1).indices.sort(dim=-1).values
        assert state.kept_positions[layer][0].tolist() == expected.tolist(), f"layer {layer}"


def test_bound_kept_entries_and_scratch_entries(tokenizer):
    model = tiny_llama()
    budget, block, ids = 32, 16, prompt_ids(130)
    held: list[int] = []
    with torch.no_grad():
        state = prefill(model, ids, "kvzip", budget=budget, block_size=block, tokenizer=tokenizer,
                        on_block=lambda cache: held.append(max(layer.num_entries for layer in cache.layers)))
    longest = len(tokenizer.encode(NEXT_PROMPT, add_special_tokens=False)) + 8 + 1 + block  # R + B of a later block
    assert max(held) == budget and state.max_cache_entries == budget + block
    assert state.max_scratch_entries == budget + block + longest  # N + B + R + B while the pass runs
    assert [layer.allocations for layer in state.cache.layers] == [1, 1, 1]  # room for the pass planned
    assert state.cache.entries_peak_sum == 3 * (budget + block + longest)  # what the run rows' peak bytes count
    assert state.cache.layers[0].capacity == budget + block + longest


@pytest.mark.unit
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("reduction", ["sum", "max"])
def test_statistic_beside_the_kernel_equals_the_materialised_one_in_chunks(monkeypatch, reduction, masked):
    generator = torch.Generator().manual_seed(0)
    query, key = torch.randn(2, 4, 11, 8, generator=generator), torch.randn(2, 2, 30, 8, generator=generator)
    key_mask = torch.rand(2, 2, 30, generator=generator) < 0.6 if masked else None
    if masked:
        key_mask[..., 19:] = True  # the pass's own keys (every row sees at least its own)
    logits = ((query @ key.repeat_interleave(2, dim=1).transpose(-1, -2)) * 0.3).masked_fill(
        ~attention_module.causal_mask(11, 30, query.device), float("-inf"))
    weights = torch.softmax(logits, dim=-1)
    expected = statistic_from_weights(weights, 2, None, reduction, key_mask)
    if reduction == "max":  # explicit: max over the rows and the two query heads of each KV head
        if masked:  # a softmax over the chosen keys only
            logits = logits.masked_fill(~key_mask.repeat_interleave(2, dim=1)[:, :, None, :], float("-inf"))
        torch.testing.assert_close(expected, torch.softmax(logits, dim=-1).view(2, 2, 2, 11, 30).amax(dim=(2, 3)))
    monkeypatch.setattr(attention_module, "STATISTIC_CHUNK_ELEMENTS", 2 * 4 * 30 * 3)  # chunks of 3 rows
    torch.testing.assert_close(attention_statistic(query, key, 0.3, None, reduction, key_mask), expected)
