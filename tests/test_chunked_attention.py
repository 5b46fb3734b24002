"""chunked_attention computes what naive attention computes, gradients included, for every score-op
chain and shape the capture pass produces, in memory far below one [B, H, L, L] tensor, and shows
AOTAutograd one forward and one backward node."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import memfit
from fake_kernels import assert_fake_matches_keyword_call
from memfit._compat import aot_autograd, make_boxed_func
from memfit.nn import attention_dropout_mask, chunked_attention

NEG_INF = -math.inf
F32_MIN = torch.finfo(torch.float32).min


@dataclass
class Case:
    """Inputs of one attention call, the score ops for the kernel and the same ops written out."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kinds: list[str]
    operands: list[torch.Tensor | None]
    values: list[float]

    def naive_scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        s = q @ k.mT
        for kind, operand, value in zip(self.kinds, self.operands, self.values):
            c = value if operand is None else operand
            if kind == "mul":
                s = s * c
            elif kind == "div":
                s = s / c
            elif kind == "add":
                s = s + c
            else:
                assert isinstance(operand, torch.Tensor)
                s = s.masked_fill(operand, value)
        return s

    def naive(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.naive_scores(q, k).softmax(-1) @ v

    def inputs(self) -> list[torch.Tensor]:
        """Everything that gets a gradient: q, k, v and the add operands requiring grad."""
        extra = [o for o in self.operands if o is not None and o.requires_grad]
        return [self.q, self.k, self.v, *extra]


def _qkv(
    shape: tuple[int, ...], lk: int, d: int, dv: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    *lead, lq = shape

    def t(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g).to(dtype).requires_grad_()

    return t(*lead, lq, d), t(*lead, lk, d), t(*lead, lk, dv)


def _causal(lq: int, lk: int) -> torch.Tensor:
    # as models keep it: a buffer made once for the longest sequence, sliced per call
    return torch.ones(64, 64, dtype=torch.bool).triu(1)[:lq, :lk]


def _scaled_3d() -> Case:
    q, k, v = _qkv((6, 21), 21, 8, 8, seed=1)
    return Case(q, k, v, ["mul"], [None], [8**-0.5])


def _dv_differs_div_tensor() -> Case:
    q, k, v = _qkv((2, 3, 19), 23, 8, 5, seed=2)
    return Case(q, k, v, ["div"], [torch.tensor(8**0.5)], [0.0])


def _mul_zero_dim_tensor() -> Case:
    q, k, v = _qkv((2, 2, 17), 17, 4, 6, seed=3)
    return Case(q, k, v, ["mul"], [torch.tensor(0.37)], [0.0])


def _padding_mask() -> Case:
    q, k, v = _qkv((2, 3, 18), 18, 8, 8, seed=4)
    keep = torch.ones(2, 18, dtype=torch.bool)
    keep[0, 13:] = False
    keep[1, 5:9] = False
    pad = torch.zeros(2, 1, 1, 18).masked_fill(~keep[:, None, None, :], F32_MIN)
    return Case(q, k, v, ["mul", "add"], [None, pad], [8**-0.5, 0.0])


def _causal_fill() -> Case:
    q, k, v = _qkv((1, 2, 29), 29, 8, 8, seed=5)
    return Case(q, k, v, ["mul", "fill"], [None, _causal(29, 29)], [8**-0.5, NEG_INF])


def _learnable_bias() -> Case:
    q, k, v = _qkv((2, 3, 11), 26, 8, 4, seed=6)
    bias = torch.randn(1, 3, 11, 26, generator=torch.Generator().manual_seed(7)).requires_grad_()
    return Case(q, k, v, ["div", "add"], [None, bias], [8**0.5, 0.0])


def _fill_finfo_min_then_add() -> Case:
    q, k, v = _qkv((2, 2, 20), 20, 4, 4, seed=8)
    bias = (
        0.1 * torch.randn(2, 1, 1, 20, generator=torch.Generator().manual_seed(9))
    ).requires_grad_()
    fill = _causal(20, 20)
    return Case(q, k, v, ["fill", "add", "mul"], [fill, bias, None], [F32_MIN, 0.0, 0.5])


def _same_bias_added_twice() -> Case:
    q, k, v = _qkv((2, 13), 13, 4, 4, seed=10)
    bias = torch.randn(13, 13, generator=torch.Generator().manual_seed(11)).requires_grad_()
    return Case(q, k, v, ["add", "mul", "add"], [bias, None, bias], [0.0, 0.5, 0.0])


CASES: dict[str, Callable[[], Case]] = {
    "3d-mul-float": _scaled_3d,
    "4d-dv-differs-div-0dim": _dv_differs_div_tensor,
    "mul-0dim": _mul_zero_dim_tensor,
    "padding-mask-B11L": _padding_mask,
    "causal-fill-sliced-buffer": _causal_fill,
    "learnable-bias-1HLL": _learnable_bias,
    "fill-finfo-min-then-add": _fill_finfo_min_then_add,
    "same-bias-twice": _same_bias_added_twice,
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _check(case: Case, chunk_size: int | None, out_tol: float, grad_tol: float) -> None:
    ref = case.naive(case.q, case.k, case.v)
    out = chunked_attention(
        case.q, case.k, case.v, case.kinds, case.operands, case.values, chunk_size=chunk_size
    )
    assert out.shape == ref.shape and out.dtype == case.v.dtype
    assert _rel(out, ref) <= out_tol
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(0)).to(ref.dtype)
    want = torch.autograd.grad(ref, case.inputs(), grad)
    got = torch.autograd.grad(out, case.inputs(), grad)
    for name, g, w in zip(["q", "k", "v", "operand"], got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert _rel(g, w) <= grad_tol, (name, _rel(g, w))


@pytest.mark.parametrize("chunk_size", [None, 5, 8])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_naive_attention(name: str, chunk_size: int | None) -> None:
    _check(CASES[name](), chunk_size, out_tol=1e-5, grad_tol=1e-4)


def test_float64_inputs_compute_in_float64() -> None:
    case = _learnable_bias()
    case.q, case.k, case.v = (
        t.detach().double().requires_grad_() for t in (case.q, case.k, case.v)
    )
    bias = case.operands[1]
    assert bias is not None
    case.operands[1] = bias.detach().double().requires_grad_()
    _check(case, 7, out_tol=1e-12, grad_tol=1e-11)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_against_float32_reference(dtype: torch.dtype) -> None:
    case = _causal_fill()
    low = [t.detach().to(dtype).requires_grad_() for t in (case.q, case.k, case.v)]
    ref_in = [t.detach().float().requires_grad_() for t in low]
    ref = case.naive(*ref_in)
    out = chunked_attention(*low, case.kinds, case.operands, case.values, chunk_size=8)
    assert out.dtype == dtype
    # the kernel computes in float32, so only the final rounding to 16 bits differs
    assert _rel(out.float(), ref) <= 1e-2
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(0))
    got = torch.autograd.grad(out, low, grad.to(dtype))
    want = torch.autograd.grad(ref, ref_in, grad.to(dtype).float())
    for g, w in zip(got, want):
        assert g.dtype == dtype and _rel(g.float(), w) <= 2e-2


@pytest.mark.parametrize("fill", [NEG_INF, F32_MIN])
def test_fully_masked_rows_behave_as_naive(fill: float) -> None:
    """All -inf: softmax gives NaN rows; finfo.min: uniform rows. Both as naive attention."""
    q, k, v = _qkv((2, 12), 15, 4, 4, seed=12)
    mask = torch.zeros(12, 15, dtype=torch.bool)
    mask[3] = True
    mask[7, :10] = True
    case = Case(q, k, v, ["mul", "fill"], [None, mask], [0.5, fill])
    ref = case.naive(q, k, v)
    out = chunked_attention(q, k, v, case.kinds, case.operands, case.values, chunk_size=4)
    assert ref[:, 3].isnan().all() == (fill == NEG_INF)
    torch.testing.assert_close(out, ref, equal_nan=True, rtol=1e-5, atol=1e-6)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [None, 6])
def test_dropout_with_exact_mask_matches_naive_dropout(chunk_size: int | None) -> None:
    q, k, v = _qkv((2, 3, 21), 19, 8, 6, seed=13)
    p, scale = 0.25, 8**-0.5
    causal = _causal(21, 19)
    torch.manual_seed(123)
    mask = attention_dropout_mask((2, 3, 21, 19), p, q.device)
    out = chunked_attention(
        q, k, v, ["mul", "fill"], [None, causal], [scale, NEG_INF],
        dropout_p=p, dropout_mask=mask, chunk_size=chunk_size,
    )  # fmt: skip
    torch.manual_seed(123)
    probs = (q @ k.mT * scale).masked_fill(causal, NEG_INF).softmax(-1)
    ref = F.dropout(probs, p, training=True) @ v
    assert _rel(out, ref) <= 1e-5
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    for g, w in zip(
        torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)
    ):
        assert _rel(g, w) <= 1e-4


