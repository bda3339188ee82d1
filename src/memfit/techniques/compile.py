"""torch.compile: the loss computation compiled by Inductor, as one graph or block by block.

Memory: AOTAutograd's min-cut partitioner chooses what the forward saves for backward (it
recomputes cheap pointwise ops in backward instead of saving their outputs), and Inductor fuses
pointwise chains into one kernel, so their intermediates never exist, and reuses dead buffers.
torch's ``activation_memory_budget`` (``torch._functorch.config``, 1.0 by default: save what is
fastest) makes the partitioner recompute more, down to what fits that fraction of the default
saved bytes. Cost: compile time (tens of seconds per graph on 2 CPU cores); the step itself is
usually faster. Does not change the math beyond rounding.

What is compiled. ``compile=true``: ``loss_fn(model, batch)`` as one function (forward and loss in
one graph). ``compile=layers``: what ``torchtune.training.compile_model`` and ``compile_loss`` do:
each repeated block (``checkpointing.find_blocks``) compiled on its own, inside its checkpoint
where checkpointing wraps it (torchtune's checkpoint wrapper around a compiled layer), and the loss
on its own: a Hugging Face model's ``loss_function`` (upcast and cross-entropy), or with
``chunked_loss`` each chunk's upcast and cross-entropy (torchtune's chunked loss compiles that part,
not the head); a caller's own ``loss_fn`` compiles its pieces with ``compiled(fn)``, which plans on
fake tensors and compiles for real ones. Everything else (embedding, final norm, head) runs eager,
and the model's KV cache is off (as checkpointing turns it off): filled in training it hands each
layer its own entry, dynamo recompiles every layer on it and past its recompile limit (8) runs the
rest eager. One graph then serves every block. The backward is AOTAutograd's compiled backward;
the optimizer step is not compiled.

Why both: per block, the checkpointed step keeps checkpoint's saving (each block's saved set
exists in backward one block at a time), and activation offload moves each block's saved set as
the block ends; one whole graph re-plans the checkpointed regions (measured: +23 % over the eager
checkpointed peak on the zoo's Llama, and on Llama-3.1-8B packed 2 x 2048 with paged 8-bit AdamW in
backward 32.3 GiB, 17.1 GiB of it the compiled backward's buffers, against 20.0 GiB per block) and
takes every saved tensor back at its backward's start, so offload moves nothing (refused).

How it is estimated, exactly as it runs: the estimate compiles the same function with the same
dynamo, AOTAutograd, partitioner, decompositions and Inductor scheduler and buffer planning; only
the last step differs. Where Inductor would load its generated module (C++ kernels built by gcc),
memfit executes the generated Python wrapper itself with every fused kernel a no-op: the wrapper's
``empty_strided`` allocations, ``del`` frees, buffer reuse and extern kernels (matmuls, run on
fake tensors) are what the ledger records, in Inductor's order. Written by hand because torch has
no "plan only" mode for Inductor; ``torch._inductor.memory.estimate_peak_memory`` scores one
graph's scheduler nodes but not the step around it (saved tensors alive between forward and
backward, gradients, optimizer).

Measured (``bench/accuracy/compile_cpu.py``, ``tests/test_compile.py``): against the same step really
compiled and run on the CPU allocator, byte-exact or within 48 bytes on the zoo's MLP, GPT, tiny
Llama (fp32, bf16-mixed, and with checkpointing, accumulation, LoRA, ...), GPT-2, encoder and CNN;
``compile=layers`` within 1,048 bytes (0.01 %) on the zoo's Llama (fp32, bf16-mixed, checkpointing,
offload, both, chunked loss, LoRA, optimizer in backward), GPT (with and without checkpointing),
GPT-2 and the encoder.

Where it is used: ``estimate`` (CPU and CUDA semantics; under CUDA semantics the plan is the CPU
backend's, since Inductor's CUDA backend needs a GPU to lower for) and ``fit`` (checked by full
estimates). Not searched by ``plan`` (``trace="none"``): every candidate graph would compile
anew (10-60 s each on 2 cores), and the planner's composition from prime-batch traces at two
depths assumes what Inductor does not promise (its fusion and reuse may change with sizes). The
depth fast path refuses both values: one whole graph runs outside the blocks' modules, and a
compiled block's backward is not in the per-block records the fast path writes out (tried with
``compile=layers``: 13 % low on llama-3.2-1b); ``estimate`` traces a compiled step in full, which
per block compiles one graph for all blocks (llama-3.2-1b: 4 s; the 8B row above: 26 s).
``measure`` refuses it: Inductor's wrapper allocates with ``empty_strided_cpu``, past the
dispatcher its ledger watches.

Left out: dynamo's and Inductor's caches are off while an estimate compiles (its artefacts ran on
fake tensors) and dynamo is reset after the trace (``torch._dynamo.reset``), so a compiled model
of the same process recompiles on its next call. Graph breaks are dynamo's own, estimated as run.
"""

from __future__ import annotations

