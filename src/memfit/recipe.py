"""``Recipe``: a choice of memory techniques, as data.

One frozen, validated value that ``estimate``, ``measure`` and ``apply`` all take, so what is
estimated is what runs. Serialises to and from YAML and JSON. Field values are the product's
vocabulary and the CLI flags mirror them:

precision              fp32 | bf16-mixed | fp16-mixed | bf16 (pure bf16 weights: changes the math)
checkpointing          off | blocks | blocks:N (every N-th block) | selective | modules:a.b,c.d
offload_activations    saved activations leave device memory until backward needs them
attention              auto (as the model is) | sdpa | eager
chunked_loss           0 (off) or the number of chunks the LM head + cross-entropy run in
optimizer              adamw | adam | sgd | adafactor | adamw8bit | paged_adamw8bit | adamw4bit
optimizer_in_backward  each parameter steps as soon as its gradient is ready
offload_optimizer      optimizer state and step on the CPU (CUDA devices only)
micro_batch_size       examples per forward/backward (None: the whole batch / accumulation)
grad_accum_steps       micro-batches per optimizer step
lora                   off | lora[:rank] | qlora[:rank] (through peft; changes the math)

Techniques are applied in one documented order (``apply.py``); pairs that cannot work together
raise a ``MemfitError`` naming both fields (``conflicts``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from memfit.errors import MemfitError
from memfit.precision import PRECISIONS

__all__ = ["Recipe", "recipe_from", "EXACT_OPTIMIZERS", "APPROXIMATE_OPTIMIZERS"]

EXACT_OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor")
APPROXIMATE_OPTIMIZERS = ("adamw8bit", "paged_adamw8bit", "adamw4bit")
ATTENTION = ("auto", "sdpa", "eager")


@dataclass(frozen=True)
class Recipe:
    precision: str = "fp32"
    checkpointing: str = "off"
    offload_activations: bool = False
    attention: str = "auto"
    chunked_loss: int = 0
    optimizer: str = "adamw"
    optimizer_in_backward: bool = False
    offload_optimizer: bool = False
    micro_batch_size: int | None = None
    grad_accum_steps: int = 1
    lora: str = "off"

    def __post_init__(self):
        _choice("precision", self.precision, PRECISIONS)
        _choice("attention", self.attention, ATTENTION)
        _choice("optimizer", self.optimizer, EXACT_OPTIMIZERS + APPROXIMATE_OPTIMIZERS)
        self.checkpoint_plan()
        self.lora_plan()
        for name in ("offload_activations", "optimizer_in_backward", "offload_optimizer"):
            if not isinstance(getattr(self, name), bool):
                raise MemfitError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not _int(self.chunked_loss) or self.chunked_loss < 0 or self.chunked_loss == 1:
            raise MemfitError(f"chunked_loss must be 0 (off) or a number of chunks >= 2, got {self.chunked_loss!r}")
        if not _int(self.grad_accum_steps) or self.grad_accum_steps < 1:
            raise MemfitError(f"grad_accum_steps must be a positive integer, got {self.grad_accum_steps!r}")
        if self.micro_batch_size is not None and (not _int(self.micro_batch_size) or self.micro_batch_size < 1):
            raise MemfitError(f"micro_batch_size must be a positive integer, got {self.micro_batch_size!r}")
        self.conflicts()

    # -- what the fields mean -------------------------------------------------------------
    def checkpoint_plan(self) -> tuple[str, object]:
        """("off" | "blocks" | "selective" | "modules", every-N or module names)."""
        value = self.checkpointing
        if value in ("off", "blocks", "selective"):
            return value, 1
        kind, _, rest = str(value).partition(":")
        if kind == "blocks" and rest.isdigit() and int(rest) >= 1:
            return "blocks", int(rest)
        if kind == "modules" and rest:
            return "modules", tuple(name.strip() for name in rest.split(",") if name.strip())
        raise MemfitError(f"checkpointing {value!r} not understood: use off, blocks, blocks:2, selective "
                          "or modules:name1,name2")

    def lora_plan(self) -> tuple[str, int]:
        """("off" | "lora" | "qlora", rank)."""
        kind, _, rank = str(self.lora).partition(":")
        if kind not in ("off", "lora", "qlora") or (rank and not rank.isdigit()) or rank == "0":
            raise MemfitError(f"lora {self.lora!r} not understood: use off, lora, lora:16 or qlora:64")
        return kind, int(rank) if rank else 16

    @property
    def is_exact(self) -> bool:
        """False when a technique changes the math: 8-/4-bit optimizer state, LoRA, pure bf16."""
        return not self.approximations

    @property
    def approximations(self) -> list[str]:
        found = []
        if self.optimizer in APPROXIMATE_OPTIMIZERS:
            found.append(f"optimizer={self.optimizer}")
        if self.lora != "off":
            found.append(f"lora={self.lora}")
        if self.precision == "bf16":
            found.append("precision=bf16")
        return found

    def conflicts(self) -> None:
        """Raise for pairs of fields that cannot work together, naming both."""
        rules = [
            (self.optimizer_in_backward and self.grad_accum_steps > 1,
             "optimizer_in_backward and grad_accum_steps > 1 conflict: the step happens in every backward, "
             "so gradients cannot accumulate; set grad_accum_steps=1"),
            (self.optimizer_in_backward and self.precision == "fp16-mixed",
             "optimizer_in_backward and precision=fp16-mixed conflict: the GradScaler must see every gradient "
             "before stepping; use bf16-mixed"),
            (self.optimizer_in_backward and self.offload_optimizer,
             "optimizer_in_backward and offload_optimizer conflict: choose one"),
            (self.offload_optimizer and self.optimizer in APPROXIMATE_OPTIMIZERS,
             f"offload_optimizer and optimizer={self.optimizer} conflict: quantized states stay on the device"),
            (self.lora.startswith("qlora") and self.precision in ("fp32", "fp16-mixed"),
             f"lora={self.lora} and precision={self.precision} conflict: QLoRA computes in bf16; use bf16-mixed"),
        ]
        for broken, message in rules:
            if broken:
                raise MemfitError(message)

    # -- data -----------------------------------------------------------------------------
    def replace(self, **changes) -> "Recipe":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Recipe":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise MemfitError(f"unknown recipe field(s) {', '.join(unknown)}: the fields are {', '.join(sorted(fields))}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def load(cls, path: str) -> "Recipe":
        """A recipe from a ``.yaml``/``.yml`` or ``.json`` file."""
        import yaml

        try:
            with open(path) as f:
                data = yaml.safe_load(f)  # JSON is YAML too
        except OSError as err:
            raise MemfitError(f"cannot read recipe {path}: {err.strerror}") from None
        except yaml.YAMLError as err:
            raise MemfitError(f"recipe {path} is not valid YAML/JSON: {str(err).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise MemfitError(f"recipe {path} must be a mapping of field: value")
        return cls.from_dict(data)

    def save(self, path: str) -> None:
        text = self.to_json() if path.endswith(".json") else self.to_yaml()
        with open(path, "w") as f:
            f.write(text)

    def describe(self) -> str:
        """The non-default fields, e.g. ``bf16-mixed, checkpointing=blocks, grad_accum_steps=4``."""
        default = Recipe()
        parts = [f"{k}={v}" for k, v in self.to_dict().items() if getattr(default, k) != v]
        return ", ".join(parts) or "plain fp32 step"


def recipe_from(recipe: Recipe | None, precision: str, optimizer) -> tuple[Recipe, object]:
    """The recipe of an ``estimate``/``measure`` call and the optimizer factory, if one was passed.

    ``precision=`` and ``optimizer=`` are shorthands for the recipe's fields; given with a recipe
    they must agree with it.
    """
    factory = optimizer if callable(optimizer) else None
    if recipe is None:
        return Recipe(precision=precision, optimizer="adamw" if factory else optimizer), factory
    if not isinstance(recipe, Recipe):
        raise MemfitError(f"recipe must be a memfit.Recipe, got {type(recipe).__name__}: use Recipe.load(path)")
    if precision not in ("fp32", recipe.precision):
        raise MemfitError(f"precision={precision} and recipe.precision={recipe.precision} conflict: set one")
    if not factory and optimizer not in ("adamw", recipe.optimizer):
        raise MemfitError(f"optimizer={optimizer} and recipe.optimizer={recipe.optimizer} conflict: set one")
    return recipe, factory


def _choice(name, value, allowed):
    if value not in allowed:
        raise MemfitError(f"unknown {name} {value!r}: choose one of {', '.join(allowed)}")


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
