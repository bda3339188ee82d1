"""``measure``: the memory of real training steps, accounted tensor by tensor.

The same step and the same ledger as ``estimate``, on real tensors: the model trains in place
(its weights change, as in any step). Kernel scratch is replayed per op exactly as for an
estimate, so an estimate and a measurement of the same step can be compared field by field. The
independent truth that grades both is the allocator (``memfit.truth``), not this function.
"""

from __future__ import annotations

from memfit.errors import MemfitError
from memfit.estimator.checks import check_args, step_batch
from memfit.models.source import resolve
from memfit.techniques.recipe import Recipe, recipe_from
from memfit.report.report import Report
from memfit.estimator.trace import trace

__all__ = ["measure"]


def measure(model, batch=None, *, loss_fn=None, optimizer="adamw", precision: str = "fp32",
            steps: int = 2, batch_size: int | None = None, seq_len: int | None = None,
            recipe: Recipe | None = None) -> Report:
    """Run ``steps`` real training steps and account every live storage.

    Arguments as for :func:`memfit.estimate`; a catalog or config model is built for real
    (random weights), which takes its full memory.
    """
    check_args(precision, steps, batch_size, seq_len)
    recipe, factory = recipe_from(recipe, precision, optimizer)
    if recipe.compile:  # the ledger sees the dispatcher; Inductor's wrapper allocates past it
        raise MemfitError("compile and measure conflict: Inductor's compiled code allocates its buffers outside "
                          "the dispatcher that measure's ledger watches; use memfit.estimate with the recipe")
    batch_size = step_batch(batch_size, recipe)
    source = resolve(model)
    module = source.build()
    if batch is None:
        if source.config is None:
            raise MemfitError("measure needs a batch for this model: pass batch=")
        batch = source.make_batch(batch_size, seq_len)
    elif callable(batch):
        batch = batch()
    report, _ = trace(module, batch, recipe=recipe, loss_fn=loss_fn, optimizer=factory,
                      steps=steps, method="measured")
    return report
