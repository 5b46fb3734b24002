"""A HuggingFace GPT-2 (tied embedding and LM head) trained as a 3-stage pipeline on one machine.

    python examples/pipeline_gpt2.py          # needs transformers; 3 local processes, gloo

Each process builds the same model, ``memfit.pipeline.Pipeline`` cuts it at the same module
boundaries and runs its stage; the script then compares the pipeline's loss and gradients with
one process's plain PyTorch step on the whole mini-batch. Dropout is off so the two draw no
random numbers (a pipeline draws dropout masks per rank; see the README). Also a factory for
``memfit pipeline``::

    memfit pipeline examples/pipeline_gpt2.py:make --ranks 3 --microbatches 4
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memfit.pipeline import Pipeline, PipelineOptions, launch

VOCAB = 100


def make() -> tuple[torch.nn.Module, torch.Tensor]:
    """Four GPT-2 blocks of width 32, and a mini-batch of 8 sequences of 16 tokens."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=32,
        n_layer=4,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        attn_implementation="eager",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    tokens = torch.randint(0, VOCAB, (8, 16), generator=torch.Generator().manual_seed(1))
    return transformers.GPT2LMHeadModel(config), tokens


def loss_fn(output: object, target: torch.Tensor) -> torch.Tensor:
    logits = output.logits  # type: ignore[attr-defined]
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def rank_step(rank: int) -> tuple[float, dict[str, torch.Tensor]]:
    model, tokens = make()
    target = tokens.roll(-1, dims=1)
    pipe = Pipeline(
        model, tokens, loss_fn, ranks=3, options=PipelineOptions(microbatches=4, schedule="1f1b")
    )
    stage = pipe.plan
    print(  # noqa: T201 - what each rank runs, as planned
        f"rank {rank}: {stage.first_module} .. {stage.last_module}, predicted peak "
        f"{stage.peak_bytes / 2**10:.0f} KiB"
    )
    loss = pipe.step(tokens, target=target)
    return float(loss), {n: p.grad for n, p in pipe.named_parameters()}


def main() -> None:
    results = launch(rank_step, 3, timeout=300)
    model, tokens = make()
    loss = loss_fn(model(tokens), tokens.roll(-1, dims=1))
    loss.backward()
    loss = loss.detach()
    worst = 0.0
    for _, grads in results:
        for name, grad in grads.items():
            reference = dict(model.named_parameters())[name].grad
            assert reference is not None
            worst = max(worst, float((grad - reference).abs().max() / reference.abs().max()))
    print(f"loss: pipeline {results[0][0]:.6f}, one process {float(loss):.6f}")  # noqa: T201
    print(f"largest gradient difference, relative to the gradient's largest entry: {worst:.1e}")  # noqa: T201


if __name__ == "__main__":
    main()
