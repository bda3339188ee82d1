"""The Recipe's flags and ``plan --allow``'s names, written out so that a verb's ``--help`` does not
import torch (the techniques' modules do: about a second on its own).

Generated from the techniques' declarations (``memfit.techniques.registry.fields()``) by
``python -m memfit.cli._recipe_flags``; tests/test_cli_conventions.py keeps the two equal. A technique
registered at run time (a plug-in) gets its flag from the live registry instead (``_args.recipe_flags``).
"""

from __future__ import annotations

__all__ = ["FLAGS", "CLI", "ALLOWABLE", "row", "render"]

# (field name, kind, the choices argparse offers, help), in the Recipe's order
FLAGS = (
    ('precision', 'str', ('fp32', 'bf16-mixed', 'fp16-mixed', 'bf16', 'fp16'),
     'default fp32; bf16-mixed halves most activations'),
    ('checkpointing', 'str', (),
     'off | blocks | blocks:N | selective | modules:a,b (recompute in backward)'),
    ('offload_activations', 'bool', (),
     'keep saved activations in host memory'),
    ('attention', 'str', ('auto', 'sdpa', 'eager'),
     'auto (as built) | sdpa | eager'),
    ('chunked_loss', 'int', (),
     'run the LM head + loss in N sequence chunks (0: off)'),
    ('compile', 'bool', ('layers',),
     "torch.compile (Inductor): true: loss_fn (forward and loss) as one graph; layers: each block and the loss on their own (torchtune); fused kernels, the partitioner's saved set; costs compile time"),
    ('activation_memory_budget', 'float', (),
     "compile only: fraction (0, 1] of the partitioner's saved bytes to keep (lower recomputes more in backward)"),
    ('optimizer', 'str', (),
     'one of adamw, adam, sgd, adafactor, hf_sgd, hf_adafactor, adamw8bit, paged_adamw8bit, ao_adamw8bit, adamw4bit, hf_adamw4bit, ao_adamw_fp8 (default adamw; 8/4-bit change the math), or a transformers optim name (adamw_torch_fused, ...)'),
    ('optimizer_impl', 'str', ('auto', 'foreach', 'fused', 'forloop'),
     "auto (torch's default on the device) | foreach | fused (no step temporaries) | forloop"),
    ('safe_step', 'optional-count', (),
     "step the optimizer in this many chunks, each rolled back on out-of-memory (memfit train uses 8); lowers the step's peak"),
    ('optimizer_in_backward', 'bool', (),
     'step each parameter as its gradient is ready'),
    ('offload_optimizer', 'bool', (),
     'optimizer state and step on the CPU (CUDA only)'),
    ('offload_gradients', 'bool', (),
     "with offload_optimizer: each gradient freed on the GPU once copied to the host (torchao's; no accumulation)"),
    ('micro_batch_size', 'optional-count', (),
     'examples per forward/backward'),
    ('grad_accum_steps', 'count', (),
     'micro-batches per optimizer step'),
    ('set_to_none', 'bool', (),
     'free gradients after each step (default); false zeroes them in place and keeps them through the next forward'),
    ('lora', 'str', (),
     'off | lora[:rank] | qlora[:rank] (changes the math)'),
    ('lora_targets', 'str', (),
     'layers LoRA adapts: all-linear (all but the output head) or name suffixes such as q_proj,v_proj (add lm_head for the head)'),
    ('lora_alpha', 'optional-count', (),
     'LoRA alpha: adapters scale by alpha / rank (default 2 x rank; no memory effect)'),
    ('lora_dropout', 'float', (),
     "dropout on each adapter's input (peft): a saved mask and input copy per adapted layer"),
    ('quantize_targets', 'str', (),
     "layers QLoRA makes 4-bit: all-linear (all but the heads), adapted (only LoRA's layers, as torchtune) or name suffixes"),
    ('lora_dtype', 'str', ('fp32', 'bf16'),
     "adapter weights' dtype: fp32 (peft's default) or bf16 (torchtune's; with precision=bf16): halves the adapters, their gradients and optimizer state"),
    ('quant_impl', 'str', ('bnb', 'torchao'),
     "whose NF4 QLoRA runs: bnb (bitsandbytes' Linear4bit) or torchao (NF4Tensor, torchtune's; eager dequantisation holds int64 indices)"),
    ('parallel', 'str', ('none', 'ddp', 'fsdp', 'zero1', 'zero2', 'zero3'),
     "none | ddp | fsdp | zero1-3: data parallelism over --gpus (FSDP2 shards parameters, gradients and optimizer state 1/N per rank; zeroN: DeepSpeed's ZeRO stage N)"),
    ('reshard_after_forward', 'str', (),
     'fsdp: true frees gathered parameters after forward (ZeRO-3), false keeps them to backward (ZeRO-2: more memory, one all-gather less), N: regather in groups of N'),
    ('mixed_precision', 'str', (),
     'fsdp: FSDP2 MixedPrecisionPolicy, compute[:reduce] dtype (bf16, bf16:fp32): gathered parameters and gradients in it, shards stay fp32'),
    ('sync_grads', 'str', ('last', 'every'),
     'with accumulation: reduce gradients on the last micro-batch only (no_sync; fsdp keeps unsharded gradients meanwhile) or every one'),
    ('offload', 'str', ('none', 'cpu', 'cpu-unpinned'),
     "fsdp: FSDP2 CPUOffloadPolicy: shards, their gradients and the optimizer step on the host (cpu: pinned, FSDP2's default; cpu-unpinned); host RAM and the host link pay"),
    ('shard_over', 'str', ('node', 'world'),
     'fsdp over several nodes: node shards within a node and replicates between (HSDP, the default); world shards over every rank (less memory, all-gathers cross the network)'),
    ('construction', 'str', ('meta', 'host', 'device'),
     "fsdp: how the model was built before sharding: meta (torchtitan: never whole), host (whole in each rank's host RAM, then sharded) or device (whole on the GPU, then sharded: its peak counts)"),
    ('shard_modules', 'str', (),
     "fsdp: modules wrapped as FSDP2 units of their own besides the blocks, by name (torchtune's custom_sharded_layers: tok_embeddings,output): gathered only while they run, not kept with the root"),
    ('tp', 'int', (),
     "tensor parallel degree: the model's own plan (colwise / rowwise linears) over N GPUs of a node, each holding 1/N of those weights and their heads' activations; the other GPUs are data parallel (parallel=fsdp shards over them)"),
    ('sequence_parallel', 'bool', (),
     "with tp: the residual stream between the blocks sharded over the sequence (torch's SequenceParallel norms, as torchtitan applies it): its activations 1/tp per rank; each block all-gathers its input and reduce-scatters its output"),
    ('loss_parallel', 'bool', (),
     "with tp: the head's logits stay sharded over the vocabulary and the cross-entropy runs on the shards (torch's loss_parallel): no rank holds the whole logits"),
    ('pp', 'int', (),
     "pipeline parallel degree: the model's blocks cut into N stages, one per GPU (torch.distributed.pipelining); each rank holds its stage and the activations of the micro-batches in flight (grad_accum_steps micro-batches a step)"),
    ('pp_schedule', 'str', ('gpipe', '1f1b', 'interleaved-1f1b'),
     "with pp: gpipe (every forward, then every backward: all micro-batches' activations live), 1f1b (backward starts once the pipeline is full: stage i of N holds N - i) or interleaved-1f1b (two stages a rank, looped: a smaller bubble)"),
    ('ep', 'int', (),
     "expert parallel degree: each MoE layer's experts split over N ranks of an FSDP2 group (transformers' expert plan), tokens sent to their experts' rank by all-to-all; the dense blocks stay FSDP2-sharded over the whole group (parallel=fsdp)"),
    ('cp', 'int', (),
     "context parallel degree: each row's sequence split over N ranks of an FSDP2 group (torch's context_parallel, load-balanced), attention run as a ring over them; they read the same rows (parallel=fsdp, attention=sdpa)"),
    ('cp_rotate', 'str', ('allgather', 'alltoall'),
     "with cp: how each layer's keys and values reach the other ranks: allgather (once, whole: torchtitan's default) or alltoall (passed round the ring, one chunk at a time)"),
    ('zero', 'str', (),
     "parallel=zero1-3: DeepSpeed's zero_optimization keys, key=value,... as its ds_config names them (reduce_bucket_size=5e7, overlap_comm=true, offload_optimizer=cpu, stage3_prefetch_bucket_size=...); empty: DeepSpeed's defaults (a 5e8-element gradient bucket)"),
    ('float8', 'str', ('off', 'tensorwise', 'rowwise'),
     'torchao float8 training: every linear but the head multiplies float8 copies of its operands (tensorwise or rowwise scales); changes the math: allowed by name'),
)

