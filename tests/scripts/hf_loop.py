"""A plain loop over a Hugging Face causal LM loaded with from_pretrained: bf16 autocast, fused AdamW.

    python hf_loop.py MODEL_FOLDER_OR_HUB_ID [--batch-size 1] [--seq 2048] [--steps 3]
"""
import argparse

import torch
from transformers import AutoModelForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("--batch-size", type=int, default=1)
parser.add_argument("--seq", type=int, default=2048)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
model = AutoModelForCausalLM.from_pretrained(args.model).to(device)
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
vocab = model.config.vocab_size
for step in range(args.steps):
    ids = torch.randint(0, vocab, (args.batch_size, args.seq), device=device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {step}: loss {loss.item():.3f}")
if device == "cuda":
    print(f"max_memory_allocated {torch.cuda.max_memory_allocated()}")
