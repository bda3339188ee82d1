"""Pipeline parallelism (``Recipe(pp=N)``): a decoder model's blocks cut into N stages, one per rank, run by
``torch.distributed.pipelining`` (``PipelineStage`` with the GPipe or 1F1B schedule); or, with Interleaved 1F1B,
into 2N stages looped over the ranks (rank r holds stages r and r + N, each its own FSDP2 root, as torchtitan
shards each model part: ``Stages`` holds them for the optimizer and the techniques).

Each rank holds its stage's parameters, their gradients and optimizer state, and the saved activations of the
micro-batches its schedule keeps in flight: GPipe runs every forward before any backward (all of them), 1F1B
starts backward once the pipeline is full (stage ``i`` of N holds at most ``N - i``). So every stage is its own
kind of rank, and ``estimate`` traces each one (``_estimate_ranks``). The micro-batches of a step are the
recipe's ``grad_accum_steps`` of ``micro_batch_size`` rows; every pipeline rank reads the same rows (the
data-parallel ranks split them).

The cut follows torchtitan (``generate_llm_fqn_per_model_part``): the embedding and the head each count as one
block, the blocks are spread evenly over the stages, and what is left over goes to the first stages. A stage
module runs its part of a Hugging Face decoder (embedding on the first stage; its blocks with the model's
rotary embedding; final norm and head on the last) inside the recipe's forward contexts (autocast), and the
last stage's loss is the model's own ``loss_function``. Each ``PipelineStage`` is given its micro-batch's input
and output as static shapes, so no shape inference runs (it sends real tensors and reads them back, which a
fake process group cannot answer).

Written here, not taken from a library: torchtitan's cut and stage split live in a training repository, not a
package, and they split torchtitan's own model classes. Not yet (each an error naming it): zero-bubble
schedules, DDP or FSDP2's offload, a caller's own loss. The stage is this
rank's index along the mesh's ``pp`` dimension (``hardware.cluster.Layout``: pp outermost, so stages split the
nodes when there are several); with ``parallel=fsdp`` FSDP2 shards it over its data-parallel ranks and
``PipelineStage`` drives FSDP2's gradient sync. With ``tp`` the stage's blocks are split over its TP group
(the model's own plan, its paths renamed to the stage's: ``renames``); with sequence parallel the stages pass
each other the residual stream's sequence shards (``sequence_mesh``), and with loss parallel the last stage's
loss runs on vocabulary shards.
A tied head on the last stage keeps its own copy of the embedding matrix (nothing in torch's pipelining keeps
tied weights across stages equal): its memory is counted, as a real run holds it.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect

from memfit.errors import MemfitError
from memfit.techniques.degrees import check_degree, unchecked_pair

__all__ = ["SCHEDULES", "check_pp", "cut", "pipeline_conflict", "pipeline", "traced_as", "FAST_SCHEDULES"]

#: schedules whose stages the depth fast path traces as a shallow copy (one stage a rank: one stack of blocks)
FAST_SCHEDULES = ("gpipe", "1f1b")
_TRACED_AS = contextvars.ContextVar("memfit_pipeline_stage", default=None)


@contextlib.contextmanager
def traced_as(stage: int):
    """For the ``with`` block, a pipeline built from a model gives every block of it to ``stage``: the depth fast
    path's shallow copy of one stage's blocks (``estimator/depth.py``), run as that stage."""
    token = _TRACED_AS.set(stage)
    try:
        yield
    finally:
        _TRACED_AS.reset(token)

#: schedules by their torch class: one stage per rank, or (interleaved) ``STAGES_PER_RANK`` of them
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B"}
#: the stages each rank holds under a looped schedule: torchtitan's default of two when it is not told
STAGES_PER_RANK = {"interleaved-1f1b": 2}


#: what pipeline parallelism is not modelled with (each an error naming it)
_INCOMPATIBLE = (("parallel", lambda r: r.parallel == "ddp"), ("offload", lambda r: r.offload != "none"),
                 ("compile", lambda r: bool(r.compile)), ("chunked_loss", lambda r: bool(r.chunked_loss)),
                 ("lora", lambda r: r.lora != "off"), ("optimizer_in_backward", lambda r: r.optimizer_in_backward),
                 ("offload_optimizer", lambda r: r.offload_optimizer))


def check_pp(value) -> None:
    check_degree("pp", value, "a number of pipeline stages", "no pipeline")


def pipeline_conflict(recipe) -> str | None:
    """The first technique ``recipe`` pairs with pipeline parallelism that memfit does not model yet, as one line."""
    if recipe.pp == 1:
        if recipe.pp_schedule != "1f1b":
            return f"pp_schedule={recipe.pp_schedule} needs pipeline parallelism: set pp to 2 or more"
        return None
    clash = unchecked_pair(recipe, "pp", _INCOMPATIBLE, "memfit does not model that pair yet")
    if clash:
        return clash
    if recipe.sync_grads != "last":  # what PipelineStage does with FSDP2, whatever the recipe says
        return (f"pp={recipe.pp} and sync_grads={recipe.sync_grads} conflict: torch's PipelineStage reduces FSDP2's "
                "gradients on a step's last backward only; drop sync_grads")
    return None


def cut(layers: int, stages: int, input_weight: int = 1, output_weight: int = 1) -> list[range]:
    """The blocks of each stage, torchtitan's way: the embedding counts as ``input_weight`` blocks on the first
    stage, the norm and head as ``output_weight`` on the last; the remainder goes to the first stages."""
    effective = layers + input_weight + output_weight
    per, extra = divmod(effective, stages)
    if stages > layers or per <= max(input_weight, output_weight) - 1 or per == 0:
        raise MemfitError(f"pp={stages} is more stages than the model's {layers} blocks can fill (the embedding and "
                          f"the head count as a block each): use pp of at most {max(1, effective // 2)}")
    out, start = [], 0
    for stage in range(stages):
        count = per + (stage < extra) - (input_weight if stage == 0 else 0) - \
            (output_weight if stage == stages - 1 else 0)
        out.append(range(start, min(layers, start + max(count, 0))))
        start = out[-1].stop
    if start != layers or any(len(r) == 0 for r in out):
        raise MemfitError(f"pp={stages} leaves a stage without blocks for the model's {layers}: use a smaller pp")
    return out


def _parts(model):
    """(embedding, blocks, rotary embedding or None, final norm, head) of a Hugging Face decoder LM."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    layers = getattr(base, "layers", None)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    norm = getattr(base, "norm", None)
    if base is None or layers is None or embed is None or head is None or norm is None:
        raise MemfitError(f"pp needs a decoder language model with its blocks in model.layers, a final norm and an "
                          f"output head; {type(model).__name__} is not laid out so: use pp=1")
    return embed, layers, getattr(base, "rotary_emb", None), norm, head


