"""Floors: the bytes a published row's stated settings must hold at one moment of its step, whatever the allocator
or the compiler does. A published figure below its row's floor did not come from those settings as stated, so no
exact estimate of them can come within the floor's distance of it; docs/results.md names each such row.

Each floor is a sum of named terms, arithmetic over the model's parameter counts (the row's decoder built on the
meta device) and the batch's shapes: not memfit's trace. Each term is something the step cannot have freed at
that moment. ``tests/test_published_floors.py`` holds each kind against the allocator: the same decoder at smoke
size with the row's recipe, real steps on the CPU (``true_peak``) or real torchrun ranks for FSDP2, must reach it.

Left out on purpose, so that a floor stays below any real run: kernels' temporaries and workspaces, what
attention and the norms save, the batch, anything a compiler may drop, FSDP2's padding of shards to whole rows a
rank, the CUDA allocator's rounding. Written by hand: no library states what a step must hold at a moment.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["FLOORS", "floor", "shape_of"]

BF16 = 2


def _blocks(model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks: its ModuleList with the most parameters."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def _adapters(blocks: nn.ModuleList, rank: int, targets: set[str]) -> int:
    """LoRA's A and B of every targeted linear in the blocks: rank x (in + out) each."""
    return sum(rank * (m.in_features + m.out_features) for name, m in blocks.named_modules()
               if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets)


def shape_of(model: nn.Module, *, lora_rank: int = 0, lora_targets: str = "", head: str = "output") -> dict:
    """The counts a floor reads, from a model built on the meta device: all parameters, one block's, the blocks'
    number, the hidden size, the vocabulary, the head's weight (``head``: its name, None when tied) and the
    LoRA adapters (``lora_rank`` over ``lora_targets``, comma-separated linear names; ``block`` leaves them out)."""
    blocks = _blocks(model)
    one = sum(p.numel() for p in blocks[0].parameters())
    weight = dict(model.named_parameters()).get(f"{head}.weight") if head else None
    embedding = next(m for m in model.modules() if isinstance(m, nn.Embedding))
    adapters = _adapters(blocks, lora_rank, {t for t in lora_targets.split(",") if t}) if lora_rank else 0
    return dict(parameters=sum(p.numel() for p in model.parameters()), block=one,
                blocks=len(blocks), hidden=embedding.embedding_dim, vocab=embedding.num_embeddings,
                head=weight.numel() if weight is not None else 0, adapters=adapters)


def _bnb_resident(model: nn.Module) -> int:
    """bitsandbytes' paged 8-bit AdamW's state that stays in device memory (``optimizer.py``, 0.50.2): each 8-bit
    parameter's two fp32 absmax per 256-value block; the whole state of parameters under 1e5 values
    (``get_state_buffer``), uint8 at 4096 values and up (``min_8bit_size``), fp32 below."""
    total = 0
    for p in model.parameters():
        n = p.numel()
        if n >= 4096:
            total += 2 * math.ceil(n / 256) * 4 + (2 * n if n < 1e5 else 0)
        else:
            total += 2 * n * 4
    return total


def loss_backward(shape: dict, *, rows: int, seq: int, state_bytes: int) -> dict:
    """``loss.backward()`` begins (the recipe has deleted its logits): every weight, the trainable parameters'
    optimizer state, each block's checkpointed input, and the logits the loss keeps for its backward (the
    gradient of a softmax needs every logit: in bf16, the least a compiled or eager cross-entropy keeps)."""
    tokens = rows * seq
    return {"weights": shape["parameters"] * BF16 + shape["adapters"] * BF16, "optimizer state": state_bytes,
            "checkpointed block inputs": shape["blocks"] * tokens * shape["hidden"] * BF16,
            "logits kept by the loss": tokens * shape["vocab"] * BF16}


