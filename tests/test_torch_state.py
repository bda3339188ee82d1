"""An estimate leaves torch as it found it: every patch memfit makes is undone when the trace ends.

memfit changes torch only inside context managers (``memfit/scoped.py``): module attributes it
patches, dispatcher kernels it registers for CUDA semantics, global module hooks, dispatch modes,
logging, environment variables. This snapshots everything observable before a set of estimates
that enter each of them (CPU and CUDA semantics, checkpointing, LoRA and QLoRA, bf16-mixed, a
chunked loss, offload, a mixture of experts, a Mamba scan) and checks it is identical after.
"""

import json
import logging
import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

import memfit
from memfit.hardware.cuda import FP32_OPS, FP32_SET_OPT_DTYPE_OPS, cpu_only_autocast_ops
from memfit.models.source import resolve

_LM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)

# Namespaces whose attributes memfit patches (or could): each name's object must be the same after.
_NAMESPACES = ("torch", "torch.nn.functional", "torch.Tensor", "torch.nn.Module", "torch.autograd",
               "torch.autograd.graph", "torch.utils.checkpoint", "torch.optim", "torch.amp",
               "torch.amp.autocast_mode", "transformers.models.mamba.modeling_mamba",
               "transformers.integrations.sdpa_attention", "transformers.modeling_utils")
# Attributes memfit patches while a trace runs (grep ``patched(`` in src): checked by name too.
PATCHED = [("torch", "get_rng_state"), ("torch.nn.functional", "scaled_dot_product_attention"),
           ("torch.nn.Module", "to"), ("transformers.models.mamba.modeling_mamba", "mamba_selective_scan"),
           ("transformers.utils.import_utils", "is_fake_tensor")]
_KEYS = ("AutocastCPU", "AutocastCUDA", "CompositeImplicitAutograd", "CPU", "Meta")


def _resolve(path):
    import importlib

    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def _ops() -> list[str]:
    """The aten ops memfit registers kernels for (``hardware/cuda.py``), qualified."""
    names = [*FP32_OPS, *FP32_SET_OPT_DTYPE_OPS, "dropout", "native_dropout", "_grouped_mm",
             "scaled_dot_product_attention"]
    out = []
    for name in names:
        op, _, overload = name.partition(".")
        out.append(f"aten::{op}" + (f".{overload}" if overload else ""))
    return out + cpu_only_autocast_ops()


def _dispatcher() -> dict:
    state = {}
    for op in _ops():
        try:
            state[op] = torch._C._dispatch_dump(op)
        except RuntimeError:  # an op this torch does not have
            continue
        for key in _KEYS:
            state[(op, key)] = torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
    for key in _KEYS:
        state[key] = sorted(torch._C._dispatch_get_registrations_for_dispatch_key(key))
    return state


def _loggers() -> dict:
    out = {"": (logging.root.level, logging.root.disabled, len(logging.root.handlers))}
    for name, log in logging.root.manager.loggerDict.items():
        if isinstance(log, logging.Logger):
            out[name] = (log.level, log.disabled, len(log.handlers), log.propagate)
    return out


def snapshot() -> dict:
    attrs = {}
    for path in _NAMESPACES:
        try:
            owner = _resolve(path)
        except (ImportError, AttributeError):
            continue
        attrs[path] = dict(vars(owner))
    hooks = torch.nn.modules.module
    return {
        "attrs": attrs,
        "patched": {(path, name): getattr(_resolve(path), name) for path, name in PATCHED},
        "dispatcher": _dispatcher(),
        "autocast": {(device, what): getattr(torch, what)(device) for device in ("cpu", "cuda")
                     for what in ("is_autocast_enabled", "get_autocast_dtype")}
                    | {"cache": torch.is_autocast_cache_enabled()},
        "environ": dict(os.environ),
        "default_dtype": torch.get_default_dtype(),
        "grad": (torch.is_grad_enabled(), torch.is_inference_mode_enabled()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "threads": torch.get_num_threads(),
        "loggers": _loggers(),
        "warnings": list(warnings.filters),
        "module_hooks": (dict(hooks._global_forward_pre_hooks), dict(hooks._global_forward_hooks),
                         dict(hooks._global_backward_hooks), dict(hooks._global_backward_pre_hooks),
                         dict(hooks._global_forward_hooks_always_called)),
        "modes": (torch._C._len_torch_dispatch_stack(), torch._C._is_torch_function_mode_enabled()),
        "saved_tensors_hooks": torch._C._autograd._top_saved_tensors_default_hooks(False),
        "fake_mode": torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE),
        "sdp": (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.math_sdp_enabled()),
    }


