"""Additive attention: the naive formula's values and gradients, at a fraction of its memory.

The oracle is the formula written out in plain PyTorch (``naive`` below), which materialises the
``[B, Tq, Tk, H]`` tanh tensor; memfit's kernel must agree with it in fp32 (output relative error
<= 1e-5, every gradient <= 1e-4), pass ``gradcheck`` in fp64, measure (exactly, ``memfit.measure``)
far below one such tensor while the oracle measures above it, and appear in AOTAutograd's graphs
as one forward and one backward node.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import memfit
from fake_kernels import assert_fake_matches_keyword_call
from memfit._compat import aot_autograd, make_boxed_func
from memfit.nn import AdditiveAttention, additive_attention
from memfit.nn.additive import chunk_sizes

Tensors = list[torch.Tensor]


def naive(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    w_query: torch.Tensor | None,
    w_keys: torch.Tensor | None,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The textbook formula: ``softmax_j(v · tanh(W_q q_i + W_k k_j)) @ values``."""
    single = query.dim() == 2
    if single:
        query = query[:, None]
    pq = query if w_query is None else query @ w_query.t()
    pk = keys if w_keys is None else keys @ w_keys.t()
    scores = (torch.tanh(pq[:, :, None, :] + pk[:, None, :, :]) @ v[:, None])[..., 0]
    if mask is not None:
        scores = scores.masked_fill(~(mask[:, None] if mask.dim() == 2 else mask), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ values
    return out[:, 0] if single else out


def make_inputs(
    batch: int,
    queries: int | None,
    n_keys: int,
    hidden: int = 8,
    dims: tuple[int, int, int] = (6, 7, 5),
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Tensors:
    """query (2-D when ``queries`` is None), keys, values, w_query, w_keys, v; all need grad."""
    g = torch.Generator().manual_seed(seed)
    d_query, d_keys, d_values = dims
    q_shape = (batch, d_query) if queries is None else (batch, queries, d_query)
    shapes = [
        q_shape,
        (batch, n_keys, d_keys),
        (batch, n_keys, d_values),
        (hidden, d_query),
        (hidden, d_keys),
        (hidden,),
    ]
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach(), want.detach()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def make_mask(kind: str | None, batch: int, queries: int, n_keys: int) -> torch.Tensor | None:
    g = torch.Generator().manual_seed(1)
    if kind is None:
        return None
    if kind == "padding":  # [B, 1, Tk], each sequence a different length
        lengths = torch.randint(1, n_keys + 1, (batch,), generator=g)
        return (torch.arange(n_keys) < lengths[:, None])[:, None, :]
    if kind == "2d":  # [B, Tk]
        return torch.rand(batch, n_keys, generator=g) < 0.7
    mask = torch.rand(batch, queries, n_keys, generator=g) < 0.6
    mask[..., 0] = True  # no fully masked row here; that case has its own test
    return mask


@pytest.mark.parametrize("mask_kind", [None, "padding", "2d", "full"])
@pytest.mark.parametrize("queries", [None, 1, 6])
@pytest.mark.parametrize("block_elements", [50, None])
def test_values_and_gradients_match_the_naive_formula(
    mask_kind: str | None, queries: int | None, block_elements: int | None
) -> None:
    batch, n_keys, hidden = 3, 37, 8
    # block 50 -> 2 keys a block (37 is not a multiple); default -> every key in one block.
    inputs = make_inputs(batch, queries, n_keys, hidden)
    mask = make_mask(mask_kind, batch, queries or 1, n_keys)
    kwargs = {} if block_elements is None else {"block_elements": block_elements}
    got = additive_attention(*inputs, mask, **kwargs)
    want = naive(*inputs, mask)
    assert got.shape == want.shape and rel_err(got, want) <= 1e-5
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(2))
    got_grads = torch.autograd.grad(got, inputs, grad)
    want_grads = torch.autograd.grad(want, inputs, grad)
    for name, a, b in zip(["query", "keys", "values", "w_q", "w_k", "v"], got_grads, want_grads):
        assert rel_err(a, b) <= 1e-4, name


@pytest.mark.parametrize("projected", ["keys", "query", "both"])
def test_projected_inputs_with_none_weights(projected: str) -> None:
    query, keys, values, w_query, w_keys, v = make_inputs(2, 4, 11, hidden=6, dims=(6, 6, 3))
    wq = None if projected in ("query", "both") else w_query
    wk = None if projected in ("keys", "both") else w_keys
    args = (query, keys, values, wq, wk, v)
    got = additive_attention(*args, block_elements=20)
    want = naive(*args)
    assert rel_err(got, want) <= 1e-5
    leaves = [t for t in (query, keys, values, wq, wk, v) if t is not None]
    for a, b in zip(
        torch.autograd.grad(got.sum(), leaves), torch.autograd.grad(want.sum(), leaves)
    ):
        assert rel_err(a, b) <= 1e-4


def test_gradcheck_fp64() -> None:
    inputs = make_inputs(2, 3, 5, hidden=4, dims=(3, 2, 2), dtype=torch.float64)
    mask = torch.tensor([[True, True, False, True, True], [True, False, True, True, False]])

    def fn(*xs: torch.Tensor) -> torch.Tensor:
        return additive_attention(*xs, mask[:, None], block_elements=8)

    assert torch.autograd.gradcheck(fn, tuple(inputs))


def test_a_fully_masked_row_is_nan_like_the_naive_formula() -> None:
    """The chosen behaviour is softmax's: NaN output; the gradients match the naive ones too
    (NaN for the values that row read, finite elsewhere, since masked scores get no gradient)."""
    inputs = make_inputs(2, 3, 9)
    mask = torch.ones(2, 3, 9, dtype=torch.bool)
    mask[1, 2] = False
    got, want = additive_attention(*inputs, mask, block_elements=40), naive(*inputs, mask)
    assert torch.equal(got.isnan(), want.isnan()) and got[1, 2].isnan().all()
    ok = ~want.isnan()
    assert rel_err(got[ok], want[ok]) <= 1e-5
    for a, b in zip(
        torch.autograd.grad(got.sum(), inputs), torch.autograd.grad(want.sum(), inputs)
    ):
        assert torch.equal(a.isnan(), b.isnan())
        assert rel_err(a[~b.isnan()], b[~b.isnan()]) <= 1e-4


def test_chunk_rule_bounds_the_block() -> None:
    """Brute force: every block fits ``max(block, B·H)``; no more keys would fit one query row."""
    for batch, queries, n_keys, hidden, block in [
        (1, 1, 1, 1, 1),
        (2, 5, 37, 8, 50),
        (4, 128, 256, 64, 1 << 18),
        (60, 1, 400, 256, 1 << 18),
        (64, 7, 3, 8192, 1 << 18),
    ]:
        tq, tk = chunk_sizes(batch, queries, n_keys, hidden, block)
        assert 1 <= tq <= queries and 1 <= tk <= n_keys
        assert batch * tq * tk * hidden <= max(block, batch * hidden)
        assert tk == n_keys or batch * (tk + 1) * hidden > block
        assert tq == queries or batch * (tq + 1) * tk * hidden > max(block, batch * hidden)


def test_memory_stays_far_below_one_naive_intermediate() -> None:
    batch, queries, n_keys, hidden = 4, 128, 256, 64
    one_intermediate = batch * queries * n_keys * hidden * 4  # fp32 [B, Tq, Tk, H]: 32 MiB
    inputs = make_inputs(batch, queries, n_keys, hidden, dims=(32, 32, 32))

    def step(fn: Callable[..., torch.Tensor]) -> int:
        for t in inputs:
            t.grad = None
        peak = memfit.measure(lambda: fn(*inputs).sum().backward()).peak_bytes
        assert peak is not None
        return peak

    assert step(naive) > one_intermediate
    assert step(additive_attention) < one_intermediate / 4


def test_joint_graph_holds_one_forward_and_one_backward_node() -> None:
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example: object) -> Callable[..., object]:
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    layer = AdditiveAttention(6, 7, 8)
    query, keys = torch.randn(2, 3, 6, requires_grad=True), torch.randn(2, 10, 7)
    mask = torch.arange(10) < torch.tensor([[7], [10]])
    fn = torch.compile(
        lambda q: layer(q, keys, mask=mask),
        fullgraph=True,
        backend=aot_autograd(fw_compiler=keep, bw_compiler=keep),
    )
    out = fn(query)
    out.sum().backward()
    assert (
        rel_err(out, naive(query, keys, keys, layer.w_query, layer.w_keys, layer.v, mask)) <= 1e-5
    )

    def targets(gm: torch.fx.GraphModule) -> list[str]:
        return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]

    forward, backward = (targets(gm) for gm in graphs)
    assert forward.count("memfit.additive_attention.default") == 1
    assert backward.count("memfit.additive_attention_backward.default") == 1
    assert not any("tanh" in t for t in forward + backward)


