"""What a run shows while it trains: a rich progress bar on stderr and TensorBoard scalars."""

from __future__ import annotations

from pathlib import Path

from memfit.errors import MemfitError

__all__ = ["Progress", "tensorboard_writer"]


def tensorboard_writer(out_dir: Path, wanted: bool | None):
    """A TensorBoard ``SummaryWriter`` in ``out_dir/tensorboard``, or None."""
    if wanted is False:
        return None
    try:
        import tensorboard  # noqa: F401  torch's writer needs the package
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if wanted:
            raise MemfitError("tensorboard=True needs the tensorboard package: pip install tensorboard") from None
        return None
    return SummaryWriter(str(out_dir / "tensorboard"))


class Progress:
    """A rich progress bar: step, loss, tokens/s, memory peak."""

    def __init__(self, total: int, done: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        # on stderr: stdout stays the command's answer (--json)
        self.progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                                 TimeRemainingColumn(), console=Console(stderr=True), transient=False)
        self.task = self.progress.add_task("train", total=total, completed=done, info="")
        self.progress.start()

    def update(self, done: int, loss: float, tokens_per_second: float, now: int | None, peak: int | None,
               predicted: int | None) -> None:
        from memfit.units import format_size

        memory = "" if peak is None else f"  memory {format_size(now)} now / {format_size(peak)} peak"
        if predicted is not None:
            memory += f" / {format_size(predicted)} predicted"
        self.progress.update(self.task, completed=done, info=f"loss {loss:.4f}  {tokens_per_second:,.0f} tok/s{memory}")

    def close(self) -> None:
        self.progress.stop()
