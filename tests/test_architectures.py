"""A sample of bench/accuracy/architectures.py's sweep over every architecture transformers ships: one dense,
one mixture-of-experts, one hybrid state-space and one multi-head-latent-attention model, each built
tiny from its own config class by the sweep's ``tiny_config``, estimated and graded by the CPU
allocator over the same two AdamW steps. Beside them, the configs transformers ships that memfit
once turned away or built the wrong head for.
"""

import os
import sys

import pytest
import torch

import memfit
from memfit.estimator.truth import true_peak
from memfit.models.source import resolve

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.accuracy.architectures import BATCH, SEQ, TOLERANCE, tiny_config  # noqa: E402


@pytest.mark.parametrize("model_type, cls", [
    ("qwen3", "Qwen3ForCausalLM"),  # dense
    ("qwen3_moe", "Qwen3MoeForCausalLM"),  # mixture of experts
    ("bamba", "BambaForCausalLM"),  # hybrid: Mamba-2 blocks beside attention
    ("deepseek_v3", "DeepseekV3ForCausalLM"),  # multi-head latent attention (and MoE)
])
def test_sampled_architecture_matches_allocator(model_type, cls):
    source = resolve(tiny_config(model_type, cls))
    torch.manual_seed(0)
    batch = source.make_batch(BATCH, SEQ)
    report = memfit.estimate(source, batch)
    assert type(source.build()).__name__ == cls
    truth = true_peak(source.build, batch)
    assert abs(report.peak_bytes - truth) / truth <= TOLERANCE, (report.peak_bytes, truth)
    assert report.unprobed_ops == 0


@pytest.mark.parametrize("model_type, cls, task", [
    ("marian", "MarianMTModel", "seq2seq"), ("flaubert", "FlaubertWithLMHeadModel", "masked-lm"),
    ("encoder-decoder", "EncoderDecoderModel", "seq2seq"), ("bart", "BartForConditionalGeneration", "seq2seq"),
])
def test_head_is_the_class_transformers_maps(model_type, cls, task):
    """Names that end in no known suffix, or in a misleading one, are looked up in transformers' mappings."""
    source = resolve(tiny_config(model_type, cls))
    assert source.task == task
    batch = source.make_batch(2, 8)  # EncoderDecoderConfig keeps its vocabulary in the decoder's config
    assert batch["input_ids"].max() < 256 and batch["labels"].shape == (2, 8)


@pytest.mark.parametrize("model_type", ["xlnet", "gemma3n_text", "gemma4_text"])
def test_shipped_configs_are_not_refused(model_type):
    """XLNet's max_position_embeddings=-1 (no table), Gemma-3n's per-layer intermediate_size and
    Gemma-4's per-layer head_dim (whose global read raises) are transformers' own defaults."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    assert resolve(config).task == "causal-lm"


def test_a_view_written_in_place_is_estimated():
    """DeepSeek-V3's attention fills a new tensor through two slices (``key[..., :n].copy_(k)``);
    reading the written slice's grad_fn inside the next op autograd runs used to wait for ever."""
    class Concat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

        def forward(self, x):
            a, b = self.a(x), self.b(x)
            out = a.new_empty(*a.shape[:-1], 12)
            out[..., :8].copy_(a)
            out[..., 8:].copy_(b)
            return out.square().sum()

    batch = torch.randn(4, 8)
    report = memfit.estimate(Concat, batch, loss_fn=lambda model, x: model(x))
    truth = true_peak(Concat, batch, loss_fn=lambda model, x: model(x))
    assert abs(report.peak_bytes - truth) / truth <= TOLERANCE, (report.peak_bytes, truth)


def test_gather_backward_scatters_in_place():
    """A plain run's gather backward scatters into its fresh zeros in place; under fake tensors
    autograd takes the out-of-place path, which held a second copy (Inkling: +11%)."""
    class Gathered(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 1024)

        def forward(self, x):
            index = torch.arange(32)[:, None].expand(2, 32, 32)
            return self.proj(x).gather(-1, index).square().sum()

    batch = torch.randn(2, 32, 16)
    report = memfit.estimate(Gathered, batch, loss_fn=lambda model, x: model(x))
    assert report.peak_bytes == true_peak(Gathered, batch, loss_fn=lambda model, x: model(x))


def test_a_count_compared_with_zero_reads_true():
    """I-BERT asserts ``x.isnan().sum() == 0`` on every activation: on fake tensors the count reads
    0, so the comparison must read True, not the False an unknown boolean gets."""
    class Checked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.proj(x)
            assert y.isnan().sum() == 0, "NaN"
            return y.square().sum()

    batch = torch.randn(4, 8)
    report = memfit.estimate(Checked, batch, loss_fn=lambda model, x: model(x))
    truth = true_peak(Checked, batch, loss_fn=lambda model, x: model(x))
    assert abs(report.peak_bytes - truth) / truth <= TOLERANCE, (report.peak_bytes, truth)
