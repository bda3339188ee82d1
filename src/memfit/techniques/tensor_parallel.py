"""Tensor parallelism (``Recipe(tp=N)``): DTensor's ``parallelize_module`` over N ranks of a node.

The model's own plan (a Hugging Face model's ``_tp_plan``, what ``from_pretrained(tp_plan="auto")``
applies: ``colwise`` / ``rowwise`` linears, the embedding sharded over its rows, the head gathered) as
torch's parallel styles: each rank holds 1/N of the attention and MLP weights, their gradients and optimizer
state, and the activations of its heads. A tied head is re-tied to the embedding's shard, and what the plan
leaves whole is replicated as DTensors (torchtitan's ``NoParallel``). The data-parallel ranks are the rest of
the world: TP is the innermost dimension of the run's mesh (``hardware.cluster.Layout``, pp x replicate x shard
x tp, torchtitan's order) and ``parallel.py`` runs FSDP2 over the data-parallel ones (HSDP across nodes); a
pipeline stage is split the same way (``pipeline_parallel.py``); ``parallel=none`` needs every GPU used. Each TP rank
reads the same micro-batch. ``sequence_parallel`` and ``loss_parallel`` add torchtitan's sequence sharding of
the residual stream and its vocabulary-sharded cross-entropy over the same plan (``_sequence_plan``). Not
yet: MoE experts (a plan naming them is one error). Written here rather than taken from transformers' own TP
loading (``apply_tensor_parallelism``): that path loads checkpoints and its API moved between 5.17 and 5.24;
torch's styles are stable.
"""

from __future__ import annotations

from memfit.errors import MemfitError
from memfit.techniques.degrees import check_degree, unchecked_pair

__all__ = ["check_tp", "tp_plan", "tensor_parallel", "tp_conflict", "MODELLED_STYLES"]

#: what tensor parallelism has not been checked with against real runs (each an error naming it)
_INCOMPATIBLE = (("parallel", lambda r: r.parallel == "ddp"), ("chunked_loss", lambda r: r.chunked_loss),
                    ("compile", lambda r: r.compile), ("lora", lambda r: r.lora != "off"),
                    ("offload", lambda r: r.offload != "none"), ("offload_optimizer", lambda r: r.offload_optimizer),
                    ("optimizer_in_backward", lambda r: r.optimizer_in_backward),
                    ("optimizer", lambda r: any(k in str(r.optimizer) for k in ("8bit", "4bit", "paged"))))


def tp_conflict(recipe) -> str | None:
    """The first technique ``recipe`` pairs with tensor parallelism that memfit has not checked, as one error line."""
    return unchecked_pair(recipe, "tp", _INCOMPATIBLE)


#: the styles of a model's own plan memfit lays out (a replicated weight has nothing to shard)
MODELLED_STYLES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "rowwise_rep", "embedding_rowwise",
                   "replicated_with_grad_allreduce", "replicate")


def check_tp(value) -> None:
    check_degree("tp", value, "a number of GPUs", "no tensor parallelism")


