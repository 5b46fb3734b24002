"""The model zoo: one shared set of small models that every memfit feature is tested on.

memfit rewrites the joint forward/backward graph that ``torch.compile`` captures, choosing
which activations to keep and which to recompute. Bugs in that kind of rewrite hide in the
shape of the graph rather than in any single op, so every feature (capture, analysis,
planning, execution, measurement) is exercised on the same collection of graph shapes
instead of on ad-hoc models written per test:

* ``mlp``          -- a plain chain: every node is a separator, the textbook case.
* ``resnet``       -- short skips (pre-activation CIFAR ResNet v2) and BatchNorm buffers
                      that are mutated during the forward.
* ``transformer``  -- attention: several parallel paths between residual separators.
* ``unet``         -- long skips: encoder features are concatenated into the decoder, so
                      the graph has no single-node separator across the whole network.
* ``lstm``         -- a long unrolled recurrence with weights shared by every step.
* ``densenet``     -- dense connectivity: every layer reads every earlier feature map.
* ``dropout``      -- randomness: recomputation must replay the same dropout masks.
* ``inplace_relu`` -- in-place ops (``ReLU(inplace=True)``, ``x += y``) in the forward.
* ``shared``       -- one submodule called twice (shared weights, gradients accumulate).
* ``structured``   -- keyword arguments in and a dict holding a tuple out.
* ``gpt2``         -- a real HuggingFace model (``GPT2LMHeadModel``), built from a config
                      without any download.

Each :class:`ZooCase` builds a fresh, deterministically initialised model and deterministic
inputs, and knows how to turn the model's output into a scalar loss. All cases are small
enough that one fp32 forward+backward on two CPU cores takes well under 0.2 s (1-25 ms).

The factories :func:`cifar_resnet`, :func:`unet`, :func:`lstm` and :func:`tanh_chain` are
exported for tests and benchmarks that need bigger or differently shaped versions
(ResNet-110 is ``cifar_resnet(18)``; the O(sqrt n) memory test uses ``tanh_chain``), with
:func:`seeded` and :func:`randn` to make them as deterministic as the zoo's own cases.

It lives in the package (``memfit.bench.zoo``) because the tests and the benchmark scripts
both train it, and both import it like any installed module. Importing it imports torch and
memfit only; ``transformers`` is imported lazily by the ``gpt2`` case.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.bench.resnet import CifarResNet, PreActBlock, cifar_resnet  # noqa: F401  (re-exported)

__all__ = [
    "SEED",
    "Inputs",
    "ZOO",
    "ZooCase",
    "case",
    "measured_step_peak",
    "randn",
    "seeded",
    "cifar_resnet",
    "densenet_block",
    "lstm",
    "tanh_chain",
    "tanh_chain_case",
    "tree_to",
    "unet",
]

#: Seed used by every ``make_model`` (via ``torch.manual_seed``) and every ``make_inputs``
#: (via a private ``torch.Generator``).
SEED = 0

#: What a case's ``make_inputs`` returns: ``(args, kwargs)`` for ``model(*args, **kwargs)``.
Inputs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class ZooCase:
    """One model of the zoo.

    ``make_model`` returns a fresh model in training mode; it calls ``torch.manual_seed``
    itself, so two calls give identical weights. ``make_inputs`` returns ``(args, kwargs)``
    for ``model(*args, **kwargs)``; it draws from its own ``torch.Generator`` and leaves the
    global RNG alone. ``loss`` maps the model's output (tensor, tuple, dict or HF
    ``ModelOutput``) to a scalar.
    """

    name: str
    make_model: Callable[[], nn.Module]
    make_inputs: Callable[[], Inputs]
    loss: Callable[[Any], torch.Tensor]
    has_dropout: bool = False
    has_batchnorm: bool = False

    def __repr__(self) -> str:  # keeps pytest ids and failure messages short
        return f"ZooCase({self.name!r})"


# --------------------------------------------------------------------------------------
# helpers


def _gen(seed: int = SEED) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = SEED) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed))


def seeded(build: Callable[[], nn.Module], seed: int = SEED) -> Callable[[], nn.Module]:
    """Wrap a model constructor so that it seeds the global RNG first and returns train mode."""

    def make_model() -> nn.Module:
        torch.manual_seed(seed)
        return build().train()

    return make_model


def _xent0(logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every row against class 0 (a fixed, input-independent target)."""
    logits = logits.reshape(-1, logits.shape[-1])
    target = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits, target)


