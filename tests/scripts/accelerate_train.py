"""An accelerate script: Accelerator().prepare and accelerator.backward over a small MLP."""
import torch
import torch.nn as nn
from accelerate import Accelerator

accelerator = Accelerator()
model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 128))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.utils.data.TensorDataset(torch.randn(64, 128), torch.randn(64, 128))
loader = torch.utils.data.DataLoader(data, batch_size=16)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for epoch in range(2):
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}")