def _stage_module(model, blocks: range, first: bool, last: bool, contexts: list):
    import contextlib

    import torch

    embed, layers, rotary, norm, head = _parts(model)

    class Stage(torch.nn.Module):
        """One pipeline stage of a Hugging Face decoder: a micro-batch's token ids (first stage) or hidden states
        in, hidden states (or the last stage's logits) out."""

        def __init__(self, embed, layers, rotary, norm, head):
            # the parts come in as arguments: a class body closing over them kept the other stages' embedding
            # and head alive, whole, for as long as the stage (15.6 GiB a rank of a 405B middle stage)
            super().__init__()
            self.embed = embed
            self.layers = torch.nn.ModuleList(layers)
            self.rotary = rotary
            self.norm, self.head = norm, head
            self.sequence_mesh = None  # the TP mesh, with sequence parallel (tensor_parallel.py sets it)

        def forward(self, x):
            with contextlib.ExitStack() as stack:
                for context in contexts:  # the recipe's (autocast), around the forward only
                    stack.enter_context(context())
                if self.embed is not None:
                    x = self.embed(x)
                elif self.sequence_mesh is not None:  # the residual stream's sequence shard, as TP's blocks take it
                    from torch.distributed.tensor import DTensor, Shard

                    x = DTensor.from_local(x, self.sequence_mesh, (Shard(1),), run_check=False)
                position_ids = torch.arange(x.shape[1], device=x.device)[None]
                extra = {"position_ids": position_ids}
                if self.rotary is not None:
                    extra["position_embeddings"] = self.rotary(x, position_ids)
                for layer in self.layers:
                    x = layer(x, **extra)
                if self.head is not None:
                    x = self.head(self.norm(x))
                elif self.sequence_mesh is not None:  # sent to the next stage as this rank's shard
                    x = x.to_local()
            return x

    stage = Stage(embed if first else None, [layers[i] for i in blocks], rotary,
                  *((norm, head) if last else (None, None)))
    stage.config = getattr(model, "config", None)  # what the techniques after this one read (use_cache)
    # what tensor parallelism reads: the model's own plan (``whole``, kept out of the stage's modules) and its
    # module paths as the stage names them (none for another stage's part)
    stage.__dict__["whole"] = model
    paths = {id(m): name for name, m in model.named_modules()}
    stage.renames = {paths[id(embed)]: ["embed"] if first else [], paths[id(layers)]: ["layers"],
                     paths[id(norm)]: ["norm"] if last else [], paths[id(head)]: ["head"] if last else []}
    return stage


