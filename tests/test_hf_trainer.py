"""A recipe in Hugging Face's Trainer: TrainingArguments carry it (or a field it cannot express is
one error), and MemfitCallback's measured peak of a real Trainer run on the CPU is memfit's
estimate of the same step."""

import pytest
import torch
import transformers as tf

from memfit import MemfitError, Recipe, estimate


def hf():
    """memfit.training.hf, imported where a test uses it: its TrainerCallback base imports transformers' Trainer
    stack (peft, torchao, bitsandbytes: ~4 s), which each pytest worker would pay when it collects this module."""
    from memfit.training import hf

    return hf


def _config():
    return tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


def _model():
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(_config())


class _Data(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = torch.randint(1, 256, (64,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def test_fields_carry_the_recipe_and_refuse_what_the_trainer_cannot_do():
    trainer_fields, training_arguments = hf().trainer_fields, hf().training_arguments
    fields = trainer_fields(Recipe(precision="bf16-mixed", checkpointing="blocks", micro_batch_size=4,
                                   grad_accum_steps=8, optimizer="adamw", optimizer_impl="fused"))
    assert fields == {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 8, "bf16": True,
                      "fp16": False, "optim": "adamw_torch_fused", "gradient_checkpointing": True,
                      "gradient_checkpointing_kwargs": {"use_reentrant": False}}
    assert trainer_fields(Recipe(optimizer="paged_adamw8bit"))["optim"] == "paged_adamw_8bit"
    for recipe, message in ((Recipe(chunked_loss=4), "no argument for chunked_loss=4"),
                            (Recipe(lora="lora:8"), "no argument for lora"),
                            (Recipe(checkpointing="selective"), "every block or none"),
                            (Recipe(optimizer_impl="foreach"), "no Trainer optim name")):
        with pytest.raises(MemfitError, match=message):
            trainer_fields(recipe)
    with pytest.raises(MemfitError, match="contradicts the recipe"):
        training_arguments(Recipe(micro_batch_size=2), output_dir="x", per_device_train_batch_size=8)


def test_trainer_peak_is_the_estimate(tmp_path):
    MemfitCallback, training_arguments = hf().MemfitCallback, hf().training_arguments
    recipe = Recipe(micro_batch_size=4, checkpointing="blocks", optimizer="adamw")
    args = training_arguments(recipe, output_dir=str(tmp_path), use_cpu=True, max_steps=3, report_to=[],
                              logging_steps=1, save_strategy="no", learning_rate=1e-3, dataloader_num_workers=0,
                              disable_tqdm=True)
    batch = _Data()[0]
    batch = {k: torch.stack([_Data()[i][k] for i in range(4)]) for k in batch}
    predicted = estimate(_model, batch, recipe=recipe).peak_bytes
    callback = MemfitCallback(predicted)
    trainer = tf.Trainer(model=_model(), args=args, train_dataset=_Data(), callbacks=[callback])
    trainer.train()
    measured = max(callback.peaks)
    logged = [h for h in trainer.state.log_history if "memfit/peak_bytes" in h]
    assert len(callback.peaks) == 3 and logged and logged[-1]["memfit/predicted_bytes"] == predicted
    print(f"trainer peak {measured:,} B, memfit {predicted:,} B ({measured / predicted - 1:+.2%})")
    assert abs(measured - predicted) / predicted < 0.02, (measured, predicted)
