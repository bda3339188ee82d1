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
import re
from dataclasses import dataclass

from memfit.errors import MemfitError, shown
from memfit.techniques.precision import PRECISIONS

__all__ = ["Recipe", "recipe_from", "EXACT_OPTIMIZERS", "APPROXIMATE_OPTIMIZERS"]

EXACT_OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor")
APPROXIMATE_OPTIMIZERS = ("adamw8bit", "paged_adamw8bit", "adamw4bit")
ATTENTION = ("auto", "sdpa", "eager")
# Bounds on counts: past these an estimate would trace for hours (every micro-batch and chunk runs)
# or sizes would overflow 64-bit byte counts; no training step is near them.
MAX_ACCUM_STEPS = 1024
MAX_CHUNKS = 65536
MAX_BATCH = 1 << 24
MAX_LORA_RANK = 65536
MAX_FILE_BYTES = 64 * 1024  # a recipe file is a dozen short lines
MAX_DEPTH = 8  # nesting levels a recipe file may have (it needs one)


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
                raise MemfitError(f"{name} must be true or false, got {shown(getattr(self, name))}")
        if not _int(self.chunked_loss) or self.chunked_loss < 0 or self.chunked_loss == 1 \
                or self.chunked_loss > MAX_CHUNKS:
            raise MemfitError(f"chunked_loss must be 0 (off) or a number of chunks from 2 to {MAX_CHUNKS}, "
                              f"got {shown(self.chunked_loss)}")
        if not _int(self.grad_accum_steps) or not 1 <= self.grad_accum_steps <= MAX_ACCUM_STEPS:
            raise MemfitError(f"grad_accum_steps must be an integer from 1 to {MAX_ACCUM_STEPS}, got "
                              f"{shown(self.grad_accum_steps)}: memory stops changing after the second "
                              "micro-batch, so a smaller count gives the same peak")
        if self.micro_batch_size is not None and (not _int(self.micro_batch_size)
                                                  or not 1 <= self.micro_batch_size <= MAX_BATCH):
            raise MemfitError(f"micro_batch_size must be an integer from 1 to {MAX_BATCH}, got "
                              f"{shown(self.micro_batch_size)}")
        self.conflicts()

    # -- what the fields mean -------------------------------------------------------------
    def checkpoint_plan(self) -> tuple[str, object]:
        """("off" | "blocks" | "selective" | "modules", every-N or module names)."""
        value = self.checkpointing
        if value in ("off", "blocks", "selective"):
            return value, 1
        kind, _, rest = value.partition(":") if isinstance(value, str) else ("", "", "")
        if kind == "blocks" and re.fullmatch(r"[0-9]{1,9}", rest) and int(rest) >= 1:
            return "blocks", int(rest)
        names = tuple(name.strip() for name in rest.split(",") if name.strip())
        if kind == "modules" and names:
            return "modules", names
        raise MemfitError(f"checkpointing {shown(value)} not understood: use off, blocks, blocks:2, selective "
                          "or modules:name1,name2")

    def lora_plan(self) -> tuple[str, int]:
        """("off" | "lora" | "qlora", rank)."""
        kind, _, rank = self.lora.partition(":") if isinstance(self.lora, str) else ("", "", "")
        if kind not in ("off", "lora", "qlora") or (kind == "off" and rank) \
                or (rank and not (re.fullmatch(r"[0-9]{1,9}", rank) and 1 <= int(rank) <= MAX_LORA_RANK)):
            raise MemfitError(f"lora {shown(self.lora)} not understood: use off, lora, lora:16 or qlora:64 "
                              f"(a rank from 1 to {MAX_LORA_RANK})")
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
        if not isinstance(data, dict):
            raise MemfitError(f"a recipe is a dict of field: value, got {type(data).__name__}")
        unknown = sorted(shown(k, 30) if not isinstance(k, str) else shown(k, 30)[1:-1] for k in set(data) - fields)
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
        """A recipe from a ``.yaml``/``.yml`` or ``.json`` file.

        Read as YAML 1.2 would (only ``true``/``false`` are booleans, so ``checkpointing: off``
        is the string ``off``), at most ``MAX_FILE_BYTES`` and ``MAX_DEPTH`` levels deep, without
        anchors and aliases (a dozen fields need none, and aliases can expand a small file into
        gigabytes), and with each field at most once.
        """
        import yaml

        name = shown(str(path))
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        except OSError as err:
            raise MemfitError(f"cannot read recipe {name}: {err.strerror or err}") from None
        except (TypeError, ValueError) as err:  # a path of the wrong type, or with a NUL byte
            raise MemfitError(f"cannot read recipe {name}: {err}; pass the path of a .yaml or .json file") from None
        if len(raw) > MAX_FILE_BYTES:
            raise MemfitError(f"recipe {name} is over {MAX_FILE_BYTES // 1024} KiB: a recipe is a dozen "
                              "field: value lines; point --recipe at the right file")
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise MemfitError(f"recipe {name} is not UTF-8 text: write it as YAML or JSON") from None
        try:
            data = yaml.load(text, Loader=_RecipeLoader)  # JSON is YAML too
        except yaml.YAMLError as err:
            raise MemfitError(f"recipe {name} is not valid YAML/JSON: {_yaml_problem(err)}") from None
        except RecursionError:
            raise MemfitError(f"recipe {name} nests too deeply: write it as flat field: value lines") from None
        if not isinstance(data, dict):
            raise MemfitError(f"recipe {name} must be a mapping of field: value, got {type(data).__name__}: "
                              "write lines like `precision: bf16-mixed`")
        bad = [key for key in data if not isinstance(key, str)]
        if bad:
            raise MemfitError(f"recipe {name} has a key {shown(bad[0])} that is not a field name: the fields are "
                              f"{', '.join(f.name for f in dataclasses.fields(cls))}")
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
    if not isinstance(value, str) or value not in allowed:
        raise MemfitError(f"unknown {name} {shown(value)}: choose one of {', '.join(allowed)}")


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _recipe_loader():
    """PyYAML's safe loader with YAML 1.2 booleans, no aliases, bounded depth, no repeated keys."""
    import re

    import yaml

    bool_tag = "tag:yaml.org,2002:bool"

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise yaml.composer.ComposerError(None, None, "anchors and aliases (*name) are not allowed in a "
                                                  "recipe: write each value out", mark)
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    raise yaml.composer.ComposerError(None, None, f"nested more than {MAX_DEPTH} levels: write "
                                                      "flat field: value lines", self.peek_event().start_mark)
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    repeated = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key (a list): reported as not a field name
                    continue
                if repeated:
                    raise yaml.constructor.ConstructorError(None, None, f"field {shown(key)} is given twice: "
                                                            "keep one", key_node.start_mark)
            return super().construct_mapping(node, deep=deep)

    Loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != bool_tag]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(bool_tag, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    return Loader


class _LazyLoader:
    """The loader class, built on first use so importing memfit does not import yaml."""

    cls = None

    def __call__(self, stream):
        if _LazyLoader.cls is None:
            _LazyLoader.cls = _recipe_loader()
        return _LazyLoader.cls(stream)


_RecipeLoader = _LazyLoader()


def _yaml_problem(err) -> str:
    """The parser's complaint and where, in one line."""
    problem = getattr(err, "problem", None)
    mark = getattr(err, "problem_mark", None)
    if problem:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark else problem
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