def pipeline(build, mesh):
    """Cut ``build.model`` into ``recipe.pp`` stages (twice as many under Interleaved 1F1B), keep this rank's (by
    its index along ``mesh["pp"]``), and make the step run the schedule: the build's model becomes the stage (or
    the rank's stages, ``Stages``), and ``build.pipeline`` runs one optimizer step's micro-batches through it."""
    import torch
    from torch.distributed import pipelining

    recipe, model = build.recipe, build.model
    if build.user_loss:
        raise MemfitError(f"pp={recipe.pp} and a loss_fn conflict: the last stage computes the model's own loss "
                          "(its loss_function on the logits); drop loss_fn")
    micro = recipe.grad_accum_steps
    if recipe.pp_schedule != "gpipe" and micro < recipe.pp:  # torch's own rule, said with the fix
        raise MemfitError(f"pp={recipe.pp} with the {recipe.pp_schedule} schedule needs at least {recipe.pp} "
                          f"micro-batches a step, got grad_accum_steps={micro}: set --grad-accum-steps {recipe.pp} "
                          "(or more), or pp_schedule=gpipe")
    if recipe.pp_schedule == "interleaved-1f1b" and micro % (micro // recipe.pp):
        raise MemfitError(f"pp={recipe.pp} with interleaved-1f1b runs micro-batches in rounds of {recipe.pp}: "
                          f"grad_accum_steps={micro} is not a whole number of them; use a multiple of {recipe.pp}")
    pipe = mesh["pp"]
    embed, layers, _, _, head = _parts(model)
    per_rank = STAGES_PER_RANK.get(recipe.pp_schedule, 1)
    total = recipe.pp * per_rank
    # a looped schedule gives rank r the stages r, r + pp, ...: the first and the last stage on different ranks
    mine = [pipe.get_local_rank() + k * recipe.pp for k in range(per_rank)]
    shallow = _TRACED_AS.get()
    if shallow is not None:  # a shallow copy of this rank's stage: all its blocks are the stage's
        if mine != [shallow]:
            raise MemfitError(f"a shallow copy of stage {shallow} was run as stage(s) {mine}: report this")
        stages = {shallow: range(len(layers))}
    else:
        stages = cut(len(layers), total)
    loss_function = model.loss_function
    vocab = head.weight.shape[0]
    parts = [_stage_module(model, stages[i], i == 0, i == total - 1, build.forward_contexts) for i in mine]
    stage = parts[0] if per_rank == 1 else _stages(parts, model)
    build.model = stage
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None) or embed.weight.shape[1]
    _drop_the_rest(model, stage)
    build.pipeline = _Pipeline(parts, mine, total, recipe, hidden=hidden, vocab=vocab, group=pipe.get_group(),
                               loss=lambda logits, labels: loss_function(logits=logits, labels=labels,
                                                                          vocab_size=vocab),
                               modules=(pipelining, torch))


