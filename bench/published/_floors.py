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

__all__ = ["FLOORS", "KINDS", "BF16", "floor", "row_floors", "shape_of"]

BF16 = 2


def _blocks(model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks: its ModuleList with the most parameters."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def _adapters(blocks: nn.ModuleList, rank: int, targets: set[str]) -> int:
    """LoRA's A and B of every targeted linear in the blocks: rank x (in + out) each."""
    return sum(rank * (m.in_features + m.out_features) for name, m in blocks.named_modules()
               if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets)


def _nf4(n: int) -> int:
    """torchao's ``NF4Tensor`` of ``n`` weights less its constants: 4-bit codes, an int8 scaler per 64 weights and
    a bf16 factor per 256 scalers (``to_nf4`` of a 1024 x 1024 weight: 0.5158 bytes a weight)."""
    return n // 2 + n // 64 + 2 * (n // (64 * 256))


def shape_of(model: nn.Module, *, lora_rank: int = 0, lora_targets: str = "", head: str = "output") -> dict:
    """The counts a floor reads, from a model built on the meta device: all parameters, one block's, the blocks'
    number, the hidden size, the vocabulary, the head's weight (``head``: its name, None when tied), the
    LoRA adapters (``lora_rank`` over ``lora_targets``, comma-separated linear names; ``block`` leaves them out),
    and for QLoRA the blocks' linear weights (``quantisable``) and their bytes in torchao's NF4 (``nf4_bytes``)."""
    blocks = _blocks(model)
    one = sum(p.numel() for p in blocks[0].parameters())
    weight = dict(model.named_parameters()).get(f"{head}.weight") if head else None
    embedding = next(m for m in model.modules() if isinstance(m, nn.Embedding))
    adapters = _adapters(blocks, lora_rank, {t for t in lora_targets.split(",") if t}) if lora_rank else 0
    linears = [m.weight.numel() for m in blocks.modules() if isinstance(m, nn.Linear)]
    return dict(parameters=sum(p.numel() for p in model.parameters()), block=one,
                quantisable=sum(linears), nf4_bytes=sum(_nf4(n) for n in linears),
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


def _weights(shape: dict, nf4: bool) -> int:
    """Every weight in bf16, the LoRA adapters with them; with ``nf4`` the blocks' linears in torchao's NF4."""
    if nf4:
        return (shape["parameters"] - shape["quantisable"] + shape["adapters"]) * BF16 + shape["nf4_bytes"]
    return (shape["parameters"] + shape["adapters"]) * BF16


def first_chunk_backward(shape: dict, *, rows: int, seq: int, state_bytes: int, chunks: int = 8,
                         offloaded: bool = False, nf4: bool = False) -> dict:
    """The chunked cross-entropy's backward of the first output chunk, the last of the loss's to run: the engine
    runs every chunk's cross-entropy backward before any of the head's (the higher sequence numbers first; tensor
    hooks on each chunk's logits, torch 2.5.1 and 2.13 alike), so the other chunks' logit gradients wait, and the
    first's is written beside the logits it saved (the gradient of a softmax needs every logit, bf16 the least; an
    Inductor graph writes over an input only when AOTAutograd donates it, and a saved forward input never is).
    Beside them every weight, the trainable parameters' optimizer state and, unless offloaded, each block's
    checkpointed input."""
    tokens = rows * seq
    chunk = tokens // chunks * shape["vocab"] * BF16
    return {"weights": _weights(shape, nf4), "optimizer state": state_bytes,
            "checkpointed block inputs": 0 if offloaded else shape["blocks"] * tokens * shape["hidden"] * BF16,
            "the other chunks' logit gradients": (chunks - 1) * chunk,
            "the first chunk's saved logits and their gradient": 2 * chunk}


def head_first_add(shape: dict, *, rows: int, seq: int, state_bytes: int, chunks: int = 8) -> dict:
    """Optimizer in backward, the untied head's weight used once per output chunk: the engine sums its second
    gradient contribution into the first out of place (the first is a transposed view of its product: torch's
    ``can_accumulate_inplace`` refuses it; 1 ``add`` and 6 ``add_`` for 8 chunks under torch 2.5.1 and 2.13
    alike), so three head-sized gradients are alive at once, beside every weight, the optimizer state kept on the
    device, each block's checkpointed input, and the logit gradients of the chunks whose head backward is still to
    come (every chunk's cross-entropy backward runs first: ``first_chunk_backward``; the head's then run from the
    last chunk to the first, two of them done)."""
    tokens = rows * seq
    return {"weights": shape["parameters"] * BF16, "optimizer state on the device": state_bytes,
            "checkpointed block inputs": shape["blocks"] * tokens * shape["hidden"] * BF16,
            "head's weight gradients (first add, out of place)": 3 * shape["head"] * BF16,
            "logit gradients still to come": (chunks - 2) * (tokens // chunks) * shape["vocab"] * BF16}


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


KINDS = {"first_chunk_backward": first_chunk_backward, "head_first_add": head_first_add,
         "fsdp_last_block": fsdp_last_block}


def floor(kind: str, shape: dict, **settings) -> tuple[int, dict]:
    """(the floor in bytes, its terms) of ``kind`` (``KINDS``) for ``shape`` (``shape_of``) and the row's
    settings (``rows``, ``seq``, ``state_bytes``; ``world`` for FSDP2, ``chunks``, ``offloaded``, ``nf4``)."""
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
    else:
        settings["chunks"] = row["loss"]["chunks"]
    if kind == "first_chunk_backward":
        settings.update(offloaded=bool(recipe.get("offload_activations")), nf4=recipe.get("quant_impl") == "torchao")
    return floor(kind, shape, **settings)


# the rows whose published figure lies below what memfit estimates by more than 6 %, and the moment of their step
# whose floor is checked (docs/results.md)
FLOORS = {"tt-8b-full-4090": "head_first_add", "tt-8b-lora-4090": "first_chunk_backward",
          "tt-70b-lora-8xa100": "fsdp_last_block", "tt-3b-qlora": "first_chunk_backward"}


def row_floors(rows: list[dict]) -> dict:
    """Per row of ``FLOORS`` among ``rows``: its floor in bytes, its terms and the moment."""
    return {row["id"]: dict(zip(("bytes", "terms"), _row_floor(row)), moment=FLOORS[row["id"]])
            for row in rows if row["id"] in FLOORS}
