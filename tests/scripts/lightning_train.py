"""A Lightning script: a LightningModule and Trainer(max_steps=...) with the accelerator it finds."""
import sys

import lightning as L
import torch
import torch.nn as nn

root = sys.argv[1] if len(sys.argv) > 1 else "lightning-out"


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


data = torch.utils.data.TensorDataset(torch.randn(128, 64), torch.randn(128, 64))
trainer = L.Trainer(max_steps=4, accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=16))
