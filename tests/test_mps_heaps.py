"""accounting/mps_heaps.py and estimator/mps_fit.py: MPS's heaps replayed on hand-computed cases (the rules of
MPSAllocator.h/.mm as hardware/mps.py cites them), the Mac catalog's working sets against Metal's own logs and users'
"max allowed" figures, and a Mac's three verdicts. Never run on a Mac."""

import pytest

import memfit
from memfit.accounting.events import ALLOC, FREE, Record
from memfit.accounting.mps_heaps import replay_mps
from memfit.categories import Category
from memfit.errors import MemfitError
from memfit.estimator.verdict import cuda_fit as mps_fit  # a Mac is answered by estimator/mps_fit.py
from memfit.hardware.gpus import gpu
from memfit.hardware.mps import limits
from memfit.report.report import FITS, OOM, SWAP

KiB, MiB, GiB = 2**10, 2**20, 2**30


class _Log:
    """A ledger's events: ``steps`` is a list of ("a", name, bytes) and ("f", name)."""

    def __init__(self, *steps):
        self.records, self.events, index = [], [], {}
        for step in steps:
            if step[0] == "a":
                index[step[1]] = len(self.records)
                self.records.append(Record(step[2], Category.TEMPORARIES, "forward", 0, "m"))
                self.events.append((ALLOC, index[step[1]]))
            else:
                self.events.append((FREE, index[step[1]]))


@pytest.mark.parametrize("log, allocated, held", [
    (_Log(("a", "x", 4 * KiB)), 16 * KiB, 8 * MiB),  # a page, in an 8 MiB small heap
    (_Log(("a", "x", 2 * MiB), ("a", "y", 3 * MiB)), 5 * MiB, 32 * MiB),  # both in one 32 MiB heap
    (_Log(("a", "x", 100 * MiB), ("f", "x"), ("a", "y", 90 * MiB)), 100 * MiB, GiB),  # reused whole: counts 100
    (_Log(("a", "x", 100 * MiB), ("f", "x"), ("a", "y", 50 * MiB)), 100 * MiB, GiB),  # 50 MiB oversize: a new one
    (_Log(("a", "x", 600 * MiB)), 600 * MiB, 600 * MiB),  # past 512 MiB: a heap of its own
    (_Log(("a", "x", 100 * MiB), ("a", "y", 950 * MiB)), 1050 * MiB, GiB + 950 * MiB),
])
def test_heaps_a_step_opens(log, allocated, held):
    stats, oom = replay_mps(log)
    assert oom is None and (stats.peak_allocated, stats.peak_held) == (allocated, held)


def test_the_high_watermark_frees_the_cache_then_fails():
    cached = _Log(("a", "x", 600 * MiB), ("f", "x"), ("a", "y", 700 * MiB))
    stats, oom = replay_mps(cached, high=GiB)
    assert oom is None and stats.cache_releases == 1 and stats.peak_held == 700 * MiB  # the 600 MiB heap released
    stats, oom = replay_mps(_Log(("a", "x", 600 * MiB), ("a", "y", 600 * MiB)), high=GiB)
    assert oom is not None and oom.held == 600 * MiB


def test_under_memory_pressure_a_large_buffer_gets_a_heap_of_its_own():
    log = _Log(("a", "s", 8 * KiB), ("a", "x", 20 * MiB))
    assert replay_mps(log)[0].peak_held == 8 * MiB + GiB
    assert replay_mps(log, low=1)[0].peak_held == 8 * MiB + 20 * MiB  # past the low watermark: exact-size heaps


