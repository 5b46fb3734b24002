"""JointGraph: forward/backward by dataflow, bytes per storage, what backward needs."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import memfit
from memfit.analysis.graph import CUDA_BLOCK_BYTES, allocated_bytes, is_random, is_view_op
from memfit.analysis.sizes import Sizes
from memfit.bench.graphs import joint_graphs


def test_forward_backward_split_and_storage_bytes() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    (jg,) = joint_graphs(model, torch.randn(8, 16))
    names = {n.name: n for n in jg.nodes}
    assert names["tanh"] in jg.forward
    assert all(not jg.is_backward(n) for n in jg.forward)
    assert any(n.target is torch.ops.aten.tanh_backward.default for n in jg.backward)
    own = jg.own_bytes()
    assert own[names["tanh"]] == 8 * 32 * 4
    # views of a parameter (t) allocate nothing, and primals are never counted
    assert own[names["t"]] == 0
    assert jg.bytes_of(jg.primals) == 0


def test_saved_needed_includes_primals_and_random_values() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 4))
    (jg,) = joint_graphs(model, torch.randn(8, 16))
    needed = jg.saved_needed([])  # keep nothing: recompute all that may be recomputed
    assert any(n.op == "placeholder" for n in needed)  # inputs/weights reach the backward
    random_items = [n for n in needed if jg.never_recompute(n)]
    assert random_items, "the dropout mask must be kept whatever the policy says"


class _ReturnsAView(nn.Module):
    """Returns ``tanh(x)`` flattened beside ``lin(tanh(x))``: the linear's backward reads a view
    of the tanh (its input, flattened) and the tanh's backward the tanh itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(x)
        return self.lin(h).sum(), h.flatten()


def test_a_view_of_a_saved_value_is_made_again_from_it_not_handed_over() -> None:
    """Kept beside the value it views, a view is no input of the backward of its own: it is
    taken again from that value (a second input held the same storage, to the end of a
    backward specialized to missing tangents that no longer read it). A view of an input, or
    a view kept alone, is handed over as before."""
    (jg,) = joint_graphs(_ReturnsAView(), torch.randn(8, 2, 16, requires_grad=True))
    tanh = next(n for n in jg.forward if n.target is torch.ops.aten.tanh.default)
    views = [
        n
        for n in jg.forward
        if is_view_op(n) and n.args[0] is tanh and jg.storages[n] == jg.storages[tanh]
    ]
    assert views, "the linear reads the tanh through a view"
    assert jg.saved_needed([tanh, *views]) >= {tanh}
    assert not jg.saved_needed([tanh, *views]) & set(views)
    assert jg.saved_needed(views) & set(views)  # the tanh recomputed: the view is handed over
    t = next(n for n in jg.nodes if n.target is torch.ops.aten.t.default and not jg.is_backward(n))
    assert t in jg.saved_needed([t])  # a view of a parameter stays as it was


