"""``memfit serve-plan`` (generation/serve.py): the traced KV cache against the formula, the batch arithmetic,
vLLM's block arithmetic on a hand-checked example, the CLI's JSON and its one-line errors."""

import json

import pytest

from memfit.cli import main
from memfit.generation.serve import Measured, kv_bytes, max_batch, max_context, serve_plan, vllm_blocks

TINY = "examples/tiny-llama/config.json"  # 4 layers, 2 KV heads of 32: 2 x 4 x 2 x 32 x 2 = 1024 B/token
CARD = "rtx-4090"  # outside the allocator 616 MiB (context, cuBLAS, kernels) + cuBLAS workspace 8.125 MiB: a budget of 640 MiB leaves ~15.8 MiB
BUDGET = 640 * 2**20


@pytest.fixture(scope="module")
def plan():
    return serve_plan(TINY, gpu=CARD, context=256, budget=BUDGET, chunks=[64, 128])


def test_traced_kv_per_token_is_the_formula(plan):
    assert plan.kv_measured_per_token == plan.kv_analytic_per_token == 2 * 4 * 2 * 32 * 2
    row = plan.formats[0]
    assert row.kv_bytes_per_request == 1024 * 256


def test_chosen_batch_fits_and_one_more_does_not(plan):
    row = plan.formats[0]
    assert plan.chosen == "bf16" and row.max_batch > 0
    assert row.need_bytes <= plan.usable_bytes
    # one more request adds its cache (the transient never shrinks with the batch)
    assert row.need_bytes + row.kv_bytes_per_request > plan.usable_bytes
    assert row.max_batch == max(row.by_chunk.values()) and row.chunk in (64, 128)
    # the formula forgets activations, logits and the context: it promises more
    assert plan.analytic["max_batch"] > row.max_batch


def test_max_batch_and_context_by_hand():
    m = Measured(weights=1000, kv_per_token=10, kv_per_request=0, chunk={8: 300}, decode_base=50, decode_per_seq=5)
    # 1000 + B x 100 + max(300, 50 + 5B) <= 2000: B <= 7 (by the chunk), B <= 9 (by decode)
    assert max_batch(m, [None], 10, 8, 2000) == 7
    assert max_batch(m, [None], 10, 8, 1299) == 0
    # one request: 1000 + 10 L + 300 <= 2000 -> L = 70
    assert max_context(m, [None], 8, 2000) == 70
    # half the layers keep a window of 4 tokens: at 10 tokens they hold 4
    assert kv_bytes(m, [None, 4], 10) == 10 * (10 + 4) // 2


def test_vllm_block_arithmetic_by_hand():
    # 10 GiB x 0.9 = 9,663,676,416 B requested; less 4 GiB weights and 1 GiB profile peak:
    # 4,294,967,296 B over pages of 16 x 131,072 B = 2 MiB -> 2048 blocks; 8192 tokens = 512 blocks -> 4
    out = vllm_blocks(memory_bytes=10 * 2**30, utilization=0.9, weights=4 * 2**30, profile_peak=2**30,
                      kv_per_token=131072, block_size=16, context=8192, max_num_seqs=256)
    assert out["available_kv_bytes"] == 9663676416 - 5 * 2**30
    assert out["num_blocks"] == 2048 and out["blocks_per_request"] == 512
    assert out["max_requests"] == out["max_concurrency"] == 4


def test_cli_json_shape(capsys):
    assert main(["serve-plan", TINY, "--gpu", CARD, "--budget", "640MiB", "--context", "256", "--chunk", "64",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"model", "gpu", "context", "formats", "chosen", "vllm", "analytic"} <= set(data)
    assert data["chosen"] == "bf16" and data["formats"][0]["chunk"] == 64
    assert data["vllm"]["block_size"] == 16 and data["vllm"]["max_num_batched_tokens"] == 2048


def test_model_that_does_not_fit_says_how_many_cards(capsys):
    # 625 MiB leaves less than the 1.47 MiB of weights after context and workspace
    assert main(["serve-plan", TINY, "--gpu", CARD, "--budget", "625MiB", "--context", "64", "--chunk", "32",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"] is None and data["formats"][0]["max_batch"] == 0
    assert "--gpus 2" in data["placement"]["summary"]


@pytest.mark.parametrize("argv, words", [
    (["--context", "0"], "--context"),
    (["--context", "8", "--allow", "fp8"], "weight format 'fp8'"),
    (["--context", "8", "--gpu", "nope"], "unknown GPU 'nope'"),
    (["--context", "8", "--gpu-memory-utilization", "1.5"], "fraction"),
])
def test_bad_input_is_one_line(capsys, argv, words):
    try:
        code = main(["serve-plan", TINY] + argv)
    except SystemExit as exit:  # argparse's errors
        code = exit.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and words in err and "\n" not in err


def test_kv_layout_reads_sliding_layers():
    from transformers import Gemma3TextConfig

    from memfit.generation.serve import kv_layout

    config = Gemma3TextConfig(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                              sliding_window=8, hidden_size=64, intermediate_size=128, vocab_size=256)
    per_token, windows = kv_layout(config)
    assert per_token == 2 * 6 * 1 * 16 * 2
    assert windows == [8, 8, 8, 8, 8, None]  # Gemma 3: five local layers, then a global one
