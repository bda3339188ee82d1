"""What the page answers, without Gradio: a query read from the form, and its estimate, plan and
serving plan, kept in one bounded cache (``views.py`` turns them into the page's text).

A ``Query`` is the form checked: a bad value (a size that is not one, a batch of 0, an unknown card, a
recipe the techniques refuse) is a ``MemfitError`` here, before any tracing, and the page shows its one
line. ``Answers`` holds what the process keeps between requests: the last ``MAX_CACHED`` answers by
query (a repeated query answers at once), the planner's traces of the last models planned
(``EngineCache``), the timeline pages of the last ``MAX_PICTURES`` estimates, and uploaded configs,
each stored once by its content. Every memfit call runs under one lock (``Answers.lock``): a trace
patches torch for the whole process (``memfit.scoped``), so two at once would see each other's patches.

The timeline is the page ``memfit estimate --html`` writes (``report/pictures.py``), not a second
drawing of it: the page shows it in a frame, from a file this module writes.

Left out, because the page may be public (a Space): ``package.module:function`` models and
``trust_remote_code`` (both run code on the server) and paths on the server (a config.json is uploaded);
the command line takes all three. Also parallel runs (``--gpus``, ``--tp``...), which it plans.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
import tempfile
import threading
from pathlib import Path

from memfit.errors import MemfitError, shown
from memfit.units import format_size, parse_size

__all__ = ["Query", "Answers", "read_query", "MAX_CACHED", "MAX_PICTURES", "UPLOADED"]

MAX_CACHED = 32  # estimates, plans and serving plans kept, by query (a Report is a few hundred KiB at most)
MAX_PICTURES = 4  # timeline pages kept on disk: each inlines plotly.js (about 4.6 MB); older ones are redrawn
MAX_CONFIG = 4 * 2**20  # bytes of an uploaded config.json (the largest public ones are tens of KiB)
UPLOADED = "uploaded config.json"  # the model's name in the answers when it came as a file


@dataclasses.dataclass(frozen=True)
class Query:
    """The form, checked. Two queries that are equal get the same answers (``path`` is not compared:
    an uploaded file is known by its content, ``source``)."""

    source: str  # a catalog name, a Hub id, or "sha256:..." of an uploaded config.json
    name: str  # what the answers call the model
    gpu: str  # a card of the catalog: its CUDA semantics, memory and speeds
    budget: int | None  # bytes the process may use on the card, CUDA context included (None: the card's memory)
    batch_size: int  # examples per optimizer step
    seq_len: int | None  # tokens per example (None: the model's, at most 2048)
    recipe: object  # the memory techniques (a memfit Recipe) of the estimate; the plan searches its own
    path: str = dataclasses.field(default="", compare=False)  # what memfit is given as the model

    @property
    def model(self) -> str:
        return self.path or self.source


def read_query(model: str | None, upload: str | None, gpu: str, budget: str | None, batch_size, seq_len,
               store: Path, **techniques) -> Query:
    """The form's values as a ``Query``; ``upload`` (a config.json's path) wins over ``model`` and is
    copied into ``store`` under its content's hash. ``techniques``: Recipe fields."""
    from memfit.hardware.gpus import gpu as lookup
    from memfit.techniques.recipe import Recipe

    source, name, path = _model(model, upload, store)
    card = lookup((gpu or "").strip()).name
    size = parse_size(budget.strip()) if budget and budget.strip() else None
    return Query(source=source, name=name, gpu=card, budget=size, batch_size=_count("batch size", batch_size),
                 seq_len=_count("sequence length", seq_len) if seq_len not in (None, "", 0) else None,
                 recipe=Recipe(**techniques), path=path)


def _model(model: str | None, upload: str | None, store: Path) -> tuple[str, str, str]:
    """(source, name, path) of the model the form names."""
    if upload:
        if os.path.getsize(upload) > MAX_CONFIG:
            raise MemfitError(f"the file uploaded holds {format_size(os.path.getsize(upload))}: a model's config.json "
                              "is a few KiB; upload the config.json itself, not the weights")
        data = Path(upload).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        kept = store / digest[:16] / "config.json"  # memfit reads a file only by that name
        if not kept.exists():
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.write_bytes(data)
        return f"sha256:{digest}", UPLOADED, str(kept)
    text = (model or "").strip()
    if not text:
        raise MemfitError("no model: give a catalog name (memfit models), a Hugging Face Hub id (owner/name) "
                          "or upload a config.json")
    if os.path.exists(text) or text.endswith(".json"):  # the page may be public (a Space): no server paths
        raise MemfitError(f"{shown(text)} is a path on the server: upload the config.json instead")
    if ":" in text:
        raise MemfitError(f"{shown(text)} names code to run (package.module:function): the page takes a catalog "
                          "name, a Hub id or a config.json; run `memfit estimate` for your own model")
    return text, text, ""


