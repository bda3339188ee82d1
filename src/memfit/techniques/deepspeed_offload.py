"""DeepSpeed's ZeRO-Offload on a trace for a card: which of the engine's tensors are in host memory.

The fake engine runs on DeepSpeed's CPU accelerator (``techniques/deepspeed.py``), where the host's partitions
and the GPU's are one device: DeepSpeed tells them apart only by the device it makes them on (``self.device``,
``'cpu'`` under offload, stage_1_and_2.py:278, stage3.py:333). So the host's are found by the attributes
DeepSpeed 0.19.8 keeps them in, read after the engine is made and after each backward and step (``mark``), and
the client optimizer's step, which runs on the host partitions, is the host's (``hosted_step``): its state and
temporaries. Everything else is the GPU's; ``estimator/trace.py`` replays the two sides apart and reports the
host's peak as ``host_bytes``.

Stage 1/2 with ``offload_optimizer``: the fp32 master partitions and their gradients
(``single_partition_of_fp32_groups``, stage_1_and_2.py:564-577 and :937-941), the bf16/fp16 staging buffer the
step copies through (``param_buffer_of_bit16_for_cpu_offload_groups``), the accumulated gradients
(``accumulated_grads_in_cpu``, :1852) and the copy buffer (``temp_grad_buffer_for_cpu_offload``, :653). Stage 3
with ``offload_optimizer``: ``fp32_partitioned_groups_flat`` and gradients, ``grad_partitions_flat_buffer``
(stage3.py:786-795); with ``offload_param`` also each parameter's partition (``ds_tensor``) and the flat host
copies (``param_groups_fp16_flat_cpu_memory``, ``lp_param_contiguous_pin_buffer``,
``lp_grad_partitions_flat_pin_buffers``).

Which host bytes are pinned: what DeepSpeed hands the accelerator's ``pin_memory`` (``pinning``; each offload
section's ``pin_memory``, true by default). Left out: the GPU's
transient copies of what crosses the host link (the fake ``.to(accelerator)`` of a host tensor is a no-op on
the CPU accelerator), NVMe (refused). Not yet checked on a GPU: the CPU truths hold the two sides' sum.
"""

from __future__ import annotations

__all__ = ["mark", "hosted_step", "held_tensors", "pinning"]

_STAGE_1_2 = ("single_partition_of_fp32_groups", "param_buffer_of_bit16_for_cpu_offload_groups",
              "accumulated_grads_in_cpu", "temp_grad_buffer_for_cpu_offload")
_STAGE_3 = ("fp32_partitioned_groups_flat", "grad_partitions_flat_buffer")
_STAGE_3_PARAMS = ("param_groups_fp16_flat_cpu_memory", "lp_param_contiguous_pin_buffer",
                   "lp_grad_partitions_flat_pin_buffers")


def held_tensors(value) -> list:
    """The tensors an engine's attribute holds: itself, or those of a list, tuple or dict of them, nested."""
    if value is None:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in held_tensors(item)]
    return [value] if hasattr(value, "untyped_storage") else []


def mark(optimizer, model, watch, zero) -> None:
    """Put the offloaded tensors DeepSpeed's ZeRO ``optimizer`` holds now (and ``model``'s parameter partitions with
    ``offload_param``) in ``watch``'s host memory; ``zero``: the recipe's ``ZeroConfig``."""
    if watch is None or not hasattr(watch, "host_tensor"):
        return
    names = []
    if zero.get("offload_optimizer") != "none":
        names += [*_STAGE_1_2, *_STAGE_3]
    if zero.get("offload_param") != "none":
        names += list(_STAGE_3_PARAMS)
        for param in model.parameters():
            for tensor in held_tensors(getattr(param, "ds_tensor", None)):
                watch.host_tensor(tensor)
    for name in names:
        for tensor in held_tensors(getattr(optimizer, name, None)):
            watch.host_tensor(tensor)
            if getattr(tensor, "grad", None) is not None:
                watch.host_tensor(tensor.grad)


def hosted_step(base, watch) -> None:
    """The client optimizer ``base`` steps on the host partitions: its state and temporaries are the host's."""
    if watch is None or not hasattr(watch, "on_host"):
        return
    step = base.step

    def on_host(*args, **kwargs):
        with watch.on_host():
            return step(*args, **kwargs)

    base.step = on_host


def pinning(watch):
    """The accelerator's ``pin_memory`` on a trace for a card: what DeepSpeed pins (its offload sections'
    ``pin_memory``: the host partitions, their gradients, staging buffers) is page-locked host memory there
    (``cudaHostAlloc``, served in powers of two: ``estimator/trace.py``). The CPU accelerator's own is a no-op that
    returns the tensor, and so does this one: on a card the pinned copy replaces a tensor just made."""

    def pin_memory(tensor, *args, **kwargs):
        watch.host_tensor(tensor, pinned=True)
        return tensor

    return pin_memory
