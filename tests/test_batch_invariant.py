"""batch_invariant's kernels (keydiff.kernels), the mode that registers them and the key's path to the step, in
Triton's interpreter on CPU tensors: what they compute (against torch) and that row i does not depend on the call's
other rows. A GPU's: `make gpu-check`."""

from __future__ import annotations

import os

# Before triton is imported (conftest.py sets it first too): @triton.jit then builds interpreted kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton", reason="batch_invariant's kernels need triton: pip install -e '.[triton]'")

import keydiff  # noqa: E402
from keydiff.kernels import batch_invariant  # noqa: E402
from keydiff.testing import tiny_model  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.extended]


@pytest.fixture(scope="module")
def kernels():
    from triton.runtime.interpreter import InterpretedFunction

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET is not 1 in this process: the kernels cannot run on CPU tensors")
    module = batch_invariant.kernels()
    if not isinstance(module._matmul_kernel, InterpretedFunction):
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set: its kernels are compiled ones, which "
                    "cannot run on CPU tensors (tests/conftest.py sets it first)")
    return module


def rows_alone_equal(call, inputs: torch.Tensor, whole: torch.Tensor, rows=(0, 5, 15)) -> None:
    """Row i of `whole` is bit for bit the call on row i alone, and on all rows with junk in the others."""
    for i in rows:
        assert torch.equal(call(inputs[i:i + 1])[0], whole[i])
        junk = torch.randn_like(inputs) * 1e3
        junk[i] = inputs[i]
        assert torch.equal(call(junk)[i], whole[i])


def test_matmul_matches_torch_and_a_row_does_not_depend_on_the_others(kernels):
    torch.manual_seed(0)
    a, w = torch.randn(16, 80), torch.randn(48, 80)  # K = 80: a partial last K chunk; N = 48: a partial tile
    weight = w.T  # a linear layer's transposed view: strides, not a copy
    out = kernels.matmul(a, weight)
    assert torch.allclose(out, a @ weight, atol=1e-4, rtol=1e-4)
    rows_alone_equal(lambda x: kernels.matmul(x, weight), a, out)
    bias = torch.randn(48)
    with_bias = kernels.matmul(a, weight, bias, alpha=0.5, beta=2.0)
    assert torch.allclose(with_bias, torch.addmm(bias, a, weight, beta=2.0, alpha=0.5), atol=1e-4, rtol=1e-4)
    rows_alone_equal(lambda x: kernels.matmul(x, weight, bias, alpha=0.5, beta=2.0), a, with_bias)
    batched_a, batched_b = torch.randn(16, 3, 40), torch.randn(16, 40, 24)
    batched = kernels.matmul(batched_a, batched_b)
    assert torch.allclose(batched, torch.bmm(batched_a, batched_b), atol=1e-4, rtol=1e-4)
    for i in (0, 7):
        assert torch.equal(kernels.matmul(batched_a[i:i + 1], batched_b[i:i + 1])[0], batched[i])
    low = kernels.matmul(a.bfloat16(), weight.bfloat16())
    assert low.dtype == torch.bfloat16
    assert torch.allclose(low.float(), a @ weight, atol=0.5, rtol=2e-2)
    rows_alone_equal(lambda x: kernels.matmul(x, weight.bfloat16()), a.bfloat16(), low)


def test_row_sums_match_torch_and_a_row_does_not_depend_on_the_others(kernels):
    torch.manual_seed(1)
    x = torch.randn(16, 1100)  # three chunks of ROW_BLOCK, the last partial
    sums = kernels.row_sums(x)
    assert torch.allclose(sums, x.sum(-1), atol=1e-3, rtol=1e-5)
    assert torch.allclose(kernels.row_sums(x, square=True), (x * x).sum(-1), rtol=1e-5)
    assert torch.allclose(kernels.row_sums(x, absolute=True), x.abs().sum(-1), rtol=1e-5)
    rows_alone_equal(lambda rows: kernels.row_sums(rows)[:, None], x, sums[:, None])
    assert kernels.row_sums(x.double()).dtype == torch.float64