def _stages_class():
    import torch

    class Stages(torch.nn.Module):
        """The stages a rank holds under a looped schedule, as one module for FSDP2, the optimizer and the
        techniques after this one; the schedule runs each (``_Pipeline``)."""

        def __init__(self, parts, model):
            super().__init__()
            self.stages = torch.nn.ModuleList(parts)
            self.config = getattr(model, "config", None)
            self.__dict__["whole"] = model
            self.renames = {}
            for k, part in enumerate(parts):
                for path, names in part.renames.items():
                    self.renames.setdefault(path, []).extend(f"stages.{k}.{name}" for name in names)

        def forward(self, *args, **kwargs):
            raise MemfitError("a rank's pipeline stages run through their schedule, not as one module")

    return Stages


def _stages(parts, model):
    return _stages_class()(parts, model)


def _drop_the_rest(model, stage) -> None:
    """Take the other stages' blocks, embedding, norm and head out of ``model`` (the caller's, which it may still
    hold), as torchtitan deletes them from each stage's copy: a rank keeps its own stage's weights and no others
    (kept, a rank held the whole model beside its stage: 1.3 TiB on a 405B stage at tp=8)."""
    import torch

    kept = {id(m) for m in stage.modules()}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.ModuleList) and any(id(c) in kept for c in child) \
                    and id(child) not in kept:  # the model's blocks: keep this stage's
                setattr(module, child_name, torch.nn.ModuleList(c for c in child if id(c) in kept))
            elif id(child) not in kept and not any(id(m) in kept for m in child.modules()) \
                    and any(True for _ in child.parameters()):
                setattr(module, child_name, None)


def _static_metadata(stages, has_backward: bool, p2p_done: bool) -> None:
    """The schedule's warm-up, whose vote (each stage sends whether its shapes are static down the pipeline and
    the product back) settles how stages learn their neighbours' shapes. Every stage here is given static
    shapes and no DTensors, so each votes static and the product is known: it is set, not voted (under fake
    tensors the received vote cannot be read, and the estimate would take the other path). A real run and the
    estimate both skip the same few 4-byte messages."""
    from torch.distributed.pipelining._utils import InferenceMode

    for stage in stages:
        if InferenceMode.needs_dynamic(stage._user_meta, has_backward):
            raise MemfitError("a pipeline stage without static shapes: memfit gives each stage its micro-batch's "
                              "shapes; report this model")
        stage._inference_mode = InferenceMode.STATIC


