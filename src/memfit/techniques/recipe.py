"""``Recipe``: a choice of memory techniques, as data.

One frozen, validated value that ``estimate``, ``measure`` and ``apply`` all take, so what is
estimated is what runs. Serialises to and from YAML and JSON. Its fields are the techniques'
(each module of ``memfit.techniques`` declares its own: ``spec.py``, ``registry.py``); the CLI flags
mirror them. The built-in ones:

precision              fp32 | bf16-mixed | fp16-mixed | bf16 (pure bf16 weights: changes the math)
checkpointing          off | blocks | blocks:N (every N-th block) | selective | modules:a.b,c.d
offload_activations    saved activations leave device memory until backward needs them
attention              auto (as the model is) | sdpa | eager
chunked_loss           0 (off) or the number of chunks the LM head + cross-entropy run in
optimizer              adamw | adam | sgd | adafactor | adamw8bit | paged_adamw8bit | ao_adamw8bit | adamw4bit
                       | ao_adamw_fp8 | hf_sgd | hf_adafactor | hf_adamw4bit, or a transformers optim name
optimizer_in_backward  each parameter steps as soon as its gradient is ready
offload_optimizer      optimizer state and step on the CPU (CUDA devices only)
micro_batch_size       examples per forward/backward (None: the whole batch / accumulation)
grad_accum_steps       micro-batches per optimizer step
lora                   off | lora[:rank] | qlora[:rank] (through peft; changes the math)
lora_targets, lora_alpha, lora_dropout, quantize_targets, lora_dtype   LoRA's layers, scale, adapter dropout, QLoRA's 4-bit layers, adapter dtype

Techniques are applied in their declared order (``apply.py``); pairs that cannot work together
raise a ``MemfitError`` naming both fields (each technique's ``conflicts``).

Not a dataclass: its fields are whatever is registered when it is built, so a technique added
at run time (``registry.register``) is a field at once.
"""

from __future__ import annotations

import json

from memfit.errors import MemfitError, shown
from memfit.techniques.registry import fields, techniques

__all__ = ["Recipe", "recipe_from"]

MAX_FILE_BYTES = 64 * 1024  # a recipe file is a dozen short lines
MAX_DEPTH = 8  # nesting levels a recipe file may have (it needs one)


class Recipe:
    """The technique choices of a training step; ``Recipe(precision="bf16-mixed", ...)``.

    Immutable and hashable; equal when every field is equal (a field registered after a recipe
    was built reads as its default).
    """

    __slots__ = ("_values",)

    def __init__(self, **values):
        for technique in techniques():
            if technique.normalize is not None:
                values = technique.normalize(values)
        known = {f.name: f for f in fields()}
        unknown = sorted(shown(k, 30)[1:-1] for k in set(values) - set(known))
        if unknown:
            raise MemfitError(f"unknown recipe field(s) {', '.join(unknown)}: the fields are "
                              f"{', '.join(sorted(known))}")
        full = {name: values.get(name, f.default) for name, f in known.items()}
        object.__setattr__(self, "_values", full)
        for f in known.values():
            _check(f, full[f.name])
        self.conflicts()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        for f in fields():
            if f.name == name:
                return f.default
        raise AttributeError(f"Recipe has no field {name!r}")

    def __setattr__(self, name, value):
        raise AttributeError(f"Recipe is immutable: use recipe.replace({name}=...)")

    def _key(self) -> tuple:
        return tuple((f.name, getattr(self, f.name)) for f in fields())

    def __eq__(self, other):
        return isinstance(other, Recipe) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return "Recipe(" + ", ".join(f"{k}={v!r}" for k, v in self._key()) + ")"

    def __reduce__(self):
        return (_rebuild, (self.to_dict(),))

    # -- what the fields mean -------------------------------------------------------------
    @property
    def is_exact(self) -> bool:
        """False when a technique changes the math: 8-/4-bit optimizer state, LoRA, pure bf16."""
        return not self.approximations

    @property
    def approximations(self) -> list[str]:
        return [entry for t in techniques() for entry in t.approximations(self)]

    def conflicts(self) -> None:
        """Raise for pairs of fields that cannot work together, naming both."""
        for technique in techniques():
            for message in technique.conflicts(self):
                raise MemfitError(message)

    # -- data -----------------------------------------------------------------------------
    def replace(self, **changes) -> "Recipe":
        return Recipe(**{**self.to_dict(), **changes})

    def to_dict(self) -> dict:
        return dict(self._key())

    @classmethod
    def fields(cls) -> list[str]:
        """The field names, in the recipe's order."""
        return [f.name for f in fields()]

    @classmethod
    def from_dict(cls, data: dict) -> "Recipe":
        names = set(cls.fields())
        if not isinstance(data, dict):
            raise MemfitError(f"a recipe is a dict of field: value, got {type(data).__name__}")
        unknown = sorted(shown(k, 30) if not isinstance(k, str) else shown(k, 30)[1:-1] for k in set(data) - names)
        if unknown:
            raise MemfitError(f"unknown recipe field(s) {', '.join(unknown)}: the fields are {', '.join(sorted(names))}")
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
        if not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):  # an int is a file descriptor
            raise MemfitError(f"cannot read recipe {name}: pass the path of a .yaml or .json file, "
                              f"not {type(path).__name__}")
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
                              f"{', '.join(cls.fields())}")
        return cls.from_dict(data)

    def save(self, path: str) -> None:
        """Write the recipe to ``path``: JSON for a ``.json`` name, else YAML."""
        import os

        given = path
        try:
            path = os.fsdecode(path)  # str, bytes or os.PathLike; anything else (None, an int) is refused
        except TypeError:
            path = ""
        if not path.strip():
            raise MemfitError(f"cannot save the recipe to {shown(given)}: pass the path of a .yaml or .json file")
        name = shown(path)
        if os.path.isdir(path):
            raise MemfitError(f"cannot save the recipe to {name}: it is a directory; name a .yaml or .json file in it")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            what = "is a file, not a directory" if os.path.exists(folder) else "does not exist; create it first"
            raise MemfitError(f"cannot save the recipe to {name}: {shown(folder)} {what}")
        text = self.to_json() if path.endswith(".json") else self.to_yaml()
        try:
            with open(path, "w") as f:
                f.write(text)
        except OSError as err:
            raise MemfitError(f"cannot save the recipe to {name}: {err.strerror or err}; choose another path") from None
        except ValueError as err:  # a NUL byte in the path
            raise MemfitError(f"cannot save the recipe to {name}: {err}; pass the path of a .yaml or .json "
                              "file") from None

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


def _rebuild(values: dict) -> Recipe:
    return Recipe(**values)


def _check(field, value) -> None:
    """A field's value against its kind, choices and the technique's own check."""
    if field.kind == "bool" and not isinstance(value, bool) and not (isinstance(value, str) and value in field.choices):
        extra = "".join(f" or {c}" for c in field.choices)
        raise MemfitError(f"{field.name} must be true or false{extra}, got {shown(value)}")
    if field.kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise MemfitError(f"{field.name} must be a number, got {shown(value)}")
    if field.choices and field.kind != "bool" and (not isinstance(value, str) or value not in field.choices):
        raise MemfitError(f"unknown {field.name} {shown(value)}: choose one of {', '.join(field.choices)}")
    if field.check is not None:
        field.check(value)


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