def test_flop_counts_are_the_naive_ones_plus_the_recomputation() -> None:
    batch, queries, n_keys = 2, 3, 10
    inputs = make_inputs(batch, queries, n_keys, hidden=8, dims=(4, 5, 6))
    counted = {}
    for name, fn in (("naive", naive), ("memfit", additive_attention)):
        with FlopCounterMode(display=False) as forward:
            out = fn(*inputs)
        with FlopCounterMode(display=False) as backward:
            out.sum().backward()
        counted[name] = (forward.get_total_flops(), backward.get_total_flops())
    (nf, nb), (mf, mb) = counted["naive"], counted["memfit"]
    output_matmul = 2 * batch * queries * n_keys * 6  # probs @ values, not recomputed
    assert mf == nf > 0 and mb == nb + nf - output_matmul


def test_module_initialisation_and_precomputed_keys() -> None:
    torch.manual_seed(0)
    layer = AdditiveAttention(16, 32, 64)
    assert layer.w_query.shape == (64, 16) and layer.w_keys.shape == (64, 32)
    assert layer.v.shape == (64,)
    for p, fan_in in ((layer.w_query, 16), (layer.w_keys, 32), (layer.v, 64)):
        assert p.abs().max() <= fan_in**-0.5 and p.std() > 0.4 * fan_in**-0.5
    query, keys = torch.randn(3, 16), torch.randn(3, 9, 32)
    values = torch.randn(3, 9, 4)
    want = naive(query, keys, values, layer.w_query, layer.w_keys, layer.v)
    assert rel_err(layer(query, keys, values), want) <= 1e-5
    got = layer(query, keys, values, projected_keys=layer.project_keys(keys))
    assert rel_err(got, want) <= 1e-5