class _Pipeline:
    """One optimizer step's micro-batches through this rank's stages, as the recipe's schedule orders them;
    each stage's forward and backward of each micro-batch marked as those phases for the watch."""

    def __init__(self, parts, indices, total: int, recipe, *, hidden: int, vocab: int, group, loss, modules):
        self.parts, self.indices, self.total, self.recipe, self.group = parts, indices, total, recipe, group
        self.hidden, self.vocab, self.loss = hidden, vocab, loss
        self.pipelining, self.torch = modules
        self.schedule, self.stages = None, []
        self.first, self.last = 0 in indices, total - 1 in indices
        self.shards = 1  # the sequence's shards between stages (sequence parallel over the TP group)

    def _stage(self, part, index: int, rows: int, length: int, device):
        torch, pipelining = self.torch, self.pipelining
        dtype = next(part.parameters()).dtype
        mixed = self.recipe.precision.endswith("-mixed")
        low = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(self.recipe.precision)
        first, last = index == 0, index == self.total - 1
        with torch.device("meta"):
            between = (rows, length // self.shards, self.hidden)  # a stage's hidden states, as it sends them
            inputs = torch.empty(rows, length, dtype=torch.long) if first else \
                torch.empty(between, dtype=dtype, requires_grad=True)
            outputs = torch.empty(rows, length, self.vocab, dtype=low if mixed else dtype, requires_grad=True) \
                if last else torch.empty(between, dtype=dtype, requires_grad=True)
        inputs, outputs = (torch.empty_like(t, device=device).requires_grad_(t.requires_grad)
                           for t in (inputs, outputs))
        return pipelining.PipelineStage(part, index, self.total, device, input_args=(inputs,),
                                        output_args=(outputs,), group=self.group)

    def _build(self, rows: int, length: int, device) -> None:
        self.stages = [self._stage(part, i, rows, length, device) for part, i in zip(self.parts, self.indices)]
        kind = getattr(self.pipelining, SCHEDULES[self.recipe.pp_schedule])
        one = len(self.stages) == 1 and self.recipe.pp_schedule in ("gpipe", "1f1b")
        self.schedule = kind(self.stages[0] if one else self.stages, self.recipe.grad_accum_steps, loss_fn=self.loss)
        self.schedule._warmup_p2p = _static_metadata
        # the losses are what a step returns: the last stage does not keep every micro-batch's logits to merge
        # (torch's default, return_outputs=True, holds them all to the step's end)
        self.keeps_outputs = "return_outputs" not in inspect.signature(self.schedule.step).parameters

    def __call__(self, micro: list, watch, index: int):
        torch = self.torch
        ids = torch.cat([part["input_ids"] for part in micro])
        labels = torch.cat([part.get("labels", part["input_ids"]) for part in micro])
        if self.schedule is None:
            self._build(micro[0]["input_ids"].shape[0], ids.shape[1], ids.device)

        def marked(call, phase):
            def run(*args, **kwargs):
                watch.begin(phase, index)
                return call(*args, **kwargs)
            return run

        for stage in self.stages:
            stage.forward_one_chunk = marked(stage.forward_one_chunk, "forward")
            stage.backward_one_chunk = marked(stage.backward_one_chunk, "backward")
        losses = []
        try:
            with _works_hold_tensors():
                self._step(ids, labels, losses)
        finally:
            for stage in self.stages:
                del stage.forward_one_chunk, stage.backward_one_chunk
        if losses:
            return torch.stack([loss.detach() for loss in losses]).mean()
        return torch.zeros((), device=ids.device)

    def _step(self, ids, labels, losses) -> None:
        args = (ids,) if self.first else ()
        kwargs = {"target": labels, "losses": losses} if self.last else {}
        if not self.keeps_outputs:
            kwargs["return_outputs"] = False
        self.schedule.step(*args, **kwargs)


class _Held:
    """A fake process group's work, holding the tensors of its sends and receives as a real backend's does."""

    def __init__(self, work, tensors):
        self.work, self.tensors = work, tensors

    def wait(self, *args, **kwargs):
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


def _works_hold_tensors():
    """Under the fake process group (an estimate), each point-to-point work the schedule makes holds its tensors,
    as gloo's and NCCL's works do until they are dropped (the schedule keeps a wait's works until its next
    batch): without it a received gradient was freed a step early (-8 KB on a 2-stage tiny Llama's stage 0)."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    from memfit.scoped import patched

    if dist.get_backend() != "fake":
        return contextlib.nullcontext()
    batch = schedules._batch_p2p

    def held(ops, desc=None):
        return [_Held(work, [op.tensor for op in ops]) for work in batch(ops, desc=desc)]

    return patched(schedules, "_batch_p2p", held)