def test_attention_matches_sdpa_and_a_row_does_not_depend_on_the_others(kernels):
    torch.manual_seed(2)
    batch, heads, kv_heads, dim, keys = 16, 4, 2, 16, 150  # GQA; three key chunks, the last partial
    query = torch.randn(batch, 1, heads, dim).transpose(1, 2)  # transformers' layout: a transposed view
    key, value = torch.randn(batch, kv_heads, keys, dim), torch.randn(batch, kv_heads, keys, dim)
    out = kernels.attention(query, key, value, dim ** -0.5)
    expected = F.scaled_dot_product_attention(query, key, value, enable_gqa=True).transpose(1, 2)
    assert out.shape == (batch, 1, heads, dim) and torch.allclose(out, expected, atol=1e-5, rtol=1e-4)
    for i in (0, 9):
        assert torch.equal(kernels.attention(query[i:i + 1], key[i:i + 1], value[i:i + 1], dim ** -0.5)[0], out[i])
        junk_k, junk_v, junk_q = torch.randn_like(key) * 50, torch.randn_like(value) * 50, torch.randn_like(query) * 50
        junk_k[i], junk_v[i], junk_q[i] = key[i], value[i], query[i]
        assert torch.equal(kernels.attention(junk_q, junk_k, junk_v, dim ** -0.5)[i], out[i])
    # several queries (a block against kept entries): the bottom-right causal mask
    block = torch.randn(2, heads, 5, dim)
    out = kernels.attention(block, key[:2], value[:2], 0.3)
    mask = torch.ones(5, keys, dtype=torch.bool).tril(keys - 5)
    expected = F.scaled_dot_product_attention(block, key[:2], value[:2], attn_mask=mask, scale=0.3, enable_gqa=True)
    assert torch.allclose(out, expected.transpose(1, 2), atol=1e-5, rtol=1e-4)


def test_the_mode_replaces_the_operators_and_only_while_it_is_on(kernels):
    torch.manual_seed(3)
    x = torch.randn(16, 6, 40)

    def ops() -> dict[str, torch.Tensor]:
        return {"mean": x.mean(-1, keepdim=True), "sum": x.sum(dim=(0, 2)), "norm": x.norm(dim=-1),
                "normalize": F.normalize(x, dim=-1), "l1": torch.linalg.vector_norm(x, 1, dim=1),
                "count": (x > 0).sum(-1), "linear": F.linear(x, x[0, :5], x[1, 0, :5]),
                "matmul": x @ x.transpose(1, 2), "mm": x[0] @ x[1].T}

    plain, before = ops(), batch_invariant.calls.copy()
    with batch_invariant.mode("CPU"):
        assert batch_invariant.enabled(torch.device("cpu")) and not batch_invariant.enabled(torch.device("cuda"))
        ours, row = ops(), x[3:4].mean(-1, keepdim=True)
    used = batch_invariant.calls - before
    for name in ("mm", "addmm", "bmm", "mean", "sum", "linalg_vector_norm"):
        assert used[name] > 0, (name, used)
    for name, value in plain.items():
        assert ours[name].shape == value.shape and ours[name].dtype == value.dtype, name
        assert torch.allclose(ours[name].float(), value.float(), atol=1e-4, rtol=1e-4), name
    assert torch.equal(row[0], ours["mean"][3])
    assert not batch_invariant.enabled(torch.device("cpu"))
    after = batch_invariant.calls.copy()
    torch.mm(x[0], x[1].T), x.mean(-1)  # unregistered on exit: torch's own kernels again
    assert batch_invariant.calls == after


@pytest.mark.parametrize("policy, budget", [("keydiff", 24), ("full", None)])
def test_generate_batch_under_the_mode_gives_each_sequence_its_tokens_alone(kernels, monkeypatch, policy, budget):
    """The mode registered for the CPU key: three prompts together give each its tokens alone, through the kernels."""
    monkeypatch.setitem(batch_invariant.DEVICE_KEYS, "cpu", "CPU")
    model = tiny_model()
    prompts = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (30, 41, 52)]

    def state(prompt):
        return keydiff.prefill(model, prompt, policy, budget, 8)

    alone = [keydiff.generate(model, state(p), 4, batch_invariant=True).token_ids for p in prompts]
    before = batch_invariant.calls.copy()
    requests = [keydiff.Request(state(p), max_new_tokens=4, key=i) for i, p in enumerate(prompts)]
    together = dict(keydiff.generate_batch(model, requests, 3, batch_invariant=True))
    used = batch_invariant.calls - before
    assert used["attention"] > 0 and used["mm"] > 0 and used["mean"] > 0, used
    assert [together[i].token_ids for i in range(3)] == alone
    plain = [keydiff.generate(model, state(p), 4).token_ids for p in prompts]
    assert plain == alone  # float32 on a random model: the invariant kernels round close enough to pick the same


def test_on_a_cpu_the_mode_is_a_no_op_and_other_devices_are_refused():
    with batch_invariant.for_device(torch.device("cpu")):
        assert not batch_invariant.enabled(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"does not run on mps \(valid devices: cuda, cpu"):
        batch_invariant.check_device(torch.device("mps"))