@pytest.mark.parametrize("mac, working, allowed", [
    ("m1-8gb", 8 * GiB * 2 // 3, 9.07),  # datalab-to/surya#254: "max allowed: 9.07 GB"
    ("m1-16gb", 16 * GiB * 2 // 3, 18.13),  # haoheliu/AudioLDM2#20, a 16 GB M1 Air: 18.13 GB
    ("m3-pro-18gb", 12 * GiB, 20.40),  # pytorch/pytorch#130112, an 18 GB Mac: 20.40 GB
    ("m3-max-36gb", 27 * GiB, None),  # llama.cpp's Metal log on a 36 GB Mac: 28991.03 MB
    ("m2-max-64gb", 48 * GiB, None),  # an M2 Max, 64 GB: 51539.61 MB
])
def test_working_sets_and_high_watermarks_against_published_logs(mac, working, allowed):
    card = gpu(mac)
    assert card.working_set_bytes == working and card.semantics == "MPS"
    if allowed is not None:
        assert round(limits(card.working_set_bytes).high / GiB, 2) == allowed


def test_a_mac_answers_in_three_words():
    mac = gpu("m1-8gb")  # working set 5.33 GiB, high watermark 9.07 GiB
    fit = mps_fit(_Log(("a", "w", 3 * GiB)), mac)
    assert fit.verdict == FITS and fit.reserved == 3 * GiB and fit.capacity_bytes == mac.working_set_bytes
    swap = mps_fit(_Log(("a", "w", 6 * GiB)), mac)
    assert swap.verdict == SWAP and swap.missing_bytes == 6 * GiB - mac.working_set_bytes
    oom = mps_fit(_Log(("a", "w", 6 * GiB), ("a", "v", 4 * GiB)), mac)
    assert oom.verdict == OOM and oom.missing_bytes == 10 * GiB - limits(mac.working_set_bytes).high
    budget = mps_fit(_Log(("a", "w", 3 * GiB)), mac, budget=2 * GiB)  # set_per_process_memory_fraction
    assert budget.verdict == OOM
    with pytest.raises(MemfitError, match="working set"):
        mps_fit(_Log(("a", "w", GiB)), mac, budget=64 * GiB)


def test_the_watermark_ratios_of_the_environment_decide_the_verdict(monkeypatch, capsys):
    """PYTORCH_MPS_HIGH/LOW_WATERMARK_RATIO as a user sets them for the run (MPSAllocator.mm lines 28-38, read with
    strtod): a lower high ratio fails what the default lets swap, 0.0 never fails; a ratio torch refuses, or one
    strtod would read as 0.0 (no limit), is one line, exit 2, before any tracing."""
    from memfit.cli import main
    from memfit.hardware.mps import environment_ratios

    mac = gpu("m1-8gb")  # working set 5.33 GiB, high watermark 9.07 GiB by default
    step = _Log(("a", "w", 6 * GiB), ("a", "v", GiB))
    assert mps_fit(step, mac).verdict == SWAP
    monkeypatch.setenv("PYTORCH_MPS_HIGH_WATERMARK_RATIO", "1.2")
    monkeypatch.setenv("PYTORCH_MPS_LOW_WATERMARK_RATIO", "1.0")
    assert environment_ratios() == (1.2, 1.0)
    tight = mps_fit(step, mac)
    assert tight.verdict == OOM and tight.missing_bytes == 7 * GiB - int(1.2 * mac.working_set_bytes)
    monkeypatch.setenv("PYTORCH_MPS_HIGH_WATERMARK_RATIO", "0.0")
    assert mps_fit(_Log(("a", "w", 30 * GiB)), mac).verdict == SWAP  # no limit: it swaps, never fails
    for high, low, says in (("2.5", None, "outside 0.0-2.0"), ("", None, "not a number: torch would read it as 0.0"),
                            ("1.0", None, "LOW_WATERMARK_RATIO=1.4 (its default) is above the high ratio 1.0"),
                            ("1.7", "x", "LOW_WATERMARK_RATIO='x' is not a number")):
        monkeypatch.setenv("PYTORCH_MPS_HIGH_WATERMARK_RATIO", high)
        if low is None:
            monkeypatch.delenv("PYTORCH_MPS_LOW_WATERMARK_RATIO", raising=False)
        else:
            monkeypatch.setenv("PYTORCH_MPS_LOW_WATERMARK_RATIO", low)
        assert main(["estimate", "gpt2", "--gpu", "m3-max-36gb"]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err


def test_mac_names_sizes_and_bad_ones():
    assert gpu("Apple M2 Ultra 192GB").name == "m2-ultra-192gb" and gpu("mac-48gb").memory_bytes == 48 * GiB
    for bad, says in (("m3-max-7gb", "36GB, 48GB, 64GB"), ("mac-2gb", "at least 8GB")):
        with pytest.raises(MemfitError, match=says):
            gpu(bad)


def test_an_estimate_on_a_mac_keeps_attention_weights_and_names_mps():
    import transformers as tf

    cfg = tf.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=1024, max_position_embeddings=256)
    mac = memfit.estimate(cfg, seq_len=256, batch_size=1, gpu="m3-max-36gb", precision="bf16-mixed", fast=False)
    card = memfit.estimate(cfg, seq_len=256, batch_size=1, gpu="h100-sxm", precision="bf16-mixed", fast=False)
    from memfit.report.report import target_line

    assert target_line(mac).startswith("on the m3-max-36gb (MPS semantics")
    assert not any("workspace" in m for m, _ in mac.modules)  # no cuBLAS on a Mac
    assert mac.verdict == FITS and mac.reserved_bytes % (16 * KiB) == 0
    # math attention keeps the S x S weights for backward: more than the card's step without its two cuBLAS workspaces
    assert mac.peak_bytes > card.peak_bytes - 2 * gpu("h100-sxm").cublas_workspace_bytes
    assert any("no fused attention kernel" in n for n in mac.notes)
