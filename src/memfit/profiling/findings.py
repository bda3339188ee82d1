"""What ``memfit doctor`` answers: the cause vocabulary, a ``Fix``, a ``Diagnosis``, and the rules a message
alone decides (other processes, fragmentation). The reasoning that picks among them is ``doctor.py``; the
fixes estimated for a model are ``fixes.py``."""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.errors import MemfitError
from memfit.profiling.oom_text import OomMessage
from memfit.units import format_size

__all__ = ["CAUSES", "RECIPE_CAUSES", "Fix", "Diagnosis", "NoOomFound", "EXIT_FITS", "EXIT_NO_FIX", "EXIT_NO_OOM",
           "message_cause", "fragmentation_fix", "other_process_fix", "ALLOC_CONF", "SHARE", "PROFILE_SHARE",
           "LONG_FACTOR"]

CAUSES = ("model_states", "activations", "optimizer_temporaries", "fragmentation", "other_process", "leak",
          "eval_without_no_grad", "long_batch", "mps_limit", "unknown")
RECIPE_CAUSES = ("model_states", "activations", "optimizer_temporaries")
EXIT_FITS, EXIT_NO_FIX, EXIT_NO_OOM = 0, 3, 4
SHARE = 0.05  # of the capacity: other processes' or fragmented bytes below this are noise, not the cause
PROFILE_SHARE = 0.2  # of the live bytes at the OOM: a leak or a grad-enabled forward this large is the cause
LONG_FACTOR = 1.5  # tokens over the median step's that make the step that ran out a long batch
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


class NoOomFound(MemfitError):
    """The input holds no out-of-memory error (``memfit doctor`` exits 4)."""


@dataclass(frozen=True)
class Fix:
    """One way out, with what it buys.

    name          what it is ("checkpointing", "expandable_segments", "plan", ...)
    saves_bytes   device bytes it saves (the failing step's less the fixed one's); None when unknown
    fits          whether the fixed step fits (None: cannot be told from the evidence)
    speed_cost    fixed step time over the failing one's (1.0 = as fast), by the planner's cost model;
                  None when it does not time the technique changed, and for a fix that does not fit (not timed)
    recipe        the fixed ``Recipe.to_dict()``, for a recipe fix
    command       what to run or change
    changes_math  a technique that changes the math (8-bit states, LoRA, pure bf16)
    why           one line on what it does here
    """

    name: str
    saves_bytes: int | None
    fits: bool | None
    speed_cost: float | None = None
    recipe: dict | None = None
    command: str | None = None
    changes_math: bool = False
    why: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "saves_bytes": self.saves_bytes, "fits": self.fits,
                "speed_cost": None if self.speed_cost is None else round(self.speed_cost, 3), "recipe": self.recipe,
                "command": self.command, "changes_math": self.changes_math, "why": self.why}


@dataclass(frozen=True)
class Diagnosis:
    """The cause (one of ``CAUSES``), a line saying why with the figures, and the ranked fixes.

    figures   the message's figures (``OomMessage.to_dict()``), or the profile's OOM; {} without
    evidence  the numbers that decided: capacity_bytes, needed_bytes, model_state_bytes, phase_peaks...
    notes     what was assumed (a GPU guessed from the capacity) or left out
    """

    cause: str
    summary: str
    figures: dict = field(default_factory=dict)
    fixes: tuple[Fix, ...] = ()
    evidence: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def exit_code(self) -> int:
        return EXIT_FITS if self.cause != "unknown" and any(f.fits for f in self.fixes) else EXIT_NO_FIX

    def to_dict(self) -> dict:
        return {"cause": self.cause, "summary": self.summary, "figures": self.figures,
                "fixes": [f.to_dict() for f in self.fixes], "evidence": self.evidence, "notes": list(self.notes),
                "exit_code": self.exit_code}