import contextlib
import functools
import gc

import torch

from memfit.errors import MemfitError, shown
from memfit.scoped import patched
from memfit.techniques.spec import Field, Technique

__all__ = ["TECHNIQUE", "compiled", "compiled_loss", "compile_layers", "compile_scope", "planned_compile"]


def _check_budget(value) -> None:
    if not 0 < value <= 1:
        raise MemfitError(f"activation_memory_budget must be in (0, 1] (1.0: torch's default), got {shown(value)}")


def _stub(*args, **kwargs):
    """A fused kernel that is not run: its buffers are allocated by the wrapper, not by it."""
    return None


class _NoCompile:
    """Stands in for Inductor's ``AsyncCompile`` in the generated wrapper: no gcc, no-op kernels."""

    def __getattr__(self, name):
        if name == "wait":
            return lambda scope: None
        return lambda *args, **kwargs: _stub


def _wrapper_globals() -> dict:
    """What the generated wrapper's helpers become on fake tensors: allocations and views through
    the dispatcher (the ledger sees them), checks dropped."""
    def empty_strided_cpu(size, stride, dtype):
        return torch.empty_strided(size, stride, dtype=dtype, device="cpu")

    def reinterpret_tensor(tensor, size, stride, offset):
        return torch.as_strided(tensor, size, stride, offset)

    return {"empty_strided_cpu": empty_strided_cpu, "reinterpret_tensor": reinterpret_tensor,
            "assert_size_stride": lambda *a, **k: None, "assert_alignment": lambda *a, **k: None,
            "async_compile": _NoCompile()}


class _Planned:
    """The generated wrapper module, executed with no-op kernels (see the module docstring)."""

    def __init__(self, code: str):
        scope: dict = {"__name__": "memfit_inductor_plan"}
        # the wrapper's own imports and assignments run first; then its helpers are replaced
        header, _, rest = code.partition("async_compile = AsyncCompile()")
        exec(compile(header, "<inductor wrapper>", "exec"), scope)  # noqa: S102 — Inductor's own output
        scope.update(_wrapper_globals())
        exec(compile(rest, "<inductor wrapper>", "exec"), scope)  # noqa: S102
        self.call = scope["call"]
        self.runner = scope.get("runner")
        self.__file__ = "<memfit: inductor wrapper, kernels not built>"


def _compile_to_module(graph):
    wrapper, _ = graph.codegen()
    return _Planned(wrapper.value)