def head_first_add(shape: dict, *, rows: int, seq: int, state_bytes: int) -> dict:
    """Optimizer in backward, the untied head's weight used once per output chunk: the engine sums its second
    gradient contribution into the first out of place (the first is a transposed view of its product: torch's
    ``can_accumulate_inplace`` refuses it; 1 ``add`` and 6 ``add_`` for 8 chunks under torch 2.5.1 and 2.13
    alike), so three head-sized gradients are alive at once, beside every weight, the optimizer state kept on the
    device and each block's checkpointed input."""
    tokens = rows * seq
    return {"weights": shape["parameters"] * BF16, "optimizer state on the device": state_bytes,
            "checkpointed block inputs": shape["blocks"] * tokens * shape["hidden"] * BF16,
            "head's weight gradients (first add, out of place)": 3 * shape["head"] * BF16}


def fsdp_last_block(shape: dict, *, rows: int, seq: int, world: int, state_bytes: int = 0) -> dict:
    """FSDP2, each block a unit and the rest the root's, LoRA adapters trained: the last block's all-gather has
    been copied out in forward. The rank's shards of every weight, the root's weights (gathered from forward to
    backward: FSDP2 does not reshard the root after forward), the last block's all-gather output and the
    unsharded parameters copied out of it, and each block's input (the blocks before it checkpointed, its own the
    hidden state it is about to take). ``rows`` is the rank's."""
    tokens = rows * seq
    weights = (shape["parameters"] + shape["adapters"]) * BF16
    root = (shape["parameters"] - shape["blocks"] * shape["block"]) * BF16
    block = (shape["block"] + shape["adapters"] // shape["blocks"]) * BF16
    return {"the rank's shards": weights // world, "root gathered": root, "optimizer state": state_bytes,
            "last block's all-gather output and unsharded parameters": 2 * block,
            "block inputs": shape["blocks"] * tokens * shape["hidden"] * BF16}


KINDS = {"loss_backward": loss_backward, "head_first_add": head_first_add, "fsdp_last_block": fsdp_last_block}


def floor(kind: str, shape: dict, **settings) -> tuple[int, dict]:
    """(the floor in bytes, its terms) of ``kind`` (``KINDS``) for ``shape`` (``shape_of``) and the row's
    settings (``rows``, ``seq``, ``world`` for FSDP2, ``state_bytes``)."""
    terms = KINDS[kind](shape, **settings)
    return sum(terms.values()), terms


def _torchtune(name: str) -> nn.Module:
    from bench.published import _torchtune_1814feb as torchtune_1814feb

    with torch.device("meta"):
        return torchtune_1814feb.build(name)


def _row_floor(row: dict) -> tuple[int, dict]:
    """A row of ``FLOORS``'s floor from its own settings (``_rows.py``)."""
    kind = FLOORS[row["id"]]
    model = _torchtune(row["torchtune"])
    recipe = row["recipe"]
    rank = int(recipe["lora"].split(":")[1]) if recipe.get("lora") else 0
    shape = shape_of(model, lora_rank=rank, lora_targets=recipe.get("lora_targets", ""))
    world = row.get("gpus", 1)
    if recipe.get("optimizer") == "paged_adamw8bit":
        state = _bnb_resident(model)
    else:  # AdamW's two moments of what trains, in its dtype (bf16), split over the ranks
        state = 2 * (shape["adapters"] or shape["parameters"]) * BF16 // world
    settings = dict(rows=row["batch_size"], seq=row["seq_len"], state_bytes=state)
    if kind == "fsdp_last_block":
        settings["world"] = world
    return floor(kind, shape, **settings)


# the rows whose published figure lies below what memfit estimates by more than 6 %, and the moment of their step
# whose floor is checked (docs/results.md)
FLOORS = {"tt-8b-full-4090": "head_first_add", "tt-8b-lora-4090": "loss_backward",
          "tt-70b-lora-8xa100": "fsdp_last_block"}


def row_floors(rows: list[dict]) -> dict:
    """Per row of ``FLOORS`` among ``rows``: its floor in bytes, its terms and the moment."""
    return {row["id"]: dict(zip(("bytes", "terms"), _row_floor(row)), moment=FLOORS[row["id"]])
            for row in rows if row["id"] in FLOORS}
