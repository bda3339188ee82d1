"""Which module is running while the ledger records: the ledger's attribution of each storage.

Forward attribution is a stack kept by global module hooks; backward attribution reads the module
that the running autograd node's forward was called in (stored in the node's ``metadata``), which
references no tensor (``torch.utils.module_tracker``'s multi-grad hooks keep tensors alive; see
``ledger.py``). Also here: the owner module of each parameter, buffer and 4-bit statistic, and the
containers of repeated blocks, which the depth fast path (``synth.py``) reads.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["ModuleStack", "OUTSIDE", "tensors"]

#: The module name of what no module's forward or backward created (loss, optimizer step).
OUTSIDE = "(outside any module)"


class ModuleStack:
    """Which module is running: its forward (a stack) or the backward of an op it ran."""

    def __init__(self, model):
        self.model = model
        # the model's class name as it was built: FSDP2's fully_shard swaps the class (FSDPLlamaForCausalLM),
        # and records made before and after sharding must name the same modules alike
        self.root = type(model).__name__ if model is not None else ""
        self.names: dict[int, str] = {}
        self._missed = weakref.WeakSet()  # modules seen that are not the model's (weak: ids are reused)
        self._owners: dict[int, str] | None = None
        self._name_modules()
        self.stack: list[str] = []
        self.handles = []
        self._pending: list = []  # weak references to the last op's outputs, to tag (``tag``)
        self._pending_module = ""

    def _name_modules(self) -> None:
        model, root = self.model, self.root
        self.names = {id(m): f"{root}.{n}" if n else root for n, m in (model.named_modules() if model is not None else ())}

    def _name(self, module) -> str:
        # Modules added after the ledger started (LoRA adapters that ``apply`` injects) get their
        # path on first sight, so their records stay inside their block.
        key = id(module)
        if key not in self.names and module not in self._missed:
            self._name_modules()
            if key not in self.names:
                self._missed.add(module)
        name = self.names.get(key)
        if name is not None:
            return name
        # A module that is no submodule of the model, called inside one of its modules (Mamba's
        # conv fallback calls a fresh ``ACT2FN[activation]`` each time): named below the module
        # that called it, so what it makes stays in that module's block (the depth fast path,
        # ``synth.py``, cuts the log by block and writes a block-less stretch once).
        parent = self.current()
        kind = type(module).__name__
        return kind if parent == OUTSIDE else f"{parent}.({kind})"

    def owned_tensors(self):
        """(tensor, module name) for every parameter, buffer and 4-bit quantisation statistic."""
        if self.model is None:
            return
        self._name_modules()
        for module in self.model.modules():
            name = self.names[id(module)]
            for tensor in (*module._parameters.values(), *module._buffers.values()):
                if isinstance(tensor, torch.Tensor):
                    yield tensor, name
            state = getattr(module._parameters.get("weight"), "quant_state", None)
            while state is not None:
                for tensor in (state.absmax, state.code, getattr(state, "offset", None)):
                    if isinstance(tensor, torch.Tensor):
                        yield tensor, name
                state = getattr(state, "state2", None)

    def owner_of(self, tensor) -> str | None:
        if self._owners is None:  # built once, at the first registration (after quantisation)
            self._owners = {id(t): name for t, name in self.owned_tensors()}
        return self._owners.get(id(tensor))

    def blocks(self) -> list[str]:
        """The outermost ``ModuleList``s of two or more modules of one class: the repeated blocks."""
        if self.model is None:
            return []
        found = []
        for module in self.model.modules():
            if isinstance(module, torch.nn.ModuleList) and len(module) >= 2 \
                    and len({type(m) for m in module}) == 1:
                name = self.names.get(id(module))
                if name and not any(name.startswith(f"{outer}.") for outer in found):
                    found.append(name)
        return found

    def __enter__(self):
        hooks = torch.nn.modules.module
        self.handles = [hooks.register_module_forward_pre_hook(self._push),
                        hooks.register_module_forward_hook(self._pop, always_call=True)]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def _push(self, module, args):
        if torch.compiler.is_compiling():  # dynamo traces module hooks: keep memfit out of the graph
            return
        self.stack.append(self._name(module))

    def _pop(self, module, args, out):
        if torch.compiler.is_compiling():
            return
        self.flush()
        if self.stack:
            self.stack.pop()

    def current(self) -> str:
        if self.stack:
            return self.stack[-1]
        node = torch._C._current_autograd_node()
        if node is not None:
            return node.metadata.get("memfit_module", OUTSIDE)
        return OUTSIDE

    def tag(self, out) -> None:
        """Remember on each new autograd node the module whose forward made it.

        Inside the dispatcher an op's outputs have no ``grad_fn`` yet (autograd sets it when the
        op returns), so they are tagged at the next op or when the module returns. A view written in
        place since (``key[..., :n].copy_(k)``, DeepSeek-V3's attention) is left untagged: the next
        op may be one autograd runs while rebasing that view's history, holding the view's lock, and
        reading its grad_fn there would wait on that lock for ever."""
        self.flush()
        if not self.stack:
            return
        self._pending = [(weakref.ref(t), t._version) for t in
                         tensors(out if isinstance(out, (list, tuple)) else (out,))]
        self._pending_module = self.stack[-1]

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for ref, version in pending:
            tensor = ref()
            if tensor is None or (tensor._version != version and tensor._is_view()):
                continue
            node = tensor.grad_fn
            if node is not None and "memfit_module" not in node.metadata:
                node.metadata["memfit_module"] = self._pending_module


def tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item
