"""HuggingFace ``Trainer`` with memfit: one line, ``memfit.checkpoint(model)``, and nothing else.

    python examples/hf_trainer.py

memfit changes the model in place, so ``Trainer`` sees the model itself: it keeps the dataset
columns ``model.forward`` names (its signature is the original's), infers the label names for
``evaluate()``, saves every checkpoint with ``save_pretrained`` (tied weights included), and
``from_pretrained`` and ``resume_from_checkpoint`` load them. Evaluation runs plain PyTorch.
A tiny GPT-2 keeps it fast; nothing here is specific to its size.
"""

from __future__ import annotations

import sys
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import memfit

VOCAB, LENGTH = 128, 32


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=LENGTH)
    return GPT2LMHeadModel(config)


def make_dataset(rows: int = 16) -> list[dict[str, torch.Tensor]]:
    """Token rows as a tokenizer would give them; ``labels`` are the inputs (causal LM)."""
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(rows):
        ids = torch.randint(0, VOCAB, (LENGTH,), generator=g)
        data.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return data


def make_trainer(model: GPT2LMHeadModel, output_dir: str, max_steps: int = 4) -> Trainer:
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        max_steps=max_steps,
        save_steps=2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        seed=0,
    )
    data = make_dataset()
    return Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:8])


def main(output_dir: str) -> tuple[Trainer, dict[str, float]]:
    model = make_model()
    memfit.checkpoint(model)  # the one line memfit adds
    trainer = make_trainer(model, output_dir)
    trainer.train()
    return trainer, trainer.evaluate()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        trainer, metrics = main(sys.argv[1] if len(sys.argv) > 1 else tmp)
        print(metrics)
        print(trainer.model.memfit.plan)