def message_cause(message: OomMessage) -> tuple[str, str, Fix | None]:
    """(cause, summary, direct fix) from a message's figures alone: ``other_process``, ``fragmentation``
    or ``unknown``."""
    if message.kind == "mps" and message.requested is not None:
        return _mps_cause(message)
    if message.requested is None or message.capacity is None:
        return "unknown", f"{message.kind} out of memory, without figures to tell why", None
    free = message.free if message.free is not None else max(message.capacity - (message.this_process or 0), 0)
    fragmented = message.reserved_unallocated or 0
    room = free  # what the request could get: the device's free memory, or less under a cap
    if message.allowed is not None and message.allocated is not None:
        room = min(room, max(message.allowed - message.allocated - fragmented, 0))
    lacked = max(message.requested - room, 0)
    floor = SHARE * message.capacity
    others = message.other_bytes
    if others >= max(lacked, floor) and others >= fragmented and free < message.requested:
        return "other_process", (f"other processes hold {format_size(others)} of the card: the "
                                 f"{format_size(message.requested)} request lacked {format_size(lacked)}"), \
            other_process_fix(message, fits=others + free >= message.requested)
    if fragmented >= max(lacked, floor):
        return "fragmentation", (f"{format_size(fragmented)} is reserved by PyTorch but unallocated "
                                 f"(fragmented), more than the {format_size(lacked)} the "
                                 f"{format_size(message.requested)} request lacked"), \
            fragmentation_fix(fragmented, fits=fragmented + room >= message.requested)
    if message.requested > message.capacity:  # no setting, no freeing helps: what asked for it must shrink
        return "unknown", (f"the {format_size(message.requested)} request alone is more than the whole "
                           f"{format_size(message.capacity)} card: no setting or freeing helps, only a smaller "
                           "step"), None
    cap = "" if message.allowed is None else f" under the process's cap of {format_size(message.allowed)}"
    return "unknown", (f"the {format_size(message.requested)} request found {format_size(room)} free{cap} of "
                       f"{format_size(message.capacity)}; the message alone does not say what holds the rest"), None


def _mps_cause(message: OomMessage) -> tuple[str, str, Fix | None]:
    """An MPS message (``oom_text``): past MPS's own limit, the high watermark (``mps_limit``), or, with the limit
    disabled, Metal itself out of memory (``unknown``: the Mac's RAM)."""
    heaps, other, asked = message.mps_heaps or 0, message.mps_other or 0, format_size(message.requested)
    held = f"MPS's heaps hold {format_size(heaps)} and Metal {format_size(other)} more for the process"
    if message.allowed is None:
        return "unknown", (f"Metal refused the {asked} request with no MPS limit set (PYTORCH_MPS_HIGH_WATERMARK_RATIO="
                           f"0.0): {held}; the Mac's memory itself ran out"), None
    lacked = max(message.requested - (message.free or 0), 0)
    fix = Fix("mps_high_watermark", None, None, None, command="PYTORCH_MPS_HIGH_WATERMARK_RATIO=2.0 <your command>",
              why="raises MPS's limit from 1.7 to 2.0 x the GPU's recommended working set (its most): past that set "
                  "macOS swaps, slower, and may still fail; a smaller step is the lasting fix (pass the model)")
    return "mps_limit", (f"the {asked} request would take the process past MPS's limit of "
                         f"{format_size(message.allowed)} (the high watermark, PYTORCH_MPS_HIGH_WATERMARK_RATIO x the "
                         f"GPU's recommended working set): {held}; it lacked {format_size(lacked)}"), fix


def fragmentation_fix(saves: int, fits: bool | None, command: str = "<your command>") -> Fix:
    return Fix("expandable_segments", saves, fits, 1.0, command=f"{ALLOC_CONF} {command}",
               why="segments that grow in place: the reserved-but-unallocated memory serves the request")


def other_process_fix(message: OomMessage, fits: bool | None) -> Fix:
    pids = ", ".join(str(pid) for pid, _ in message.other_processes) or "?"
    index = message.device.split(":")[-1] if ":" in message.device else "0"
    return Fix("free_other_processes", message.other_bytes, fits, 1.0,
               command=f"nvidia-smi --query-compute-apps=pid,used_memory --format=csv -i {index}  # stop {pids}, "
                       f"or run on a free card: CUDA_VISIBLE_DEVICES=<free index>",
               why=f"process(es) {pids} hold {format_size(message.other_bytes)} of the card")


# -- from a profile --------------------------------------------------------------------------------------
