"""Activation offload leaves the model's own weights where they are: a frozen weight saved as a view
(transposed, expanded for a batched matmul) is not copied out and back, which on a frozen tied head
cost a new (batch, rows, vocab) device copy at unpack. Graded by the CPU allocator."""

import torch

import memfit
from memfit import Recipe
from memfit.estimator.truth import true_peak
from memfit.techniques.offload_activations import ActivationOffload


class _FrozenHead(torch.nn.Module):
    """A trainable body and a frozen output weight twice the size of the logits: backward needs the
    weight, which an offload would bring back as a copy at the backward's peak."""

    def __init__(self, hidden=64, vocab=1024):
        super().__init__()
        self.body = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Parameter(torch.randn(vocab, hidden), requires_grad=False)
        self.register_buffer("scale", torch.ones(vocab, hidden))

    def forward(self, x):
        h = self.body(x)[:, ::2]
        logits = torch.nn.functional.linear(h, self.head)  # saves the weight transposed
        return logits.sum() + (h * self.scale[:32]).sum()  # a buffer's view


def _factory():
    torch.manual_seed(0)
    return _FrozenHead()


def _batch():
    return {"x": torch.randn(1, 64, 64, generator=torch.Generator().manual_seed(0))}


def _loss(model, batch):
    return model(batch["x"])


def test_the_models_own_tensors_and_their_views_stay():
    model = _factory()
    offload = ActivationOffload(model)
    weight, buffer = model.head, model.scale
    for stays in (weight, weight.t(), weight.expand(3, -1, -1), buffer, buffer.t()[0], buffer[1:]):
        assert offload.pack(stays) is stays
    activation = torch.randn(64, 64)
    assert offload.pack(activation) is not activation and offload.pack(activation.t()) is not activation
    back = offload.unpack(offload.pack(activation.t()))
    assert torch.equal(back, activation.t()) and back.stride() == activation.t().stride()
    expanded = torch.randn(1, 64).expand(512, 64)  # its copy would hold the expansion
    assert offload.pack(expanded) is expanded
    single = torch.randn(64, 64).as_strided((1, 64, 64), (0, 64, 1))  # stride 0 on a size-1 dim: no expansion
    assert offload.pack(single) is not single


def test_offload_matches_the_allocator_and_never_costs_more_than_keeping():
    peaks = {}
    for offload in (False, True):
        recipe = Recipe(offload_activations=offload)
        estimate = memfit.estimate(_factory, _batch(), loss_fn=_loss, recipe=recipe).peak_bytes
        truth = true_peak(_factory, _batch(), loss_fn=_loss, recipe=recipe)
        assert estimate == truth, (offload, estimate, truth)
        peaks[offload] = truth
    # the frozen weight (1024 x 64 fp32, 256 KiB) came back as a new copy before
    assert peaks[True] <= peaks[False], peaks