@pytest.mark.slow  # 13 s on 2 cores
def test_a_llama_whose_loss_head_is_rewritten_peaks_as_planned_to_the_byte() -> None:
    """``"memory"`` on a tiny HF Llama whose loss head memfit rewrites (hidden 128, 2 layers,
    vocab 2048, 4 x 256 tokens; ``benchmarks/fit_accuracy.py``'s CPU rehearsal): it returns
    its logits too, and kept the head's input through a view only their backward read, which
    a step giving only the loss a gradient never runs. That input, 512 KiB, outlived the loss
    head's backward and the measured step peaked that much above the plan; now neither does."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=352,
        vocab_size=2048,
        max_position_embeddings=256,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    model = memfit.checkpoint(transformers.LlamaForCausalLM(config).train(), "memory")
    ids = torch.randint(0, 2048, (4, 256), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    for _ in range(2):  # planned on the first call, its start seen on the first backward
        step()
        model.zero_grad(set_to_none=True)
    (site,) = model.memfit.plan.loss_heads
    assert site.fused, site
    assert memfit.measure(step).peak_bytes == model.memfit.plan.predicted_peak_bytes


class _Attention(nn.Module):
    def __init__(self, dropout_p: float) -> None:
        super().__init__()
        self.qkv, self.dropout_p = nn.Linear(16, 48), dropout_p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p)


def test_attention_kernels_are_random_only_with_dropout() -> None:
    """SDPA's fused kernels are tagged ``nondeterministic_seeded`` for their dropout: at p = 0
    they draw nothing and may be recomputed (and their scratch measured); with dropout they
    are kept, as any random op."""
    for p, random in ((0.0, False), (0.3, True)):
        (jg,) = joint_graphs(_Attention(p), torch.randn(2, 8, 16))
        kernels = [
            n
            for n in jg.nodes
            if n.op == "call_function"
            and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
        ]
        forward = [n for n in kernels if n in jg.forward]
        assert forward, "the trace holds no seeded attention kernel"
        assert all(is_random(n) is random for n in kernels)
        assert all(jg.must_save(n) is random for n in forward)


def test_is_random_reads_dropout_p_however_it_is_passed() -> None:
    """Positional, keyword, the schema's default (0.0); a ``dropout_p`` that is not a constant
    (a graph input) counts as dropout, and so does every seeded op outside torch's attention
    kernels."""
    g = fx.Graph()
    q, k, v, p = (g.placeholder(n) for n in "qkvp")
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention.default

    def call(args: tuple, kwargs: dict | None = None) -> fx.Node:
        return g.call_function(efficient, (q, k, v, None, True, *args), kwargs or {})

    assert not is_random(call((0.0,)))
    assert not is_random(call((), {"dropout_p": 0.0}))
    assert not is_random(call(()))  # the default, 0.0
    assert is_random(call((0.1,)))
    assert is_random(call((), {"dropout_p": 0.1}))
    assert is_random(call((p,)))
    assert is_random(g.call_function(torch.ops.aten.native_dropout.default, (q, 0.0, True)))


def test_a_graph_with_symbolic_sizes_counts_at_any_size_what_a_capture_there_counts() -> None:
    """One capture with the batch as a symbol, read at batch 24, has the storages of a capture
    at batch 24; ops' scratch scales with the bytes they touch."""
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    (dynamic,) = joint_graphs(model, torch.randn(8, 16), dynamic=True)
    (at_8,) = joint_graphs(model, torch.randn(8, 16))
    (at_24,) = joint_graphs(model, torch.randn(24, 16))
    (symbol,) = dynamic.symbols
    assert sorted(dynamic.storage_bytes.values()) == sorted(at_8.storage_bytes.values())
    tanh = next(n for n in dynamic.forward if n.target is torch.ops.aten.tanh.default)
    dynamic.op_scratch = {tanh: 1000}
    resized = dynamic.at(Sizes({symbol: 24}))
    assert sorted(resized.storage_bytes.values()) == sorted(at_24.storage_bytes.values())
    assert resized.op_scratch == {tanh: 3000}  # its input and output are 3x larger
    assert dynamic.storage_bytes != resized.storage_bytes  # the original is untouched
    assert not at_8.symbols and at_8.at(Sizes()).storage_bytes == at_8.storage_bytes


def test_cuda_storages_take_whole_allocator_blocks() -> None:
    """On CUDA the caching allocator rounds every block up to 512 bytes and
    ``memory_allocated`` counts the rounded block, so the simulator must too; CPU is exact."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert [allocated_bytes(n, cpu) for n in (0, 1, 513)] == [0, 1, 513]
    assert [allocated_bytes(n, cuda) for n in (0, 1, 512, 513, 4096)] == [0, 512, 512, 1024, 4096]
    model = nn.Sequential(nn.Linear(16, 3), nn.Tanh(), nn.Linear(3, 4))
    (jg,) = joint_graphs(model, torch.randn(8, 16))
    assert jg.storage_bytes[jg.storages[jg.primals[1]][0]] == 3 * 4  # the first bias: 12 bytes
    jg.storage_devices = dict.fromkeys(jg.storage_devices, cuda)
    on_cuda = jg.at(jg.sizes).storage_bytes
    for key, nbytes in jg.storage_bytes.items():
        assert on_cuda[key] == -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
