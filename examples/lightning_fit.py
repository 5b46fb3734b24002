"""Lightning with memfit: apply it to the network inside the ``LightningModule``.

    python examples/lightning_fit.py

Lightning calls ``training_step``, which calls the network; memfit is applied to the network
in place, so the ``LightningModule``'s ``state_dict`` (and every checkpoint Lightning writes)
has the network's own keys and buffer persistence: a checkpoint trained with memfit loads
strictly into the plain network, and a plain one into a network with memfit applied.
"""

from __future__ import annotations

import sys
import tempfile

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F

import memfit

WIDTH, LENGTH, VOCAB = 64, 32, 96


class Net(nn.Module):
    """A small causal language model; the causal mask is a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.1, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)
        mask = torch.full((LENGTH, LENGTH), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids), mask=self.mask, is_causal=True))


class LanguageModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = memfit.checkpoint(Net())  # the one line memfit adds

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.net(batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def make_loader(rows: int = 16) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (rows, LENGTH + 1), generator=g)
    return torch.utils.data.DataLoader(list(data), batch_size=4)


def main(output_dir: str) -> tuple[LanguageModel, str]:
    torch.manual_seed(0)
    module = LanguageModel()
    trainer = L.Trainer(
        default_root_dir=output_dir,
        max_steps=4,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, make_loader())
    saved = trainer.checkpoint_callback
    return module, saved.best_model_path or saved.last_model_path


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        module, path = main(sys.argv[1] if len(sys.argv) > 1 else tmp)
        print(path)
        print(module.net.memfit.plan)