def test_memory_is_far_below_one_score_tensor() -> None:
    """Forward + backward at B1 H2 L2048 D32 with the default chunk size, measured exactly."""
    b, h, n, d = 1, 2, 2048, 32
    q, k, v = _qkv((b, h, n), n, d, d, seed=14)
    scores_bytes = b * h * n * n * 4

    def kernel() -> None:
        chunked_attention(q, k, v, ["mul"], [None], [d**-0.5]).sum().backward()

    def naive() -> None:
        ((q @ k.mT * d**-0.5).softmax(-1) @ v).sum().backward()

    peaks = {}
    for fn in (kernel, naive):
        q.grad = k.grad = v.grad = None
        peak = memfit.measure(fn).peak_bytes
        assert peak is not None
        peaks[fn.__name__] = peak
    assert peaks["kernel"] < scores_bytes / 4, peaks
    assert peaks["naive"] > scores_bytes, peaks


def test_compiled_joint_graph_has_one_forward_and_one_backward_node() -> None:
    graphs: dict[str, torch.fx.GraphModule] = {}

    def keep(name: str) -> Callable[..., object]:
        def compiler(gm: torch.fx.GraphModule, example_inputs: object) -> object:
            graphs[name] = gm
            return make_boxed_func(gm.forward)

        return compiler

    case = _learnable_bias()

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        mask = attention_dropout_mask((2, 3, 11, 26), 0.1, q.device)
        out = chunked_attention(
            q, k, v, ["div", "add"], [None, bias], [8**0.5, 0.0], dropout_p=0.1, dropout_mask=mask
        )
        return out.sum()  # (square() would save out once more, as its own backward input)

    compiled = torch.compile(
        step, backend=aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))
    )
    inputs = case.inputs()
    torch.manual_seed(5)
    got = torch.autograd.grad(compiled(*inputs), inputs)
    torch.manual_seed(5)
    want = torch.autograd.grad(step(*inputs), inputs)
    for g, w in zip(got, want):
        assert _rel(g, w) <= 1e-5

    def memfit_ops(gm: torch.fx.GraphModule) -> list[str]:
        return [
            str(n.target)
            for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("memfit.")
        ]

    assert memfit_ops(graphs["fw"]) == [
        "memfit.attention_dropout_mask.default",
        "memfit.chunked_attention_fwd.default",
    ]
    assert memfit_ops(graphs["bw"]) == ["memfit.chunked_attention_bwd.default"]
    # forward saves exactly q, k, v, the operands (here the bias), the packed mask, out and the
    # softmax statistics: nothing with one fp32 entry per (query, key) pair
    q, k, v, bias = inputs
    saved = [
        (tuple(n.meta["val"].shape), n.meta["val"].dtype)
        for n in graphs["bw"].graph.nodes
        if n.op == "placeholder" and not n.name.startswith("tangents")
    ]
    f32 = torch.float32
    expected = [
        (tuple(q.shape), f32), (tuple(k.shape), f32), (tuple(v.shape), f32),
        (tuple(bias.shape), f32), ((2, 3, 11, math.ceil(26 / 8)), torch.uint8),
        ((2, 3, 11, 2), f32), ((2, 3, 11, 4), f32),
    ]  # fmt: skip
    assert sorted(saved, key=str) == sorted(expected, key=str)