# The CLI's words for each field, written by hand (the declaration's help above is the long form: the UI shows
# it, docs/recipes.md says more): the section of --help it sits in (a key of ``_args.SECTIONS``) and its help,
# one line under 100 characters with the default and, where the flag trades memory for speed, what that costs.
# A field without a line here (a plug-in's) sits under "precision" with its declaration's help.
CLI = {
    # precision and memory techniques
    "precision": ("precision", "fp32 (default) | bf16-mixed | fp16-mixed | bf16 (weights too): 16 bits halve activations"),
    "checkpointing": ("precision", "off (default) | blocks[:N] | selective | modules:a,b: recompute in backward, "
                                   "~30%% slower step"),
    "offload_activations": ("precision", "saved activations in host memory until backward (default off); "
                                         "slower: host copies"),
    "attention": ("precision", "auto (default: as the model is built) | sdpa (no seq x seq scores) | eager"),
    "chunked_loss": ("precision", "LM head + loss in N sequence chunks: no whole logits (default 0: off); "
                                  "a little slower"),
    "compile": ("precision", "torch.compile: true (model + loss, one graph) | layers (per block) (default off); "
                             "compile time"),
    "activation_memory_budget": ("precision", "with --compile: share (0, 1] of saved bytes kept (default 1); "
                                              "lower recomputes more"),
    "float8": ("precision", "off (default) | tensorwise | rowwise: torchao float8 linears (changes the math)"),
    # optimizer
    "optimizer": ("optimizer", "adamw (default), sgd, adafactor, adamw8bit, ... or a transformers optim name; "
                               "8/4-bit change math"),
    "optimizer_impl": ("optimizer", "auto (default: torch's) | foreach | fused (no step temporaries) | forloop"),
    "safe_step": ("optimizer", "step in N chunks, each undone on OOM (default off; train: 8): lower step peak, "
                               "slower step"),
    "optimizer_in_backward": ("optimizer", "step each parameter as its gradient is ready: no whole set of "
                                           "gradients (default off)"),
    "offload_optimizer": ("optimizer", "optimizer state and step on the CPU (default off; CUDA only): "
                                       "a slower, host-bound step"),
    "offload_gradients": ("optimizer", "with --offload-optimizer: each gradient freed on the GPU once copied "
                                       "(default off; no accumulation)"),
    "set_to_none": ("optimizer", "free gradients after each step (default); --no-set-to-none zeroes them, "
                                 "kept to next forward"),
    # batch and sequence
    "micro_batch_size": ("batch", "examples per forward/backward (default: the step's examples / --grad-accum-steps)"),
    "grad_accum_steps": ("batch", "micro-batches per optimizer step (default 1): one micro-batch's "
                                  "activations, more passes"),
    # LoRA and quantized weights
    "lora": ("lora", "off (default) | lora[:RANK] | qlora[:RANK] | RANK (lora:RANK); rank 16 if unset; "
                     "changes the math"),
    "lora_targets": ("lora", "layers LoRA adapts: all-linear (default, not the head) or suffixes: "
                             "q_proj,v_proj[,lm_head]"),
    "lora_alpha": ("lora", "adapters scale by alpha / rank (default 2 x rank); no memory effect"),
    "lora_dropout": ("lora", "dropout on each adapter's input (default 0): a mask and input copy per "
                             "adapted layer"),
    "quantize_targets": ("lora", "layers QLoRA makes 4-bit: all-linear (default), adapted (LoRA's layers) "
                                 "or name suffixes"),
    "lora_dtype": ("lora", "adapter weights: fp32 (default, peft's) | bf16 (torchtune's; with --precision bf16): "
                           "half"),
    "quant_impl": ("lora", "whose NF4 qlora runs: bnb (default, bitsandbytes) | torchao (torchtune's; shards "
                           "under fsdp)"),
    # many GPUs and meshes
    "parallel": ("parallel", "none (default) | ddp | fsdp | zero1-3 (DeepSpeed) over --gpus: fsdp shards "
                             "all 1/N"),
    "reshard_after_forward": ("parallel", "fsdp: true (default, ZeRO-3) | false (ZeRO-2: more memory, one "
                                          "all-gather less) | N"),
    "mixed_precision": ("parallel", "fsdp: none (default) | bf16[:fp32]: gathered weights and grads in it, "
                                    "shards stay fp32"),
    "sync_grads": ("parallel", "with accumulation: reduce grads on the last micro-batch (default) | every one"),
    "offload": ("parallel", "fsdp: none (default) | cpu | cpu-unpinned: shards and step on the host; "
                            "slower, host RAM"),
    "shard_modules": ("parallel", "fsdp: modules made units of their own, e.g. tok_embeddings,output "
                                  "(default: blocks only)"),
    "shard_over": ("parallel", "fsdp on nodes: node (default, HSDP) | world (less memory, all-gathers "
                               "cross the network)"),
    "construction": ("parallel", "fsdp: model built on meta (default) | host | device (whole on the GPU "
                                 "first: counts)"),
    "tp": ("parallel", "tensor parallel degree within a node (default 1): 1/N of the split weights per GPU"),
    "sequence_parallel": ("parallel", "with --tp: residual stream sharded over the sequence (default off); "
                                      "more collectives"),
    "loss_parallel": ("parallel", "with --tp: logits stay sharded over the vocabulary for the loss "
                                  "(default off)"),
    "pp": ("parallel", "pipeline parallel degree: blocks cut into N stages, one per GPU (default 1)"),
    "pp_schedule": ("parallel", "with --pp: gpipe | 1f1b (default) | interleaved-1f1b: in-flight "
                                "micro-batches' activations"),
    "ep": ("parallel", "expert parallel degree: MoE experts split over N ranks of the fsdp group "
                       "(default 1)"),
    "cp": ("parallel", "context parallel degree: each row's sequence split over N ranks, ring attention "
                       "(default 1)"),
    "cp_rotate": ("parallel", "with --cp: allgather (default: keys and values once, whole) | alltoall "
                              "(a chunk at a time)"),
    "zero": ("parallel", "with zero1-3: DeepSpeed zero_optimization keys k=v,... (default: its own; bucket "
                         "5e8 elements)"),
}

# what `memfit plan --allow` takes
ALLOWABLE = ('bf16', 'lora', 'qlora', 'adamw8bit', 'paged_adamw8bit')


def row(field) -> tuple:
    """A ``techniques.spec.Field`` as a line of ``FLAGS``."""
    offered = field.choices if field.choices and (field.kind == "bool" or field.flag_choices) else ()
    return (field.name, field.kind, tuple(offered), field.help)


def render() -> str:
    """This module's text, with FLAGS and ALLOWABLE taken from the registry (imports torch)."""
    import re
    from pathlib import Path

    from memfit.planner.space import allowable
    from memfit.techniques.registry import fields

    text = Path(__file__).read_text(encoding="utf-8")
    rows = "".join("    ({!r}, {!r}, {!r},\n     {!r}),\n".format(*row(f)) for f in fields())
    text = re.sub(r"^FLAGS = \(\n.*?^\)\n", lambda _: f"FLAGS = (\n{rows})\n", text, count=1, flags=re.M | re.S)
    return re.sub(r"^ALLOWABLE = .*\n", lambda _: f"ALLOWABLE = {allowable()!r}\n", text, count=1, flags=re.M)


if __name__ == "__main__":
    print(render(), end="")
