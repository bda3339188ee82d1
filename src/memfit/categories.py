"""The one vocabulary of memory categories.

Every byte a training step holds belongs to exactly one of these. The estimator, the measurer,
the reports and the tests all speak this Enum and nothing else, so a number in a table can always
be traced back to the rule that put it there.
"""

from __future__ import annotations

import enum

__all__ = ["Category", "PHASES", "GENERATE_PHASES", "ALL_PHASES"]

#: The phases of one optimizer step, in order.
PHASES = ("forward", "backward", "optimizer")
#: The phases of a generation (``memfit.generation``): the prompt's forward, then one forward per new token.
GENERATE_PHASES = ("prefill", "decode")
#: Every phase a report can name, in the order tables show them.
ALL_PHASES = PHASES + GENERATE_PHASES


class Category(str, enum.Enum):
    """Where a live tensor storage belongs.

    PARAMETERS       storages of the model's parameters (trainable or frozen).
    BUFFERS          storages of registered buffers (BatchNorm running stats, rotary tables).
    GRADIENTS        storages that hold a parameter's ``.grad`` at some point of the step.
    OPTIMIZER_STATE  storages held in ``optimizer.state`` (Adam moments, momentum, step counters).
    ACTIVATIONS      storages saved by autograd for the backward pass.
    TEMPORARIES      everything else the step allocates: intermediate results that are not saved,
                     gradients of activations, optimizer scratch, and kernel-internal scratch.
    BATCH            the input batch handed to the step.

    Data-parallel steps (``techniques/parallel.py``) add three:
    UNSHARDED_PARAMETERS   FSDP2's gathered (full) parameters of the units computing or prefetched;
                           ``parameters`` are then the rank's shards.
    UNSHARDED_GRADIENTS    gradients of gathered parameters, before their reduce-scatter;
                           ``gradients`` are then the rank's sharded gradients.
    COMMUNICATION          collective buffers: FSDP2's all-gather and reduce-scatter buffers, DDP's
                           gradient buckets.

    A generation (``memfit.generation``: Hugging Face ``generate``, prefill then decode) adds one:
    KV_CACHE               the key/value cache: every tensor the cache object of ``generate`` holds (keys and
                           values, quantised states and their scales, static buffers, an encoder-decoder
                           model's cross-attention states).
    """

    PARAMETERS = "parameters"
    BUFFERS = "buffers"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"
    TEMPORARIES = "temporaries"
    BATCH = "batch"
    UNSHARDED_PARAMETERS = "unsharded_parameters"
    UNSHARDED_GRADIENTS = "unsharded_gradients"
    COMMUNICATION = "communication"
    KV_CACHE = "kv_cache"

    def __str__(self) -> str:  # "optimizer_state" reads better than "Category.OPTIMIZER_STATE"
        return self.value


# When a storage is seen in two roles, the stronger role names it: a saved weight stays a
# parameter, a gradient that autograd also saved stays a gradient.
PRIORITY = {
    Category.PARAMETERS: 7,
    Category.UNSHARDED_PARAMETERS: 6.5,
    Category.BUFFERS: 6,
    Category.BATCH: 5,
    Category.GRADIENTS: 4,
    Category.UNSHARDED_GRADIENTS: 3.8,
    Category.COMMUNICATION: 3.6,
    Category.OPTIMIZER_STATE: 3,
    Category.KV_CACHE: 2.5,
    Category.ACTIVATIONS: 2,
    Category.TEMPORARIES: 0,
}