def _count(what: str, value) -> int:
    """A positive whole number from a form field (Gradio gives floats)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = 0.0
    if not number.is_integer() or number < 1:
        raise MemfitError(f"{what} {shown(value)} is not a positive whole number: write it like 8")
    return int(number)


class Answers:
    """The answers of one process, kept between requests (see the module's docstring)."""

    def __init__(self, size: int = MAX_CACHED, pictures: int = MAX_PICTURES):
        from memfit.planner.cache import EngineCache

        self.size, self.pictures = size, pictures
        # held while memfit traces: a trace patches torch for the whole process, so a caller running memfit
        # beside the page in the same process (a notebook, a test) holds it too
        self.lock = threading.Lock()
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._pages: collections.OrderedDict = collections.OrderedDict()  # query -> its timeline page
        self._engines = EngineCache(size=4)  # the planner's traces of the last models planned
        self._dir = tempfile.TemporaryDirectory(prefix="memfit-ui-")  # removed with this object
        self.folder = Path(self._dir.name)
        self.pages = self.folder / "pages"  # the timeline pages: the only part of the folder the page serves
        self.pages.mkdir()

    def query(self, model, upload, gpu, budget, batch_size, seq_len, **techniques) -> Query:
        return read_query(model, upload, gpu, budget, batch_size, seq_len, self.folder / "uploads", **techniques)

    def warm(self, model: str) -> None:
        """Import what the answers need and trace one tiny step of ``model`` (8 tokens), so that the first
        answer costs what later ones do. Nothing is cached; a failure only leaves the first answer slower."""
        try:
            with self.lock:
                import memfit.generation.serve  # noqa: F401  (the serving plan's, imported for later)
                import memfit.planner.plan  # noqa: F401
                import memfit.report.pictures  # noqa: F401
                from memfit.generation.workloads import estimate

                estimate(model, seq_len=8, batch_size=1)
        except Exception:  # noqa: BLE001 — the answers themselves will say what is wrong, in one line
            logging.getLogger("memfit.ui").debug("warming up on %s failed", model, exc_info=True)

    def estimate(self, q: Query, progress=None):
        """The Report of ``q``'s training step on its card (``memfit.estimate``)."""
        def make():
            from memfit.estimator.inputs import Data, Hardware
            from memfit.generation.workloads import estimate

            return estimate(q.model, recipe=q.recipe, hardware=Hardware(gpu=q.gpu, budget=q.budget),
                            data=Data(batch_size=q.batch_size, seq_len=q.seq_len), progress=progress)
        return self._cached(("estimate", q), make)

    def plan(self, q: Query, allow: tuple[str, ...] = (), progress=None):
        """The fastest recipes for ``q``'s model, batch and card (``memfit.plan``); its optimizer is kept."""
        def make():
            from memfit.estimator.inputs import Data, Hardware
            from memfit.planner.plan import plan

            return plan(q.model, hardware=Hardware(gpu=q.gpu, budget=q.budget),
                        data=Data(batch_size=q.batch_size, seq_len=q.seq_len), allow=tuple(allow),
                        optimizer=q.recipe.optimizer, progress=progress, cache=self._engines)
        key = ("plan", q.source, q.gpu, q.budget, q.batch_size, q.seq_len, q.recipe.optimizer, tuple(sorted(allow)))
        return self._cached(key, make)

    def serve(self, q: Query, context, allow: tuple[str, ...] = ()):
        """How many requests of ``context`` tokens ``q``'s card holds when serving (``serve_plan``)."""
        tokens = _count("context", context)

        def make():
            from memfit.generation.serve import serve_plan

            return serve_plan(q.model, gpu=q.gpu, context=tokens, allow=tuple(allow), budget=q.budget)
        return self._cached(("serve", q.source, q.gpu, q.budget, tokens, tuple(sorted(allow))), make)

    def timeline(self, q: Query) -> Path:
        """The page ``memfit estimate --html`` writes for ``q`` (written once; the last few are kept)."""
        with self.lock:
            if q in self._pages:
                self._pages.move_to_end(q)
                return self._pages[q]
        report = self.estimate(q)
        from memfit.report.pictures import write_html

        with self.lock:
            name = hashlib.sha256(repr(q).encode()).hexdigest()[:16]
            path = write_html(report, self.pages / f"timeline-{name}.html", title=f"memfit estimate {q.name}")
            self._pages[q] = path
            while len(self._pages) > self.pictures:
                self._pages.popitem(last=False)[1].unlink(missing_ok=True)
        return path

    def _cached(self, key, make):
        with self.lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            value = make()  # under the lock: one trace at a time in this process
            self._cache[key] = value
            while len(self._cache) > self.size:
                self._cache.popitem(last=False)
            return value

    def close(self) -> None:
        """Remove the uploaded configs and the pages (also done when the object is collected)."""
        self._dir.cleanup()

