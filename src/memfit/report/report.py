"""``Report``: where the memory of a training step goes, estimated or measured.

One frozen type for both ``estimate`` and ``measure``, so they can be compared field by field.
Bytes are ints; ``str(report)``, ``to_dict()`` and ``_repr_html_()`` (a notebook's table) are the only
places they become text.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from html import escape

from memfit.categories import ALL_PHASES, Category
from memfit.units import format_size

__all__ = ["Report", "FITS", "EXPANDABLE", "OOM", "EXPANDABLE_CONF", "ERROR_SOURCE"]

# The verdict on a GPU (``estimator/verdict.py``): what torch's caching allocator does with the step.
FITS, EXPANDABLE, OOM = "fits", "fits_with_expandable_segments", "out_of_memory"
SWAP = "fits_by_swapping"  # a Mac: past the GPU's working set, under MPS's high watermark (hardware/mps.py)


def runs(verdict: str | None) -> bool:
    """Whether a step with this verdict runs as a search should count it: not out of memory, and (on a Mac) not by
    swapping, so a plan or a fit keeps the run out of swap."""
    return verdict not in (OOM, SWAP)
EXPANDABLE_CONF = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
# Where the margin of a tight fit comes from (``estimator.verdict.error_margin``).
ERROR_SOURCE = ("90th percentile of the reserved-memory error over 42 H100 runs "
                "(bench/results/gpu-accuracy-h100.json): 4.3 % of the estimate, at least 18 MiB")


@dataclass(frozen=True)
class Report:
    """The memory of ``steps`` training steps.

    peak_bytes      highest live bytes over all steps (step 1 has no optimizer state yet; the
                    steady state is step 2).
    by_category     bytes live at that peak, by :class:`~memfit.Category` value.
    phase_peaks     highest live bytes in each phase (forward, backward, optimizer) over all steps.
    step_peaks      highest live bytes of each step.
    modules         (module path, bytes) of activations and temporaries live at the peak, by the
                    module whose forward or backward created them, largest first.
    timeline        (event index, live bytes, phase, step), at most a few hundred points; each
                    point is the highest of the stretch it stands for.
    device          the device whose semantics the numbers follow ("cpu").
    method          "fake" (traced on fake tensors), "measured" (real tensors) or "depth"
                    (a few blocks traced, scaled by depth).
    modelled_bytes  kernel scratch inside ``peak_bytes``: replayed per op by the allocator
                    (see ``accounting/scratch.py``), not seen by the trace itself.
    unprobed_ops    distinct op calls too large to replay for scratch (their scratch is missing).
    parameters      number of parameter elements; ``trainable`` those with requires_grad.
    settings        what was run: precision, optimizer, steps, batch shapes.
    notes           what a reader should know about how these numbers were made.

    With CUDA semantics (``device == "cuda"``) ``peak_bytes`` is what ``max_memory_allocated``
    would report (each allocation rounded up to 512 bytes), and three more fields are set:
    reserved_bytes  the caching allocator's reserved peak (``max_memory_reserved``), modelled.
    context_bytes   the CUDA context of ``gpu``, outside the allocator (catalog figure).
    outside_bytes   all the process holds outside the allocator: the context and what the libraries the
                    step loads add (cuBLAS, attention and step kernels, NCCL); ``outside`` has it term by
                    term with ranges and sources (``hardware/outside.py``).
    gpu             the catalog GPU whose semantics were followed.
    ``device_bytes`` is what the device needs, what nvidia-smi shows: reserved + outside (``peak_bytes`` on
    the CPU).
    by_category, phase_peaks and modules are in unrounded bytes.

    The CUDA figures are those of the allocator replayed under the card's limit (``memfit/estimator/verdict.py``),
    so ``reserved_bytes`` never exceeds the card's memory less its context (with a budget and
    expandable segments torch itself can pass the budget by part of a 20 MiB page); the verdict fields:
    verdict         "fits", "fits_with_expandable_segments" (set
                    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) or "out_of_memory".
    capacity_bytes  what the allocator may hold: the card's memory (or ``budget_bytes``) less the context.
    budget_bytes    the budget asked for, context included (``set_per_process_memory_fraction``).
    retries         cudaFree-and-retry rounds torch would go through (each synchronises: slow).
    missing_bytes   on "out_of_memory": more memory that would let the step run.
    error_margin_bytes  headroom the measured estimation error asks for; ``tight`` when less is left.

    Managed memory (bitsandbytes' paged optimizer state, ``cudaMallocManaged``) is in neither
    ``peak_bytes`` nor ``reserved_bytes`` (torch's counters do not see it) nor ``by_category``:
    managed_bytes           its peak; None without any (always on CPU semantics: bnb does not page there).
    managed_resident_bytes  what must be on the device at once: the paged state of the parameter being
                            updated (the verdict requires reserved + this <= capacity).
    paged_bytes             what does not fit beside reserved and pages to the host each step.

    With ``lengths=`` or ``packed=True`` (``models/lengths.py``) the estimate is for one micro-batch shape,
    the worst one the lengths make:
    micro_batch     rows, length (padded length or pack size), packed, ragged (padding, or a row of two
                    or more documents: transformers builds a 4-D mask), index (0-based, in the order given),
                    count (micro-batches the lengths make) and tokens (real tokens in it).

    With ``gpus=`` (``parallel=ddp`` or ``fsdp``: ``techniques/parallel.py``) the numbers are one rank's,
    the rank with the highest peak (the one that runs out first):
    world           gpus (per node), nodes, size, parallel, rank (whose report this is), and how the model
                    was assumed built (construction).
    ranks           each distinct rank traced: rank, peak_bytes, by_category, phase_peaks (rank 0, and the
                    last rank when a parameter does not split evenly).

    With ``offload`` (FSDP2's ``CPUOffloadPolicy``) the shards, their gradients and the optimizer step are in
    host memory: with CUDA semantics ``peak_bytes``, ``reserved_bytes`` and the verdict are the GPU's side only;
    on the CPU, where both sides are one memory, ``peak_bytes`` is their sum.
    host_bytes      the host side's peak (host RAM the offloaded part needs).
    pinned_bytes    of it, what FSDP2 pins (the shards and their gradients; ``offload=cpu``).

    With ``device_map=`` (``techniques/device_map.py``: Accelerate's placement over GPUs, host and disk) the
    top-level figures are the GPU that needs the most, and:
    devices         one entry per device used: device ("cuda:0", "cpu", "disk"), peak_bytes, by_category, the
                    map's modules on it, and on a GPU reserved_bytes, device_bytes, verdict and missing_bytes.
    device_map      the placement: strategy, gpus, entries (module -> device, as from_pretrained takes it),
                    max_memory, and reported (the device whose figures the top level shows).
    host_bytes      host RAM of the modules offloaded to "cpu"; disk_bytes what lies in the offload folder.

    For pictures (``report/pictures.py``) and profiles (``profiling/``):
    stacked         the timeline's points by category: {"event": [...], "phase": [...], "step": [...],
                    "by_category": {category: [bytes at each point]}} (each point the highest of its stretch).
    top_allocations the largest storages live at the peak (a profile): bytes, category, module, site
                    ("file.py:LINE", the innermost frame of the user's code) and stack (innermost first).
    leaks           (a profile) memory that grows between the same points of consecutive steps:
                    site, bytes_per_step, steps (how many steps added to it), category, stack.
    reserved        (a CUDA profile) the allocator's reserved bytes over time: {"event": [...], "bytes": [...]}.

    For a generation (``memfit.generation.estimate_generate``, ``settings["workload"] == "generate"``):
    ``phase_peaks`` are ``prefill`` (the prompt's forward, an encoder's included) and ``decode``,
    ``step_peaks`` one per forward (the prefill, then each decode step), ``by_category`` holds ``kv_cache``,
    and ``settings`` the request: prompt_len, new_tokens, batch_size, precision, cache, weights, padding,
    logits_to_keep.

    For a checkpoint stored quantised (``quantization_config``: ``estimator/checkpoint.py``):
    checkpoint      format (e.g. "awq int4 g128"), method, bits, stored_weight_bytes (the weights as stored) and
                    training (what the estimate trains: QLoRA over the 4-bit base, or the weights dequantised).
    """

    peak_bytes: int
    by_category: dict[str, int]
    phase_peaks: dict[str, int]
    step_peaks: list[int]
    modules: list[tuple[str, int]]
    timeline: list[tuple[int, int, str, int]]
    device: str
    method: str
    modelled_bytes: int
    unprobed_ops: int
    parameters: int
    trainable: int
    settings: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    reserved_bytes: int | None = None
    context_bytes: int | None = None
    outside_bytes: int | None = None
    outside: dict | None = None
    gpu: str | None = None
    verdict: str | None = None
    capacity_bytes: int | None = None
    budget_bytes: int | None = None
    retries: int | None = None
    missing_bytes: int | None = None
    error_margin_bytes: int | None = None
    tight: bool | None = None
    managed_bytes: int | None = None
    managed_resident_bytes: int | None = None
    paged_bytes: int | None = None
    micro_batch: dict | None = None
    world: dict | None = None
    ranks: list | None = None
    host_bytes: int | None = None
    pinned_bytes: int | None = None
    devices: list | None = None
    device_map: dict | None = None
    disk_bytes: int | None = None
    checkpoint: dict | None = None
    stacked: dict | None = None
    top_allocations: list | None = None
    leaks: list | None = None
    reserved: dict | None = None

    @property
    def device_bytes(self) -> int:
        """Memory the device needs, what nvidia-smi shows: reserved + what the process holds outside the
        allocator on a GPU, the peak on the CPU."""
        if self.reserved_bytes is None:
            return self.peak_bytes
        return self.reserved_bytes + self.outside_total

    @property
    def outside_total(self) -> int:
        """Bytes outside torch's allocator: ``outside_bytes``, or the context alone where only it is known."""
        return self.outside_bytes if self.outside_bytes is not None else (self.context_bytes or 0)

    def device_line(self) -> str:
        """``allocated A, reserved R (torch's allocator) + outside it O (context c, cuBLAS b, ...) = D on the
        device``: the device's share, split between torch's allocator and the rest."""
        terms = (self.outside or {}).get("terms") or []
        parts = ", ".join(f"{t['name']} {format_size(t['bytes'])}" for t in terms)
        what = f"outside it {format_size(self.outside_total)}" + (f" ({parts})" if parts else " (CUDA context)")
        return (f"allocated {format_size(self.peak_bytes)}, reserved {format_size(self.reserved_bytes or 0)} "
                f"(torch's allocator) + {what} = {format_size(self.device_bytes)} on the device")

    @property
    def headroom_bytes(self) -> int | None:
        """``capacity_bytes - reserved_bytes``: what is left on the card (None without a verdict)."""
        if self.capacity_bytes is None or self.reserved_bytes is None:
            return None
        return self.capacity_bytes - self.reserved_bytes

    @property
    def bytes_per_parameter(self) -> float:
        """Peak bytes divided by the parameter count: 16 is fp32 AdamW model states alone."""
        return self.peak_bytes / max(self.parameters, 1)

    @property
    def model_state_bytes(self) -> int:
        """Parameters, gradients and optimizer state at the peak."""
        keys = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE)
        return sum(self.by_category.get(k.value, 0) for k in keys)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["modules"] = [{"module": m, "bytes": b} for m, b in self.modules]
        data["timeline"] = [
            {"event": e, "bytes": b, "phase": p, "step": s} for e, b, p, s in self.timeline
        ]
        data["bytes_per_parameter"] = round(self.bytes_per_parameter, 3)
        data["device_bytes"] = self.device_bytes
        data["headroom_bytes"] = self.headroom_bytes
        return data

    def _headline(self) -> list[str]:
        """The peak, and on a GPU the device's share, the verdict and managed memory: what the text
        and the HTML open with."""
        lines = [f"peak {format_size(self.peak_bytes)} ({self.method}, {self.device} semantics, "
                 f"{self.bytes_per_parameter:.1f} bytes/param over {self.parameters:,} params)"]
        if self.reserved_bytes is not None:
            lines.append(f"{self.gpu}: {self.device_line()}")
        if self.verdict is not None:
            lines.append(verdict_line(self))
        if self.managed_bytes:
            lines.append(f"managed memory (paged optimizer state, outside the peak): {format_size(self.managed_bytes)}")
        return lines

    def _categories(self) -> list[tuple[str, int]]:
        """(category, bytes) live at the peak, largest first, zeros left out."""
        return [(name, n) for name, n in sorted(self.by_category.items(), key=lambda kv: -kv[1]) if n]

    def __str__(self) -> str:
        lines = self._headline() + ["at the peak:"]
        lines += [f"  {name:<16} {format_size(nbytes):>12}" for name, nbytes in self._categories()]
        lines.append("phase peaks: " + ", ".join(
            f"{p} {format_size(self.phase_peaks[p])}" for p in ALL_PHASES if p in self.phase_peaks))
        if self.modules:
            lines.append("largest holders of activations and temporaries at the peak:")
            for name, nbytes in self.modules[:8]:
                lines.append(f"  {format_size(nbytes):>12}  {name}")
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """What a notebook shows: ``str(self)`` as self-contained HTML (no script, no stylesheet)."""
        return _html(self)


def _cells(tag: str, row: tuple) -> str:
    """One row of HTML cells: the first (a name) left, the figures right."""
    return "".join(f'<{tag} style="text-align:{"right" if i else "left"}">{escape(str(cell))}</{tag}>'
                   for i, cell in enumerate(row))


def _table(caption: str, head: tuple, rows: list[tuple]) -> str:
    body = "".join(f"<tr>{_cells('td', row)}</tr>" for row in rows)
    return (f'<table><caption style="text-align:left">{escape(caption)}</caption>'
            f"<thead><tr>{_cells('th', head)}</tr></thead><tbody>{body}</tbody></table>")


def _html(report: Report) -> str:
    head = report._headline()
    parts = [f"<p><b>{escape(head[0])}</b></p>"] + [f"<p>{escape(line)}</p>" for line in head[1:]]
    peak = max(report.peak_bytes, 1)
    parts.append(_table("at the peak", ("category", "bytes", "share"),
                        [(name, format_size(n), f"{100 * n / peak:.1f}%") for name, n in report._categories()]))
    phases = [p for p in ALL_PHASES if p in report.phase_peaks]
    parts.append(_table("phase peaks", ("phase", "peak"), [(p, format_size(report.phase_peaks[p])) for p in phases]))
    if report.modules:
        parts.append(_table("largest holders of activations and temporaries at the peak", ("module", "bytes"),
                            [(name, format_size(n)) for name, n in report.modules[:8]]))
    parts += [f"<p><i>note: {escape(note)}</i></p>" for note in report.notes]
    return '<div class="memfit-report">' + "".join(parts) + "</div>"


def target_line(report: Report) -> str:
    """The first line of an answer: whose semantics, which card and why that one, and the verdict's word."""
    how = report.settings.get("target")
    if report.gpu is None:
        return "CPU semantics: the CPU allocator's bytes (--device cpu)"
    said = {"visible": f"the {report.gpu}, the GPU torch sees",
            "default": f"the {report.gpu}: no GPU visible, so memfit's default card (--gpu NAME for yours, "
                       "--device cpu for the CPU's semantics)"}.get(how, f"the {report.gpu}")
    said += semantics_note(report.gpu)
    word = {FITS: "fits", EXPANDABLE: "fits only with expandable segments", OOM: "OUT OF MEMORY",
            SWAP: "fits only by swapping"}.get(report.verdict)
    if word is None or report.capacity_bytes is None:
        return f"on {said}"
    if report.verdict == SWAP:
        return (f"on {said}: {word}, {format_size(report.device_bytes)} is {format_size(report.missing_bytes or 0)} "
                f"past its {format_size(report.capacity_bytes)} working set (slower while macOS swaps)")
    if report.verdict in (FITS, OOM) and _vendor(report.gpu) == "apple":
        room = f"{format_size(report.capacity_bytes)} working set"
        if report.verdict == OOM:
            return f"on {said}: {word}, {format_size(report.missing_bytes or 0)} past MPS's high watermark"
        return f"on {said}: {word}, {format_size(report.device_bytes)} of its {room}"
    # the budget (what nvidia-smi would show) or the card; capacity + outside is the card's memory without one
    room = format_size(report.budget_bytes if report.budget_bytes is not None
                       else report.capacity_bytes + report.outside_total)
    if report.verdict == OOM:
        return f"on {said}: {word}, {format_size(report.missing_bytes or 0)} more than its {room} is needed"
    return f"on {said}: {word}, {format_size(report.device_bytes)} of its {room}"


def _card(name):
    from memfit.errors import MemfitError
    from memfit.hardware.gpus import gpu

    try:
        return gpu(name) if name else None
    except (MemfitError, TypeError):
        return None


def _vendor(name) -> str:
    card = _card(name)
    return "nvidia" if card is None else card.vendor


def semantics_word(report: Report) -> str:
    """Whose semantics a report's figures follow, in a word: cpu, cuda, rocm or mps."""
    if report.device != "cuda":
        return report.device
    return {"amd": "rocm", "apple": "mps"}.get(_vendor(report.gpu), "cuda")


def semantics_note(name) -> str:
    """What the first line says of a card that is not NVIDIA's: whose rules the figures follow."""
    card = _card(name)
    vendor = "nvidia" if card is None else card.vendor
    if vendor == "amd":
        from memfit.hardware.amd import fused_attention

        attention = ("AOTriton attention" if fused_attention(card) else
                     "SDPA's math path: AOTriton is experimental on gfx1100 (TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1)")
        workspace = format_size(card.blas_workspaces[0][1])
        return f" (ROCm semantics: CUDA's caching allocator, hipBLASLt's {workspace} workspaces, {attention})"
    if vendor == "apple":
        return " (MPS semantics: Metal heaps under the working set macOS gives the GPU; never run on a Mac)"
    return ""


def verdict_line(report: Report) -> str:
    """One line saying what torch would do with the step on the card (``report.verdict``)."""
    if _vendor(report.gpu) == "apple":
        return _mac_line(report)
    limit = (f"{format_size(report.capacity_bytes)} the allocator may hold on the {report.gpu}"
             + (f" within a {format_size(report.budget_bytes)} budget" if report.budget_bytes is not None else ""))
    if report.verdict == OOM:
        return f"out of memory: {limit}, and the step needs {format_size(report.missing_bytes or 0)} more"
    text = {FITS: "fits", EXPANDABLE: f"fits only with {EXPANDABLE_CONF}"}[report.verdict]
    text += f": reserved {format_size(report.reserved_bytes)} of {limit}"
    if report.retries:
        text += f"; torch frees its cache and retries {report.retries} time(s) in these steps (slow: each syncs the GPU)"
    if report.tight:
        text += (f"; tight: {format_size(report.headroom_bytes)} left is less than the measured error "
                 f"({format_size(report.error_margin_bytes)})")
    return text + managed_line(report)


def _mac_line(report: Report) -> str:
    """The verdict on a Mac (``estimator/mps_fit.py``): the heaps against the working set and the high watermark."""
    held = f"MPS's heaps hold {format_size(report.reserved_bytes)}"
    room = (f"the {format_size(report.capacity_bytes)} working set macOS gives the {report.gpu}'s GPU"
            + (f" (a {format_size(report.budget_bytes)} memory fraction)" if report.budget_bytes is not None else ""))
    if report.verdict == OOM:
        return (f"out of memory: {held} at the failure; the step needs {format_size(report.missing_bytes or 0)} more "
                f"than MPS's high watermark ({_high_watermark(report)})")
    if report.verdict == SWAP:
        return (f"fits only by swapping: {held}, {format_size(report.missing_bytes or 0)} past {room}: macOS swaps "
                f"what else is in RAM and the step slows; {_no_failure(report)}, so it does not fail")
    text = f"fits: {held} of {room}"
    if report.retries:
        text += f"; MPS frees its cached buffers {report.retries} time(s) to stay under its watermarks"
    return text


def _high_watermark(report: Report) -> str:
    """What set the high watermark of a Mac's out-of-memory verdict: a budget's memory fraction, or the ratio."""
    from memfit.hardware.mps import HIGH_ENV, HIGH_RATIO, environment_ratios

    if report.budget_bytes is not None:
        return f"the budget's {format_size(report.budget_bytes)}: torch.mps.set_per_process_memory_fraction"
    ratio = environment_ratios()[0]
    said = "its default" if ratio == HIGH_RATIO and HIGH_ENV not in os.environ else f"{HIGH_ENV} here"
    return f"{ratio:g} x the working set, {said}"


def _no_failure(report: Report) -> str:
    """Why a swapping Mac does not fail: under the high watermark, or none is set (the ratio 0.0)."""
    from memfit.hardware.mps import HIGH_ENV, environment_ratios

    unlimited = report.budget_bytes is None and environment_ratios()[0] == 0.0
    return f"no high watermark ({HIGH_ENV}=0.0)" if unlimited else "under the high watermark"


def managed_line(report: Report) -> str:
    """What the verdict says of managed memory (paged optimizer state), or "" without any."""
    if not report.managed_bytes:
        return ""
    text = (f"; paged optimizer state: {format_size(report.managed_bytes)} of managed memory outside reserved, "
            f"{format_size(report.managed_resident_bytes or 0)} of it on the device while its parameter updates")
    if report.paged_bytes:
        text += f"; {format_size(report.paged_bytes)} does not fit beside reserved and pages to the host each step"
    elif report.paged_bytes == 0:
        text += "; all of it stays on the card"
    return text
