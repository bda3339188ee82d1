"""A Hugging Face Trainer script: a small Llama from its config, random tokens, the Trainer's own loop."""
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

out_dir = sys.argv[1] if len(sys.argv) > 1 else "hf-out"
config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
model = LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 512, (32,))
        return {"input_ids": ids, "labels": ids.clone()}


args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=4, max_steps=4, learning_rate=1e-4,
                         report_to=[], save_strategy="no", logging_steps=1, dataloader_num_workers=0,
                         dataloader_pin_memory=False, disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=Tokens()).train()