def tp_plan(model, tp: int, *, sequence: bool = False, loss: bool = False) -> dict:
    """The model's tensor-parallel plan as torch's parallel styles, checked against ``tp`` (one error naming
    the fix otherwise); with ``sequence`` and ``loss``, sequence and loss parallel as torchtitan lays them
    over the same plan (``_sequence_plan``)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = dict(getattr(model, "_tp_plan", None) or {})
    config = getattr(model, "config", None)
    if not plan and config is not None and getattr(config, "base_model_tp_plan", None):
        prefix = getattr(model, "base_model_prefix", "")
        inner = prefix and hasattr(model, prefix)
        plan = {(f"{prefix}." if inner else "") + k: v for k, v in config.base_model_tp_plan.items()}
    if not plan:
        raise MemfitError(f"tp={tp} needs the model's tensor-parallel plan and {type(model).__name__} has none "
                          "(a transformers model's config.base_model_tp_plan): use tp=1")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
              "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
              "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
              "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate())}
    unknown = sorted({v for v in plan.values() if v not in MODELLED_STYLES})
    if unknown:
        raise MemfitError(f"tp={tp}: the model's plan uses {', '.join(unknown)}, which memfit does not model yet "
                          "(MoE experts, packed or sequence-parallel styles): use tp=1")
    if config is not None:
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value % tp:
                raise MemfitError(f"tp={tp} does not divide the model's {name}={value}: each rank takes whole "
                                  f"heads and an equal share; use a tp that divides it")
    if sequence or loss:
        return _sequence_plan(model, {name: v for name, v in plan.items() if v in styles}, tp, sequence, loss)
    return {name: styles[v]() for name, v in plan.items() if v in styles}


def _sequence_plan(model, plan: dict, tp: int, sequence: bool, loss: bool) -> dict:
    """torchtitan's Llama plan (``parallelize_llama.apply_tp``) laid over a model's own: with ``sequence`` the
    residual stream between the blocks is a DTensor sharded over the sequence (``Shard(1)``): the embedding's
    and each block's row-wise outputs reduce-scatter to it, the norms on it run per shard
    (``SequenceParallel``), and each attention and MLP all-gathers its input (``_gather_sequence``); with
    ``loss`` the head's logits stay sharded over the vocabulary and the cross-entropy runs on the shards under
    ``loss_parallel`` (``_apply`` enters it around each micro-batch)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    seq = Shard(1)
    out, layers, heads = {}, set(), []
    for name, style in plan.items():
        if "*" in name and style in ("colwise", "rowwise"):  # a linear of every block
            layers.add(name.split(".*.")[0])
            parent = name.rsplit(".", 1)[0]
            if sequence:
                out[parent] = _gather_sequence()
            if style.startswith("rowwise"):
                out[name] = RowwiseParallel(output_layouts=seq, use_local_output=False) if sequence \
                    else RowwiseParallel()
            else:
                out[name] = ColwiseParallel()
        elif style == "embedding_rowwise":
            out[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sequence else Replicate(),
                                        use_local_output=not sequence)
        elif style.startswith("colwise"):  # the head
            heads.append(name)
            out[name] = ColwiseParallel(input_layouts=seq if sequence else Replicate(),
                                        output_layouts=Shard(-1) if loss else Replicate(), use_local_output=not loss)
        else:
            raise MemfitError(f"tp={tp} with sequence or loss parallel: memfit does not lay {style!r} ({name}) over "
                              "the sequence yet; use sequence_parallel=false and loss_parallel=false")
    if loss and not heads:
        raise MemfitError(f"loss_parallel needs the model's output head in its tensor-parallel plan and "
                          f"{type(model).__name__}'s has none: use loss_parallel=false")
    if sequence:
        if len(layers) != 1:
            raise MemfitError(f"sequence_parallel needs one stack of blocks in the model's plan, found "
                              f"{len(layers) or 'none'}: use sequence_parallel=false")
        stack = next(iter(layers))
        base = stack.rsplit(".", 1)[0] if "." in stack else ""
        for prefix, module in ((f"{stack}.*", model.get_submodule(stack)[0]),
                               (base, model.get_submodule(base) if base else model)):
            for child, sub in module.named_children():
                if _is_norm(sub):  # a norm of the residual stream: per sequence shard
                    out[f"{prefix}.{child}" if prefix else child] = SequenceParallel()
    return out


def _is_norm(module) -> bool:
    return "norm" in type(module).__name__.lower() and not any(True for _ in module.children())


def _gather_sequence():
    """A parallel style for a block's attention or MLP: its input, the residual stream's sequence shard
    (``Shard(1)``), all-gathered to the whole sequence as a plain tensor, which its column-wise linears then take
    as the replicated input. torch's ``PrepareModuleInput`` names an input by position or by keyword, and
    transformers passes the attention's ``hidden_states`` by keyword and the MLP's by position: this takes the
    first tensor either way."""
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class GatherSequence(ParallelStyle):
        def _apply(self, module, device_mesh):
            module.register_forward_pre_hook(lambda _m, args, kwargs: _gathered(args, kwargs, device_mesh),
                                             with_kwargs=True)
            return module

    return GatherSequence()


