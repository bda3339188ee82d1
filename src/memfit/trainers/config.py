"""What every trainer config reads into (``TrainerConfig``), and the checks the readers share."""

from __future__ import annotations

import dataclasses

from memfit.errors import MemfitError, shown
from memfit.techniques.recipe import Recipe

__all__ = ["TrainerConfig", "MAX_FILE_BYTES"]

#: the largest config file read (a TrainingArguments file is a few dozen lines)
MAX_FILE_BYTES = 256 * 1024


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """What a trainer's config file says of one training run: the recipe (per-device micro-batch and accumulation
    included), the sequence length and the model where it names them, and how each setting was read."""

    path: str
    kind: str  # "hf-trainer" (TrainingArguments, TRL's SFTConfig / ModelConfig), "accelerate", "lightning" or
    #            "deepspeed" (a ds_config.json)
    recipe: Recipe
    seq_len: int | None = None
    model: str | None = None
    read: tuple = ()  # (setting, value, what memfit made of it), in the file's order
    gpus: int | None = None  # processes per machine, where the file says (accelerate's num_processes / num_machines,
    # Lightning's devices)
    nodes: int | None = None

    def batch_size(self, ranks: int = 1) -> int | None:
        """Examples per optimizer step over ``ranks`` data-parallel ranks (the Trainer's per-device batch x
        accumulation x processes); None where the file leaves the batch to the training script."""
        if self.recipe.micro_batch_size is None:
            return None
        return self.recipe.micro_batch_size * self.recipe.grad_accum_steps * ranks


# what ``read`` says of a setting that leaves a training step's device memory as it is
_NEUTRAL_NOTE = "no effect on a training step's device memory"


def _count(name, key, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MemfitError(f"{name}: {key} must be a positive whole number, got {shown(value, 40)}")
    return value
