"""``memfit estimate --from`` against the Hugging Face Trainer itself, on this CPU.

    python -m bench trainer_from        # 4 cases; prints each and writes bench/results/trainer-from-cpu.json

Each case writes a TrainingArguments JSON, reads it with ``memfit.read_trainer_config`` and estimates the step
(CPU semantics), then runs ``transformers.Trainer`` with the same file (plus ``use_cpu``) for 3 steps on a tiny
Llama: its peak is the model's bytes plus the highest the CPU allocator's own events reach while ``train()`` runs
(``estimator/truth.py``: torch.profiler with profile_memory), the Trainer's accelerate autocast, checkpointing,
optimizer and data collation included. ``MemfitCallback``'s per-step figure (live tensors counted by a dispatch
mode, ``training/hf.py``) is recorded beside it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file

import torch  # noqa: E402
import transformers as tf  # noqa: E402

from memfit import estimate, read_trainer_config  # noqa: E402
from memfit.estimator.truth import allocator_peak, resident_bytes  # noqa: E402
from memfit.training.hf import MemfitCallback  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = "trainer-from-cpu.json"
CASES = [("fp32", {}), ("fp32 checkpointing", {"gradient_checkpointing": True}), ("bf16", {"bf16": True}),
         ("bf16 checkpointing", {"bf16": True, "gradient_checkpointing": True})]


def _model():
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                              max_position_embeddings=128))


class _Data(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = torch.randint(1, 256, (64,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def run(name: str, extra: dict) -> dict:
    folder = tempfile.mkdtemp()
    args = {"output_dir": folder, "per_device_train_batch_size": 4, "optim": "adamw_torch", "max_steps": 3,
            "report_to": "none", "logging_steps": 1, "save_strategy": "no", "learning_rate": 1e-3,
            "dataloader_num_workers": 0, "disable_tqdm": True, "bf16": False, "gradient_checkpointing": False,
            **extra}
    path = os.path.join(folder, "args.json")
    with open(path, "w") as f:
        json.dump(args, f)
    config = read_trainer_config(path)
    batch = {k: torch.stack([_Data()[i][k] for i in range(4)]) for k in ("input_ids", "labels")}
    predicted = estimate(_model, batch, recipe=config.recipe, device="cpu").peak_bytes
    callback = MemfitCallback(predicted)
    parsed = tf.HfArgumentParser(tf.TrainingArguments).parse_dict({**args, "use_cpu": True})[0]
    model = _model()
    trainer = tf.Trainer(model=model, args=parsed, train_dataset=_Data(), callbacks=[callback])
    measured = resident_bytes(model, {}) + allocator_peak(trainer.train)
    return {"case": name, "recipe": config.recipe.describe(), "trainer_peak_bytes": measured,
            "memfit_peak_bytes": predicted, "relative": (predicted - measured) / measured,
            "callback_peak_bytes": max(callback.peaks)}


def main() -> None:
    rows = []
    for name, extra in CASES:
        row = run(name, extra)
        rows.append(row)
        print(f"{name:22s} trainer {row['trainer_peak_bytes']:>10,} B  memfit {row['memfit_peak_bytes']:>10,} B  "
              f"{row['relative']:+.2%}", flush=True)
    _results.write(RESULTS, rows)


if __name__ == "__main__":
    main()
