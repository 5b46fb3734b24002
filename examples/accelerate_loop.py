"""An accelerate training loop with memfit: gradient accumulation, ``save_state`` and
``load_state``, ``unwrap_model(model).save_pretrained``.

    python examples/accelerate_loop.py

memfit is applied to the model before ``accelerator.prepare``; the model stays itself, so
``unwrap_model`` returns the HuggingFace model, with ``save_pretrained``, and accelerate's
checkpoints hold its own ``state_dict``. A tiny Llama keeps it fast.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

import memfit

VOCAB, LENGTH = 128, 32


def make_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=LENGTH,
    )
    return LlamaForCausalLM(config)


def make_loader(rows: int = 16, batch_size: int = 4) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (rows, LENGTH), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    return torch.utils.data.DataLoader(data, batch_size=batch_size)


def train(
    model: torch.nn.Module, output_dir: str
) -> tuple[Accelerator, torch.nn.Module, list[float]]:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, make_loader())
    losses = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    accelerator.save_state(os.path.join(output_dir, "state"))
    accelerator.unwrap_model(model).save_pretrained(os.path.join(output_dir, "model"))
    return accelerator, model, losses


def main(output_dir: str) -> tuple[torch.nn.Module, list[float]]:
    model = memfit.checkpoint(make_model())  # the one line memfit adds
    accelerator, model, losses = train(model, output_dir)
    accelerator.load_state(os.path.join(output_dir, "state"))  # resume: weights and optimizer
    return accelerator.unwrap_model(model), losses


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        model, losses = main(sys.argv[1] if len(sys.argv) > 1 else tmp)
        print(losses)
        print(model.memfit.plan)
