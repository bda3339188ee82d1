"""What a script reads and writes, kept off the user's disk and the network while memfit runs it.

* **Weights are never read.** ``from_pretrained`` of a transformers model builds the model from its
  config alone (``_from_config``, under the fake tensors the script runs on): a local folder's
  ``config.json``, a catalog model by its Hub id (``models/catalog.py``), else the Hub's ``config.json``
  only (``models/hub.py``: the cache first, one line when it cannot be had). ``torch.load`` of a
  checkpoint maps it onto the meta device (``mmap``: nothing read into RAM) and gives fake tensors of
  its shapes and dtypes.
* **Nothing is written** from the run's tensors: ``torch.save``, ``save_pretrained`` (transformers, peft),
  safetensors' ``save_file`` / ``save_model`` and ``torch.distributed.checkpoint.save`` are skipped; each
  skipped path is listed (``Files.skipped``) and the report says so. A real save would copy the state to
  the host: its host memory is not the card's, and a save's own device-side temporaries are left out.
* **Offline:** ``WANDB_MODE=disabled``, ``HF_HUB_OFFLINE=1`` and ``HF_HUB_DISABLE_TELEMETRY=1`` unless the
  user set them; a Hub upload (``push_to_hub``) is skipped like a save.

Left out: diffusers' ``from_pretrained`` (its models are built by their own loaders), tokenizers and
datasets (real host-side files the script reads itself: they must be on this machine), other loggers'
network traffic (TensorBoard writes local files and is left alone).
"""

from __future__ import annotations

import contextlib
import os

import torch

from memfit.errors import MemfitError
from memfit.scoped import environ, patched

__all__ = ["Files"]


class Files:
    """While active, saves are skipped and pretrained weights are built from configs; ``skipped`` lists
    what would have been written (path, by which call), ``built`` the models made from configs."""

    def __init__(self, mode):
        self.mode = mode  # the run's FakeTensorMode: loaded tensors become its fake tensors
        self.skipped: list[tuple[str, str]] = []
        self.built: list[str] = []
        self._scope = None

    def __enter__(self) -> "Files":
        with contextlib.ExitStack() as scope:
            for name, value in (("WANDB_MODE", "disabled"), ("HF_HUB_OFFLINE", "1"),
                                ("HF_HUB_DISABLE_TELEMETRY", "1")):
                scope.enter_context(environ(name, value))
            scope.enter_context(patched(torch, "save", self._skip("torch.save")))
            scope.enter_context(patched(torch, "load", self._load))
            self._patch_libraries(scope)
            self._scope = scope.pop_all()
        return self

    def __exit__(self, *exc):
        self._scope.close()
        return False

    def _skip(self, call: str, position: int = 1):
        def skipped(*args, **kwargs):
            where = args[position] if len(args) > position else next(
                (kwargs[k] for k in ("f", "filename", "save_directory", "checkpoint_id", "path") if k in kwargs), "?")
            self.skipped.append((str(where) if isinstance(where, (str, os.PathLike)) else type(where).__name__, call))
            return None
        return skipped

    def _load(self, f, map_location=None, *args, **kwargs):
        """A checkpoint's tensors as fake tensors of their shapes, read from no storage."""
        kwargs.pop("mmap", None)
        loaded = _REAL_LOAD(f, *args, map_location="meta", mmap=isinstance(f, (str, os.PathLike)), **kwargs)
        converter = self.mode.fake_tensor_converter

        def fake(value):
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                out = converter.from_meta_and_device(self.mode, value, torch.device("cpu"))
                return torch.nn.Parameter(out, requires_grad=value.requires_grad) \
                    if isinstance(value, torch.nn.Parameter) else out
            return value

        return torch.utils._pytree.tree_map(fake, loaded)

    def _patch_libraries(self, scope) -> None:
        """Patch the libraries the script imported before the run (``estimate.preload``); others are not loaded."""
        import sys

        transformers = sys.modules.get("transformers")
        if transformers is not None:
            model = transformers.PreTrainedModel
            scope.enter_context(patched(model, "from_pretrained", classmethod(_from_config(self))))
            scope.enter_context(patched(model, "save_pretrained", self._skip("save_pretrained")))
            scope.enter_context(patched(model, "push_to_hub", self._skip("push_to_hub")))
        if "peft" in sys.modules:
            import peft

            scope.enter_context(patched(peft.PeftModel, "save_pretrained", self._skip("save_pretrained")))
        if "safetensors.torch" in sys.modules:
            import safetensors.torch as st

            scope.enter_context(patched(st, "save_file", self._skip("safetensors save_file")))
            scope.enter_context(patched(st, "save_model", self._skip("safetensors save_model")))
        with contextlib.suppress(ImportError):
            import torch.distributed.checkpoint as dcp

            scope.enter_context(patched(dcp, "save", self._skip("torch.distributed.checkpoint.save")))


_REAL_LOAD = torch.load


def _config(name, kwargs):
    """The config of ``name`` as from_pretrained would read it, without its weights."""
    from transformers import AutoConfig

    trust = bool(kwargs.get("trust_remote_code", False))
    path = os.fspath(name)
    if os.path.isdir(path) or os.path.isfile(path):
        return AutoConfig.from_pretrained(path, trust_remote_code=trust)
    from memfit.models.catalog import by_source

    found = by_source(path)
    if found is not None:
        return AutoConfig.for_model(found[1].model_type, **found[1].config)
    from memfit.models.hub import hub_config_file, is_hub_id

    if not is_hub_id(path):
        raise MemfitError(f"from_pretrained({path!r}): no such folder here, and not a Hub id (owner/name): "
                          "give the script a folder with its config.json")
    return AutoConfig.from_pretrained(os.path.dirname(hub_config_file(path, kwargs.get("revision"))),
                                      trust_remote_code=trust)


def _auto_by_default() -> bool:
    """Whether this transformers' ``from_pretrained`` takes ``dtype="auto"`` when none is given (5 and later)."""
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5


def _from_config(files: Files):
    def from_pretrained(cls, name, *args, **kwargs):
        config = kwargs.pop("config", None)
        if config is None or isinstance(config, (str, os.PathLike)):
            config = _config(config or name, kwargs)
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if dtype is None and _auto_by_default():
            dtype = "auto"  # transformers 5's default: the config's dtype
        if dtype == "auto":  # the config's own (no weights to read one from: else torch's default)
            dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        options = {"dtype": dtype} if isinstance(dtype, torch.dtype) else {}
        for key in ("attn_implementation",):
            if key in kwargs:
                options[key] = kwargs[key]
        files.built.append(str(name))
        model = cls._from_config(config, **options)
        model.eval()  # as from_pretrained leaves it
        device_map = kwargs.get("device_map")
        if device_map not in (None, "cpu"):
            target = device_map if isinstance(device_map, (str, torch.device, int)) else None
            if target is None or str(target) in ("auto", "balanced", "sequential", "balanced_low_0"):
                target = "cuda"
            model = model.to(target)
        return model
    return from_pretrained