def tree_to(obj: Any, device: torch.device | str) -> Any:
    """Move every tensor inside nested tuples/lists/dicts to ``device`` (for ``make_inputs``)."""
    if isinstance(obj, torch.Tensor):
        moved = obj.detach().to(device)
        return moved.requires_grad_(obj.requires_grad) if obj.is_leaf else moved
    if isinstance(obj, tuple):
        return tuple(tree_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [tree_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: tree_to(v, device) for k, v in obj.items()}
    return obj


# --------------------------------------------------------------------------------------
# 1. mlp: a plain chain


class MLP(nn.Module):
    def __init__(
        self, depth: int = 8, width: int = 64, d_in: int = 32, d_out: int = 10, dropout: float = 0.0
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        d = d_in
        for _ in range(depth):
            layers += [nn.Linear(d, width), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            d = width
        layers.append(nn.Linear(d, d_out))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


# --------------------------------------------------------------------------------------
# 2. resnet: CIFAR ResNet v2 (pre-activation, He et al. 2016, "Identity Mappings")


# ``cifar_resnet``, ``CifarResNet`` and ``PreActBlock`` come from ``memfit.bench.resnet``: the model
# the demo and the depth sweep train, so the README's figures and the tests describe one
# architecture (``cifar_resnet(18)`` is ResNet-110).


# --------------------------------------------------------------------------------------
# 3. transformer: nn.TransformerEncoder


class Encoder(nn.Module):
    def __init__(self, d_model: int = 32, nhead: int = 4, num_layers: int = 2) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            d_model, nhead, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


# --------------------------------------------------------------------------------------
# 4. unet: long skip connections


def _conv_block(c_in: int, c_out: int, convs: int = 2) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU()]
    for _ in range(convs - 1):
        layers += [nn.Conv2d(c_out, c_out, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers)


class UNet(nn.Module):
    def __init__(
        self,
        depth: int,
        width: int,
        in_channels: int = 1,
        out_channels: int = 1,
        convs_per_block: int = 2,
    ) -> None:
        super().__init__()
        chans = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList()
        c = in_channels
        for i in range(depth):
            self.down.append(_conv_block(c, chans[i], convs_per_block))
            c = chans[i]
        self.bottleneck = _conv_block(chans[depth - 1], chans[depth], convs_per_block)
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        for i in reversed(range(depth)):
            self.up.append(nn.ConvTranspose2d(chans[i + 1], chans[i], 2, stride=2))
            self.dec.append(_conv_block(2 * chans[i], chans[i], convs_per_block))
        self.head = nn.Conv2d(chans[0], out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips: list[torch.Tensor] = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottleneck(x)
        for up, dec in zip(self.up, self.dec):
            x = dec(torch.cat([up(x), skips.pop()], dim=1))
        return self.head(x)


def unet(
    depth: int = 3,
    width: int = 8,
    in_channels: int = 1,
    out_channels: int = 1,
    convs_per_block: int = 2,
) -> nn.Module:
    """U-Net with ``depth`` down/up levels, ``width * 2**i`` channels at level ``i``.

    Input height and width must be divisible by ``2**depth``. Encoder features are
    concatenated into the decoder (long skips), so nothing separates the network in two.
    """
    return UNet(depth, width, in_channels, out_channels, convs_per_block)


# --------------------------------------------------------------------------------------
# 5. lstm: LSTMCell unrolled in a Python loop


class UnrolledLSTM(nn.Module):
    def __init__(self, steps: int, input_size: int, hidden_size: int, num_classes: int) -> None:
        super().__init__()
        self.steps = steps
        self.hidden_size = hidden_size
        self.cell = nn.LSTMCell(input_size, hidden_size)
        self.head = nn.Linear(hidden_size, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (batch, steps, input_size) -> logits for every step (batch, steps, classes)."""
        h = x.new_zeros(x.shape[0], self.hidden_size)
        c = x.new_zeros(x.shape[0], self.hidden_size)
        hs: list[torch.Tensor] = []
        for t in range(self.steps):
            h, c = self.cell(x[:, t], (h, c))
            hs.append(h)
        return self.head(torch.stack(hs, dim=1))


def lstm(
    steps: int = 32, input_size: int = 16, hidden_size: int = 32, num_classes: int = 10
) -> nn.Module:
    """An ``nn.LSTMCell`` unrolled over ``steps`` steps, with a linear head on every ``h``.

    Input: (batch, steps, input_size).
    """
    return UnrolledLSTM(steps, input_size, hidden_size, num_classes)


# --------------------------------------------------------------------------------------
# 6. densenet: one dense block


class DenseLayer(nn.Module):
    def __init__(self, c_in: int, growth: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(c_in)
        self.conv = nn.Conv2d(c_in, growth, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.relu(self.bn(x)))


class DenseNetBlock(nn.Module):
    def __init__(self, num_layers: int, c_in: int, growth: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c_in, 3, padding=1, bias=False)
        self.layers = nn.ModuleList(
            DenseLayer(c_in + i * growth, growth) for i in range(num_layers)
        )
        c_out = c_in + num_layers * growth
        self.bn = nn.BatchNorm2d(c_out)
        self.fc = nn.Linear(c_out, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [self.stem(x)]
        for layer in self.layers:
            features.append(layer(torch.cat(features, dim=1)))
        out = F.relu(self.bn(torch.cat(features, dim=1)))
        return self.fc(F.adaptive_avg_pool2d(out, 1).flatten(1))


def densenet_block(
    num_layers: int = 6, c_in: int = 16, growth: int = 8, num_classes: int = 10
) -> nn.Module:
    """Stem conv, one dense block of BN-ReLU-conv3x3 layers (each reads the concatenation
    of all earlier feature maps), then BN-ReLU-pool-linear. Input: (batch, 3, H, W)."""
    return DenseNetBlock(num_layers, c_in, growth, num_classes)


# --------------------------------------------------------------------------------------
# 8. inplace_relu: in-place ops in the forward


class InplaceBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.conv1(x))  # in-place on the conv output
        y = self.conv2(y)
        y += x  # in-place add on the conv output (not saved by conv)
        return self.relu(y)


class InplaceNet(nn.Module):
    def __init__(self, c: int = 8, blocks: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.blocks = nn.Sequential(*(InplaceBlock(c) for _ in range(blocks)))
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.relu(self.stem(x)))
        x = x.mean(dim=(2, 3))
        x.mul_(2.0)  # in-place on a non-leaf view-free intermediate
        return self.fc(x)


# --------------------------------------------------------------------------------------
# 9. shared: one submodule called twice


class SharedNet(nn.Module):
    def __init__(self, d_in: int = 32, width: int = 64, d_out: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.shared = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        self.mid = nn.Linear(width, width)
        self.out = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        x = x + self.shared(x)
        x = torch.tanh(self.mid(x))
        x = x + self.shared(x)  # same weights, second use
        return self.out(x)


# --------------------------------------------------------------------------------------
# 10. structured: keyword arguments in, dict with a tuple out


class StructuredNet(nn.Module):
    def __init__(self, d: int = 32, d_out: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        self.logits = nn.Linear(d, d_out)
        self.aux_a = nn.Linear(d, 4)
        self.aux_b = nn.Linear(d, 1)

    def forward(
        self, x: torch.Tensor, *, mask: torch.Tensor | None = None, scale: float = 1.0
    ) -> dict[str, Any]:
        h = self.body(x) * scale
        if mask is not None:
            h = h.masked_fill(~mask, 0.0)
        a = self.aux_a(h)
        b = self.aux_b(torch.relu(h)).squeeze(-1)
        return {"logits": self.logits(h), "aux": (a, b)}


def _structured_loss(out: dict[str, Any]) -> torch.Tensor:
    a, b = out["aux"]
    return _xent0(out["logits"]) + a.square().mean() + 0.1 * b.abs().mean()


# --------------------------------------------------------------------------------------
# 11. gpt2: a real HuggingFace model


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel  # lazy: keep importing the zoo cheap

    # bos/eos default to 50256, outside this vocabulary (transformers warns): unset them.
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        n_positions=64,
        vocab_size=100,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = GPT2LMHeadModel(config)
    # transformers derives `loss_type` from the class name, and "GPT2LMHeadModel" matches
    # none of its loss names, so every forward with labels calls `logger.warning_once`,
    # which dynamo cannot trace: one graph break per call. Naming the loss avoids it.
    model.loss_type = "ForCausalLM"
    return model


def _gpt2_inputs() -> Inputs:
    ids = torch.randint(0, 100, (2, 16), generator=_gen())
    return (), {"input_ids": ids, "labels": ids, "use_cache": False}


def _hf_loss(out: Any) -> torch.Tensor:
    return out["loss"]


# --------------------------------------------------------------------------------------
# tanh_chain: the O(sqrt n) memory test


class TanhChain(nn.Module):
    """``n`` parameterless layers, each ``x = tanh(x)``.

    Every intermediate is needed by the backward of the next tanh, so eager training keeps
    ``n`` activations of ``width * width`` fp32 elements (1 MiB each for ``width=512``).
    """

    def __init__(self, n: int, width: int) -> None:
        super().__init__()
        self.n = n
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = torch.tanh(x)
        return x

    def make_input(self, requires_grad: bool = True) -> torch.Tensor:
        """A deterministic (width, width) input; requires grad since the chain has no weights."""
        return randn(self.width, self.width).requires_grad_(requires_grad)


def tanh_chain(n: int, width: int = 512) -> TanhChain:
    """Chain of ``n`` tanh layers on a (width, width) input; ``width=512`` is 1 MiB/layer."""
    return TanhChain(n, width)


def tanh_chain_case(n: int, width: int = 512) -> ZooCase:
    """A :class:`ZooCase` for ``tanh_chain(n, width)``; loss is ``out.sum()``.

    Not part of :data:`ZOO` (it has no parameters); the input is the leaf requiring grad.
    """
    return ZooCase(
        name=f"tanh_chain_{n}x{width}",
        make_model=seeded(lambda: tanh_chain(n, width)),
        make_inputs=lambda: ((tanh_chain(n, width).make_input(),), {}),
        loss=lambda out: out.sum(),
    )


# --------------------------------------------------------------------------------------
# the zoo


ZOO: list[ZooCase] = [
    ZooCase(
        name="mlp",
        make_model=seeded(lambda: MLP(depth=8, width=64, d_in=32, d_out=10)),
        make_inputs=lambda: ((randn(16, 32),), {}),
        loss=_xent0,
    ),
    ZooCase(
        name="resnet",
        make_model=seeded(lambda: cifar_resnet(blocks_per_stage=2, width=8)),
        make_inputs=lambda: ((randn(4, 3, 32, 32),), {}),
        loss=_xent0,
        has_batchnorm=True,
    ),
    ZooCase(
        name="transformer",
        make_model=seeded(lambda: Encoder(d_model=32, nhead=4, num_layers=2)),
        make_inputs=lambda: ((randn(2, 16, 32),), {}),
        loss=lambda out: out.square().mean(),
    ),
    ZooCase(
        name="unet",
        make_model=seeded(lambda: unet(depth=3, width=8)),
        make_inputs=lambda: ((randn(2, 1, 32, 32),), {}),
        loss=lambda out: out.square().mean(),
    ),
    ZooCase(
        name="lstm",
        make_model=seeded(lambda: lstm(steps=32, input_size=16, hidden_size=32)),
        make_inputs=lambda: ((randn(4, 32, 16),), {}),
        loss=_xent0,
    ),
    ZooCase(
        name="densenet",
        make_model=seeded(lambda: densenet_block(num_layers=6, c_in=16, growth=8)),
        make_inputs=lambda: ((randn(4, 3, 16, 16),), {}),
        loss=_xent0,
        has_batchnorm=True,
    ),
    ZooCase(
        name="dropout",
        make_model=seeded(lambda: MLP(depth=4, width=64, d_in=32, d_out=10, dropout=0.5)),
        make_inputs=lambda: ((randn(16, 32),), {}),
        loss=_xent0,
        has_dropout=True,
    ),
    ZooCase(
        name="inplace_relu",
        make_model=seeded(lambda: InplaceNet(c=8, blocks=3)),
        make_inputs=lambda: ((randn(4, 3, 16, 16),), {}),
        loss=_xent0,
    ),
    ZooCase(
        name="shared",
        make_model=seeded(lambda: SharedNet()),
        make_inputs=lambda: ((randn(16, 32),), {}),
        loss=_xent0,
    ),
    ZooCase(
        name="structured",
        make_model=seeded(lambda: StructuredNet()),
        make_inputs=lambda: (
            (randn(8, 32),),
            {"mask": torch.rand(8, 32, generator=_gen(SEED + 1)) > 0.25, "scale": 0.5},
        ),
        loss=_structured_loss,
    ),
    ZooCase(
        name="gpt2",
        make_model=seeded(_gpt2),
        make_inputs=_gpt2_inputs,
        loss=_hf_loss,
    ),
]

_BY_NAME: dict[str, ZooCase] = {c.name: c for c in ZOO}


def case(name: str) -> ZooCase:
    """The zoo case called ``name``; ``KeyError`` listing the known names otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no zoo case {name!r}; known: {sorted(_BY_NAME)}") from None


def measured_step_peak(
    case: ZooCase, model: nn.Module, args: Any, kwargs: Any, device: str = "cpu"
) -> int:
    """Peak bytes of one training step of ``model`` on ``device`` (measured after a first,
    capturing step).

    Gradients are cleared before and after, so the peak is that of a step on a fresh model.
    """
    case.loss(model(*args, **kwargs)).backward()
    model.zero_grad(set_to_none=True)

    def step() -> None:
        case.loss(model(*args, **kwargs)).backward()

    peak = memfit.measure(step, device=device).peak_bytes
    model.zero_grad(set_to_none=True)
    assert peak is not None  # memory is measured (profile_memory=True)
    return peak