def _differences(before: dict, after: dict) -> list[str]:
    out = []
    for key, value in before.items():
        if key == "attrs":
            for path, names in value.items():
                now = after["attrs"].get(path, {})
                out += [f"{path}.{name}" for name, obj in names.items() if now.get(name, obj) is not obj]
                out += [f"{path}.{name} (added)" for name in now.keys() - names.keys()
                        if not name.startswith("__") and not isinstance(now[name], type(sys))]
        elif key == "patched":
            out += [f"{path}.{name}" for (path, name), obj in value.items() if after[key][(path, name)] is not obj]
        elif key == "loggers":  # loggers made since (getLogger on first use) are not memfit's
            out += [f"logger {name!r}" for name, state in value.items() if after[key].get(name) != state]
        elif key == "dispatcher":
            out += [f"dispatcher {entry}" for entry, state in value.items() if after[key].get(entry) != state]
        elif after[key] != value:
            out.append(key)
    return out


def _llama():
    return tf.LlamaForCausalLM(tf.LlamaConfig(**_LM))


def _tokens():
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _config(tmp_path, name, **config):
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(config))
    return resolve(str(tmp_path / name / "config.json"))


def _estimates(tmp_path):
    """Estimates that between them enter every patch memfit makes."""
    memfit.estimate(_llama, _tokens())
    memfit.estimate(_llama, _tokens(), device="cuda", gpu="rtx-4090", precision="bf16-mixed")
    memfit.estimate(_llama, _tokens(), recipe=memfit.Recipe(checkpointing="blocks", chunked_loss=4))
    memfit.estimate(_llama, _tokens(), gpu="rtx-4090", recipe=memfit.Recipe(lora="lora:8", precision="bf16-mixed",
                                                                             offload_activations=True))
    pytest.importorskip("bitsandbytes")
    memfit.estimate(_llama, _tokens(), recipe=memfit.Recipe(lora="qlora:8", precision="bf16-mixed"))
    # a generation: transformers' is_fake_tensor, the prompt's known values, int8 weights' outlier rule
    memfit.estimate(_llama, workload="generate", prompt_len=8, new_tokens=3, batch_size=2, padding=True,
                    weights="int8")
    moe = _config(tmp_path, "mixtral", model_type="mixtral", architectures=["MixtralForCausalLM"],
                  num_local_experts=4, num_experts_per_tok=2, **_LM)
    memfit.estimate(moe.build, moe.make_batch(2, 16), precision="bf16-mixed", gpu="rtx-4090")
    mamba = _config(tmp_path, "mamba", model_type="mamba", architectures=["MambaForCausalLM"], hidden_size=64,
                    num_hidden_layers=2, vocab_size=256, state_size=8)
    memfit.estimate(mamba.build, mamba.make_batch(2, 16))
    # DeepSpeed's engine (stage 3 puts its own torch.nn.functional.linear in place for the rest of a real run)
    pytest.importorskip("deepspeed")
    memfit.estimate(_llama, _tokens(), recipe=memfit.Recipe(parallel="zero3", precision="bf16"), gpus=2,
                    device="cpu")


def _failing_estimate():
    """An estimate that fails inside the trace, after a forward: patches are undone then too."""
    def loss(model, batch):
        model(**batch)
        raise ValueError("a loss that fails")

    with pytest.raises(memfit.MemfitError, match="a loss that fails"):
        memfit.estimate(_llama, _tokens(), loss_fn=loss, device="cuda", precision="bf16-mixed")


def test_an_estimate_leaves_torch_as_it_found_it(tmp_path, monkeypatch):
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)  # conftest sets it; memfit sets it only while probing
    # third-party imports register their own ops, warnings filters and loggers on first use: not memfit's
    for name in ("bitsandbytes", "peft", "deepspeed", "transformers.models.mamba.modeling_mamba",
                 "transformers.models.mixtral.modeling_mixtral"):
        try:
            __import__(name)
        except ImportError:
            pass
    _llama()(**_tokens())
    F.scaled_dot_product_attention  # noqa: B018
    before = snapshot()
    _estimates(tmp_path)
    _failing_estimate()
    changed = _differences(before, snapshot())
    assert changed == [], changed


def test_the_snapshot_sees_a_leaked_patch(tmp_path):
    """The check above is not vacuous: a patch left in place, a kernel left registered, a module hook,
    a logger or an environment variable left set all show."""
    from memfit.scoped import patched

    before = snapshot()
    with patched(F, "scaled_dot_product_attention", lambda *a, **k: None):
        assert _differences(before, snapshot()) == ["torch.nn.functional.scaled_dot_product_attention",
                                                    "torch.nn.functional.scaled_dot_product_attention"]
    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("exp", lambda x: x, "AutocastCPU")
        assert "dispatcher aten::exp" in _differences(before, snapshot())
    finally:
        lib._destroy()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert _differences(before, snapshot()) == ["module_hooks"]
    finally:
        handle.remove()
    os.environ["MEMFIT_TEST_LEAK"] = "1"
    try:
        assert _differences(before, snapshot()) == ["environ"]
    finally:
        del os.environ["MEMFIT_TEST_LEAK"]
    assert _differences(before, snapshot()) == []