def test_flop_counter_prices_both_ops() -> None:
    b, h, lq, lk, d, dv = 2, 3, 16, 24, 8, 4
    q, k, v = _qkv((b, h, lq), lk, d, dv, seed=15)
    with FlopCounterMode(display=False) as counter:
        chunked_attention(q, k, v, ["mul"], [None], [0.3]).sum().backward()
    flops = counter.get_flop_counts()["Global"]
    fwd = torch.ops.memfit.chunked_attention_fwd
    bwd = torch.ops.memfit.chunked_attention_bwd
    assert flops[fwd] == 2 * b * h * lq * lk * (d + dv)
    assert flops[bwd] == 2 * b * h * lq * lk * (3 * d + 2 * dv)


def _bad_calls() -> list[tuple[str, Callable[[], object]]]:
    q, k, v = (torch.randn(2, 5, 4) for _ in range(3))
    mask = torch.zeros(2, 5, 1, dtype=torch.uint8)
    grad_scale = torch.tensor(2.0, requires_grad=True)
    return [
        ("'pow'", lambda: chunked_attention(q, k, v, ["pow"], [None], [2.0])),
        ("equal lengths", lambda: chunked_attention(q, k, v, ["mul"], [None, None], [1.0])),
        ("requires grad", lambda: chunked_attention(q, k, v, ["mul"], [grad_scale], [0.0])),
        (r"\(3, 1\)", lambda: chunked_attention(q, k, v, ["add"], [torch.zeros(3, 1)], [0.0])),
        ("bool operand", lambda: chunked_attention(q, k, v, ["fill"], [torch.zeros(5, 5)], [0.0])),
        ("needs a bool tensor", lambda: chunked_attention(q, k, v, ["fill"], [None], [0.0])),
        ("1.0", lambda: chunked_attention(q, k, v, dropout_p=1.0, dropout_mask=mask)),
        ("needs a dropout_mask", lambda: chunked_attention(q, k, v, dropout_p=0.1)),
        (r"\(2, 5, 1\)", lambda: chunked_attention(q, k, v, dropout_p=0.1, dropout_mask=mask[:1])),
        ("dropout_p=0", lambda: chunked_attention(q, k, v, dropout_mask=mask)),
        ("leading dims", lambda: chunked_attention(q, k[:1], v[:1])),
        (r"\(2, 5, 3\)", lambda: chunked_attention(q, k[..., :3], v)),
        ("float64", lambda: chunked_attention(q, k.double(), v)),
        ("chunk_size", lambda: chunked_attention(q, k, v, chunk_size=0)),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_inputs_raise_value_errors_naming_the_value(index: int) -> None:
    match, call = _bad_calls()[index]
    with pytest.raises(ValueError, match=match):
        call()


def test_fakes_see_the_arguments_of_a_keyword_call() -> None:
    q, k, v = (t.detach() for t in _qkv((2, 5), 7, 4, 3, seed=16))
    bias = torch.randn(5, 7)
    spec = "mul:v:0x1.0p-1,add:t:0x0p+0"
    fwd = (q, k, v, spec, [bias], 0.0, None, 3)
    assert_fake_matches_keyword_call(torch.ops.memfit.chunked_attention_fwd, fwd)
    out, lse = torch.ops.memfit.chunked_attention_fwd(*fwd)
    bwd = (torch.ones_like(out), q, k, v, out, lse, spec, [bias], 0.0, None, 3, [True])
    assert_fake_matches_keyword_call(torch.ops.memfit.chunked_attention_bwd, bwd)
