import os

os.environ.setdefault("KINETO_LOG_LEVEL", "6")
# OpenMP's idle threads sleep instead of spinning: torch keeps its threads (the CPU kernels' scratch depends on their
# count, estimator/sharded.py), but on 2 cores shared by 2 pytest workers and their torchrun children a spinning
# thread burned the other worker's core (a Mamba truth: 5-30 s of CPU spinning, 1.2-2.3 s passive). Set before torch
# loads its OpenMP runtime; subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# memfit answers in CUDA semantics by default (the GPU torch sees, else h100-sxm). Most tests grade an
# estimate against this CPU's own allocator, so the suite's default is the CPU's, as a user without a GPU
# can ask (MEMFIT_DEVICE=cpu); tests/test_gpu_default.py unsets it to test the default itself.
os.environ["MEMFIT_DEVICE"] = "cpu"

try:
    from transformers.utils import logging

    logging.set_verbosity_error()
except ImportError:  # pragma: no cover
    pass


# The modules that take longest on 2 cores (module fixtures included), started first: pytest-xdist's loadscope
# hands modules out in collection order, and one of these picked up last kept a worker busy minutes after the
# other had finished (the suite's wall time is its longest worker's).
# test_compile and test_lowbit by their cost from a fresh clone (Inductor builds their C++ kernels cold: 277 and 116
# worker-s, against 63 and ~30 with its cache warm), as CI runs them
_LONGEST_FIRST = ("test_distributed", "test_plan", "test_compile", "test_pipeline_parallel", "test_train_speed",
                  "test_plan_mesh", "test_lowbit", "test_fit", "test_train_ranks", "test_families", "test_techniques",
                  "test_catalog_layers", "test_script", "test_accuracy", "test_expert_parallel", "test_docs",
                  "test_depth", "test_doctor", "test_recipe", "test_device_map", "test_context_parallel")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)) if item.module else len(rank))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def write_config(tmp_path_factory):
    """``write_config(config)``: a model config (a dict) written to a fresh folder's config.json, its path."""
    import json

    def write(config: dict) -> str:
        path = tmp_path_factory.mktemp("config") / "config.json"
        path.write_text(json.dumps(config))
        return str(path)

    return write


@pytest.fixture
def train_in_process(tmp_path, monkeypatch, capfd):
    """``train_in_process(args) -> (exit code, captured)``: ``memfit train ARGS --data TOKENS`` in this process, where
    ``--nproc-per-node`` runs torchrun's launcher in-process (as in a ``memfit`` process): only the ranks start
    Python. TOKENS: byte-level tokens (nanoGPT's uint16 .bin layout, as examples/make_tokens.py writes) of this
    file's own text. The ranks run one OpenMP thread each, quietly; torchrun's launcher installs its own handlers
    for SIGTERM/SIGINT/SIGHUP/SIGQUIT (to end its ranks): this process's are put back after each run."""
    import signal

    import numpy as np

    from memfit.cli import main

    data = tmp_path / "tokens.bin"
    np.frombuffer(open(__file__, "rb").read(), dtype=np.uint8).astype(np.uint16).tofile(data)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)

    def train(args):
        handlers = {sig: signal.getsignal(sig) for sig in signals}
        capfd.readouterr()
        try:
            code = main(["train", *map(str, args), "--data", str(data)])
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        return code, capfd.readouterr()

    return train