def _planned_inner(gm, example_inputs, **kwargs):
    """Inductor's ``compile_fx_inner`` for one graph (forward, or the backward when autograd first
    needs it), its module the generated wrapper run with no-op kernels."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.graph import GraphLowering

    with patched(GraphLowering, "compile_to_module", _compile_to_module), \
            torch._inductor.config.patch(fx_graph_cache=False, cpp_wrapper=False):
        return compile_fx_inner(gm, example_inputs, **kwargs)


def _planning_backend(gm, example_inputs):
    """Inductor up to its generated wrappers, which then run with no-op kernels (fake tensors)."""
    from torch._inductor.compile_fx import compile_fx

    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=_planned_inner)


def _is_fake(model) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return any(is_fake(p) for p in model.parameters())


def _any_fake(args, kwargs) -> bool:
    from torch._subclasses.fake_tensor import is_fake
    from torch.utils._pytree import tree_leaves

    return any(isinstance(x, torch.Tensor) and is_fake(x) for x in tree_leaves((args, kwargs)))


def compiled(fn, *, fake: bool | None = None, budget: float | None = None, dynamic: bool | None = None):
    """``fn`` compiled by Inductor, as ``torch.compile(fn)`` compiles it; on fake tensors Inductor's
    plan runs with no-op kernels instead (the module docstring). ``fake`` None: chosen at each call
    by whether an argument is a fake tensor, so a piece of the caller's own ``loss_fn`` that their
    training compiles (torchtune's compiled cross-entropy) is estimated as it trains. ``budget``:
    the ``activation_memory_budget`` it runs with (None: torch's setting); ``dynamic`` as torch.compile's."""
    made: dict = {}

    @functools.wraps(fn)
    def run(*args, **kwargs):
        planned = _any_fake(args, kwargs) if fake is None else fake
        if planned not in made:
            made[planned] = torch.compile(fn, backend=_planning_backend if planned else "inductor",
                                          dynamic=dynamic)
        if budget is None:
            return made[planned](*args, **kwargs)
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return made[planned](*args, **kwargs)

    return run


def planned_compile(target, *, dynamic: bool | None = None, fullgraph: bool = False):
    """``torch.compile(target)`` (a module or a function) with Inductor's plan run on no-op kernels: what a
    user's own script compiles, estimated on fake tensors (``memfit.script``)."""
    return _TORCH_COMPILE(target, backend=_planning_backend, dynamic=dynamic, fullgraph=fullgraph)


_TORCH_COMPILE = torch.compile  # torch's own, also while a script's is replaced by memfit.script.compiling


def compiled_loss(loss_fn, *, fake: bool, budget: float):
    """``loss_fn`` compiled with Inductor (``fake``: planned only, see the module docstring), run
    with ``activation_memory_budget`` = ``budget``."""
    return compiled(loss_fn, fake=fake, budget=budget)


def compile_layers(model, *, fake: bool, budget: float) -> list[str]:
    """Each repeated block of ``model`` compiled on its own (``torchtune.training.compile_model``),
    inside its checkpoint where checkpointing wraps it; returns the blocks' paths."""
    from memfit.techniques.checkpointing import find_blocks, no_kv_cache

    blocks = find_blocks(model)
    if not blocks:
        raise MemfitError("compile=layers found no repeated blocks in the model: use compile=true (the whole "
                          "loss_fn compiled as one graph)")
    for _, block in blocks:
        forward = block.forward
        if hasattr(forward, "checkpointed"):  # checkpoint(compiled block), as torchtune wraps it
            forward.checkpointed = compiled(forward.checkpointed, fake=fake, budget=budget)
        else:
            block.forward = compiled(forward, fake=fake, budget=budget)
    # a KV cache filled in training hands each layer its own cache entry: every layer would compile
    # anew (dynamo guards on the entry) and past dynamo's recompile limit (8) run eager; torchtune's
    # layers have no cache in training
    no_kv_cache(model)
    return [name for name, _ in blocks]


def _compile_loss_part(build, fake: bool, budget: float) -> None:
    """compile="layers": the loss compiled on its own (``torchtune.training.compile_loss``): a Hugging
    Face model's ``loss_function`` (its upcast and cross-entropy), or chunked_loss's per-chunk
    upcast and cross-entropy (torchtune's chunked loss compiles that part, not the head)."""
    from memfit.techniques.chunked_loss import chunk_cross_entropy, chunked_lm_loss

    if build.recipe.chunked_loss:
        # static shapes: the shorter last chunk gets its own graph; a dynamic graph made for it would
        # also serve the other chunks' recomputation, saving other tensors than their forward did
        piece = compiled(chunk_cross_entropy, fake=fake, budget=budget, dynamic=False)
        build.loss_fn = chunked_lm_loss(build.recipe.chunked_loss, cross_entropy=piece)
    model = build.model.get_base_model() if hasattr(build.model, "get_base_model") else build.model
    if isinstance(getattr(type(model), "loss_function", None), property):
        model.loss_function = compiled(model.loss_function, fake=fake, budget=budget)


@contextlib.contextmanager
def compile_scope(recipe):
    """Around a fake trace of ``recipe``. With ``compile``: Python's cyclic garbage collector is
    paused while it runs, and dynamo is reset after it (its cache entries ran on fake tensors and
    would only fill dynamo's recompile limit).

    Why the pause: compiling inside the traced step makes masses of Python garbage, so the
    collector runs mid-step and frees tensors that reference cycles hold (measured on GPT-2: the
    first estimate of a process came out 3.8 MB low, later ones and the allocator's truth agreed
    within 48 B). The real step compiles in step 1; in the measured runs the collector did not
    run inside the steps' peaks, and with it paused the estimate does not depend on what the
    process compiled before.
    """
    if not recipe.compile:
        yield
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        torch._dynamo.reset()


def _apply(build) -> None:
    recipe = build.recipe
    if not recipe.compile:
        return
    from memfit.techniques.step import default_loss

    fake, budget = _is_fake(build.model), float(recipe.activation_memory_budget)
    if recipe.compile == "layers":
        compile_layers(build.model, fake=fake, budget=budget)
        _compile_loss_part(build, fake, budget)
        return
    build.loss_fn = compiled_loss(build.loss_fn or default_loss, fake=fake, budget=budget)


def _conflicts(r):
    if r.compile is True and r.offload_activations:
        yield ("compile=true and offload_activations conflict: the one compiled graph saves its tensors at its end "
               "and takes them all back at its backward's start, so nothing moves (measured on the zoo's Llama: "
               "the same peak as compile alone); use compile=layers or drop one")
    if r.activation_memory_budget != 1.0 and not r.compile:
        yield (f"activation_memory_budget={r.activation_memory_budget} needs compile: it is the compiled "
               "partitioner's knob; set compile=true or drop it")


TECHNIQUE = Technique(
    name="compile",
    fields=(Field("compile", False, "torch.compile (Inductor): true: loss_fn (forward and loss) as one graph; "
                  "layers: each block and the loss on their own (torchtune); fused kernels, the partitioner's "
                  "saved set; costs compile time", slot=55, kind="bool", choices=("layers",)),
            Field("activation_memory_budget", 1.0, "compile only: fraction (0, 1] of the partitioner's "
                  "saved bytes to keep (lower recomputes more in backward)", slot=56, kind="float",
                  check=_check_budget)),
    order=45, apply=_apply, conflicts=_conflicts, trace="none")
