"""Bad input is one MemfitError line that names the fix."""

import pytest
import torch
import torch.nn as nn

import memfit
from memfit.errors import MemfitError
from memfit.models.zoo import MLP, classify

BATCH = (torch.randn(4, 256), torch.randint(0, 10, (4,)))


def _one_line(err):
    text = str(err.value)
    assert "\n" not in text and text
    return text


def test_batch_the_model_rejects_gives_the_models_message():
    with pytest.raises(MemfitError) as err:
        memfit.estimate(MLP, (torch.randn(4, 7), torch.randint(0, 10, (4,))), loss_fn=classify)
    assert "rejected the batch" in _one_line(err) and "7" in str(err.value)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x[x.sum(1) > 0]).sum()  # boolean mask: output shape depends on values


def test_op_that_cannot_run_on_fake_tensors_names_the_op_and_measure():
    with pytest.raises(MemfitError) as err:
        memfit.estimate(DataDependent, torch.randn(4, 8), loss_fn=lambda m, b: m(b))
    text = _one_line(err)
    assert "aten." in text and "measure" in text
    # and measure does run it
    assert memfit.measure(DataDependent, torch.randn(4, 8), loss_fn=lambda m, b: m(b)).peak_bytes > 0


def test_loss_that_is_not_a_scalar():
    with pytest.raises(MemfitError, match="scalar") as err:
        memfit.estimate(MLP, BATCH, loss_fn=lambda m, b: m(b[0]))
    _one_line(err)


def test_tuple_batch_without_loss_fn_asks_for_one():
    with pytest.raises(MemfitError, match="loss_fn") as err:
        memfit.estimate(MLP, BATCH)
    _one_line(err)


@pytest.mark.parametrize("kwargs, word", [({"precision": "fp8"}, "precision"), ({"optimizer": "lion"}, "optimizer"),
                                          ({"steps": 0}, "steps"), ({"batch_size": -1}, "batch_size"),
                                          ({"device": "tpu"}, "device"), ({"gpu": "rtx-9999"}, "rtx-4090")])
def test_bad_arguments(kwargs, word):
    with pytest.raises(MemfitError, match=word):
        memfit.estimate(MLP, BATCH, loss_fn=classify, **kwargs)


def test_bad_model_argument():
    with pytest.raises(MemfitError, match="nn.Module"):
        memfit.estimate(42, BATCH)
    with pytest.raises(MemfitError, match="package.module:function"):
        memfit.estimate("nowhere.at_all:build", BATCH)


def test_estimate_leaves_the_users_model_alone():
    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    memfit.estimate(model, BATCH, loss_fn=classify)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
