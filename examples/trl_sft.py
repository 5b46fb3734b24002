"""TRL's ``SFTTrainer`` with memfit: one line, ``memfit.checkpoint(model.base_model)``.

    python examples/trl_sft.py

Supervised fine-tuning is where most users meet a training loop, and TRL's ``SFTTrainer`` is
the entry point they reach for: it tokenizes a text dataset, pads it, and trains with HF
``Trainer`` underneath, with the same losses with memfit as without.

Why the backbone and not the model: ``SFTTrainer`` (TRL 1.16) replaces ``model.forward`` with a
fused LM head (``trl.trainer.utils.add_fused_lm_head``) that, in training, calls
``model.base_model`` (the decoder stack) itself and scores the tokens in chunks without ever
making the logits. Its training step never runs the model's own ``forward``, so memfit applied
to the whole model would never be called there; applied to ``model.base_model`` it plans what
the step runs: every decoder layer, while TRL's chunked head keeps its own small memory.
TRL turns HF's gradient checkpointing on by default; memfit replaces it, so the config turns it
off, for the plain run too (docs/frameworks.md: HF checkpointing and memfit together, use one).

A tiny Llama and a word-level tokenizer built in memory keep it offline and fast; nothing here
is specific to their size.
"""

from __future__ import annotations

import sys
import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

import memfit

WORDS = (
    "the a cat dog bird sees likes follows chases small big red blue green tree house "
    "river hill near over under and then quickly slowly"
).split()
SPECIAL = ["<pad>", "<eos>", "<unk>"]


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over :data:`WORDS`, as ``AutoTokenizer`` would give one."""
    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def make_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(SPECIAL) + len(WORDS),
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
    )
    return LlamaForCausalLM(config)


def make_dataset(rows: int = 16) -> Dataset:
    """Sentences of 12-24 words drawn under seed 0, in a ``text`` column as SFT datasets have."""
    g = torch.Generator().manual_seed(0)
    texts = []
    for _ in range(rows):
        n = int(torch.randint(12, 25, (1,), generator=g))
        picks = torch.randint(0, len(WORDS), (n,), generator=g).tolist()
        texts.append(" ".join(WORDS[i] for i in picks))
    return Dataset.from_dict({"text": texts})


def make_trainer(model: LlamaForCausalLM, output_dir: str, max_steps: int = 4) -> SFTTrainer:
    args = SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        max_steps=max_steps,
        max_length=32,
        gradient_checkpointing=False,  # memfit replaces it; SFTConfig's default is True
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        dataset_num_proc=None,
    )
    return SFTTrainer(
        model=model, args=args, train_dataset=make_dataset(), processing_class=make_tokenizer()
    )


def losses(trainer: SFTTrainer) -> list[float]:
    """The training loss of each step, as ``SFTTrainer`` logged it."""
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main(output_dir: str) -> SFTTrainer:
    model = make_model()
    memfit.checkpoint(model.base_model)  # the one line memfit adds (the backbone: see above)
    trainer = make_trainer(model, output_dir)
    trainer.train()
    return trainer


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        trainer = main(sys.argv[1] if len(sys.argv) > 1 else tmp)
        print(losses(trainer))
        print(trainer.model.base_model.memfit.plan)