def test_bad_inputs_name_the_shapes() -> None:
    query, keys, values, w_query, w_keys, v = make_inputs(2, 3, 5, hidden=4, dims=(3, 2, 2))
    with pytest.raises(ValueError, match=r"keys \[2, 5, 2\].*values \[2, 4, 2\]"):
        additive_attention(query, keys, values[:, :4], w_query, w_keys, v)
    with pytest.raises(ValueError, match=r"same batch size.*query \[2, 3, 3\], keys \[1, 5, 2\]"):
        additive_attention(query, keys[:1], values, w_query, w_keys, v)
    with pytest.raises(ValueError, match=r"w_query must be \[H, Dq\].*w_query \[4, 2\]"):
        additive_attention(query, keys, values, w_query[:, :2], w_keys, v)
    with pytest.raises(ValueError, match=r"w_keys must be \[H, Dk\].*v \[3\]"):
        additive_attention(query, keys, values, w_query[:3], w_keys, v[:3])
    with pytest.raises(ValueError, match=r"already projected.*keys \[2, 5, 2\]"):
        additive_attention(query, keys, values, w_query, None, v)
    with pytest.raises(ValueError, match=r"query \[2, 3, 3, 1\]"):
        additive_attention(query[..., None], keys, values, w_query, w_keys, v)
    with pytest.raises(ValueError, match="float64"):
        additive_attention(query.double(), keys, values, w_query, w_keys, v)
    with pytest.raises(ValueError, match="bool"):
        additive_attention(query, keys, values, w_query, w_keys, v, torch.ones(2, 1, 5))
    with pytest.raises(
        ValueError, match=r"broadcast to \[B, Tq, Tk\] = \[2, 3, 5\].*mask \[2, 3, 4\]"
    ):
        additive_attention(query, keys, values, w_query, w_keys, v, torch.ones(2, 3, 4).bool())
    with pytest.raises(ValueError, match="positive int"):
        AdditiveAttention(3, 0, 4)


@pytest.mark.parametrize("projected", [False, True])
def test_fakes_see_the_arguments_of_a_keyword_call(projected: bool) -> None:
    query, keys, values, w_query, w_keys, v = (t.detach() for t in make_inputs(2, 3, 5))
    if projected:
        keys, w_keys = keys @ w_keys.t(), None
    mask = torch.rand(2, 1, 5) > 0.3
    fwd = (query, keys, values, w_query, w_keys, v, mask, 16)
    assert_fake_matches_keyword_call(torch.ops.memfit.additive_attention, fwd)
    out, lse = torch.ops.memfit.additive_attention(*fwd)
    bwd = (torch.ones_like(out), *fwd[:7], out, lse, 16)
    assert_fake_matches_keyword_call(torch.ops.memfit.additive_attention_backward, bwd)