def _gathered(args, kwargs, mesh):
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def whole(value):
        if not isinstance(value, DTensor):
            value = DTensor.from_local(value, mesh, (Shard(1),), run_check=False)
        return value.redistribute(placements=(Replicate(),)).to_local()

    if args and isinstance(args[0], torch.Tensor):
        return (whole(args[0]),) + tuple(args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return args, {**kwargs, "hidden_states": whole(kwargs["hidden_states"])}
    return args, kwargs


def tensor_parallel(build, mesh):
    """Shard the model (or its pipeline stage) over ``mesh["tp"]``, the innermost dimension of the run's mesh
    (``Layout``); FSDP2 or DDP then runs over its data-parallel dimensions."""
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils._python_dispatch import _disable_current_modes

    tp = build.recipe.tp
    with _disable_current_modes():
        tp_mesh = mesh["tp"]
    # every rank built the same weights (or sharding follows on meta): each cuts its own part, no scatter from
    # rank 0 (whose send buffers gloo keeps for a while: a rank-0-only excess in the truth, not the step's)
    recipe = build.recipe
    whole = build.model.__dict__.get("whole", build.model)  # a pipeline stage's model (pipeline_parallel.py)
    plan = tp_plan(whole, tp, sequence=recipe.sequence_parallel, loss=recipe.loss_parallel)
    if whole is not build.model:
        plan = _on_stage(plan, build.model.renames)
        if recipe.sequence_parallel:  # the stages pass each other the residual stream's sequence shards
            for part in build.pipeline.parts:
                part.sequence_mesh = tp_mesh
            build.pipeline.shards = tp
    parallelize_module(build.model, tp_mesh, plan, src_data_rank=None)
    _retie(build.model)
    _replicate_rest(build.model, tp_mesh)
    if recipe.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        build.micro_contexts.append(loss_parallel)


def _on_stage(plan: dict, renames: dict) -> dict:
    """``plan``'s entries for the parts a rank's pipeline stages hold, each path as the stage names it (``renames``:
    a model path to the stage's paths for it, none where another rank holds it)."""
    out = {}
    for name, style in plan.items():
        prefix = max((p for p in renames if name == p or name.startswith(p + ".")), key=len, default=None)
        if prefix is None:
            raise MemfitError(f"tp with pp: the plan's {name} is outside the blocks, embedding, norm and head a "
                              "stage holds; use pp=1 or tp=1")
        for renamed in renames[prefix]:
            out[renamed + name[len(prefix):]] = style
    return out


def _retie(model) -> None:
    """A tied head is one weight again: ``parallelize_module`` made the embedding's and the head's shards two
    parameters (each style distributes its own), which doubles that matrix and its optimizer state and
    trains two matrices where the model has one. Both are sharded over the vocabulary (rows), so the
    embedding's DTensor serves the head, as transformers' own TP loading re-ties them."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False) or not hasattr(model, "get_output_embeddings"):
        return
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embed is None or head.weight.shape != embed.weight.shape:
        return
    if getattr(head.weight, "placements", None) == getattr(embed.weight, "placements", None):
        head.weight = embed.weight


def _replicate_rest(model, mesh) -> None:
    """Every parameter the plan left whole (norms, an embedding outside the plan) as a DTensor replicated over
    the TP group, its module taking and giving plain tensors (torchtitan's ``NoParallel``): an optimizer's
    foreach step cannot mix DTensors and tensors. The same bytes; the gradient is the full one on each rank."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def inputs(_module, args, device_mesh):
        return tuple(DTensor.from_local(a, device_mesh, [Replicate()], run_check=False)
                     if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)

    def output(_module, out, _device_mesh):
        return out.to_local() if isinstance(out, DTensor) else out

    def replicate(_name, module, device_mesh):
        for key, param in list(module._parameters.items()):
            if param is not None and not isinstance(param, DTensor):
                module.register_parameter(key, torch.nn.Parameter(
                    DTensor.from_local(param.data, device_mesh, [Replicate()], run_check=False),
                    requires_grad=param.requires_grad))

    for module in list(model.modules()):
        if any(p is not None and not isinstance(p, DTensor) for p in module._parameters.values()):
            distribute_module(module, mesh, partition_fn=replicate, input_fn=inputs, output_fn=output)
