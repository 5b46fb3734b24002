"""peft LoRA with memfit, in either order: before or after ``get_peft_model``.

    python examples/peft_lora.py

memfit changes the model in place and leaves every attribute its own, so peft finds what it
looks for (``prepare_inputs_for_generation``, ``config``) and ``get_peft_model`` returns a
``PeftModel`` as usual; applied after peft, the ``PeftModel`` stays one
(``isinstance(model, PeftModel)``). ``generate`` runs plain PyTorch; ``save_pretrained`` saves
the adapter alone. A tiny Llama (grouped-query attention, rotary embeddings) keeps it fast.
"""

from __future__ import annotations

import sys
import tempfile

import torch
from peft import LoraConfig, PeftModel, get_peft_model
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


def lora(model: torch.nn.Module) -> PeftModel:
    torch.manual_seed(1)  # LoRA's A matrices are drawn at random
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return get_peft_model(model, config)


def batch(rows: int = 4) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, LENGTH), generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "labels": ids}


def train(model: torch.nn.Module, steps: int = 3) -> list[float]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(**batch()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main(output_dir: str) -> dict[str, object]:
    after = memfit.checkpoint(lora(make_model()))  # memfit after get_peft_model
    before = lora(memfit.checkpoint(make_model()))  # or before it
    results: dict[str, object] = {}
    for name, model in (("after", after), ("before", before)):
        results[f"{name} losses"] = train(model)
        prompt = batch(1)["input_ids"][:, :8]
        results[f"{name} tokens"] = model.generate(input_ids=prompt, max_new_tokens=8).tolist()
    after.save_pretrained(output_dir)  # the adapter's weights and config
    return results


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        print(main(sys.argv[1] if len(sys.argv) > 1 else tmp))
