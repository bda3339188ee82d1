"""``memfit.estimate``: one entry for every workload, training and forward (``estimator/estimate.py``)
and generation (``generate.py``).

It lives here, not in ``estimator``, because the layers go one way: ``estimator`` (rank 5) may not
import ``generation`` (rank 7), and the public ``memfit.estimate`` has to reach both. Internal callers
(the CLI, the planner) call the training estimate or ``estimate_generate`` directly.
"""

from __future__ import annotations

from memfit.errors import MemfitError
from memfit.estimator.estimate import estimate as estimate_step
from memfit.generation.generate import estimate_generate

__all__ = ["estimate", "GENERATE_ONLY"]

#: Keywords of ``estimate_generate`` that a training step has no use for.
GENERATE_ONLY = ("prompt_len", "new_tokens", "cache", "weights", "padding", "logits_to_keep")
_GENERATE = GENERATE_ONLY + ("batch_size", "precision", "device", "moe_routing", "fast", "progress")


def estimate(model, batch=None, *, workload: str = "train", **kwargs):
    if workload != "generate":
        given = [name for name in GENERATE_ONLY if name in kwargs]
        if given:
            raise MemfitError(f"{given[0]}= is for workload='generate' (a Hugging Face generate), not "
                              f"workload={workload!r}: add workload='generate', or drop {given[0]}=")
        return estimate_step(model, batch, workload=workload, **kwargs)
    if batch is not None:
        raise MemfitError("workload='generate' makes its own prompt: drop batch= and give prompt_len= and "
                          "batch_size=")
    other = [name for name in kwargs if name not in _GENERATE]
    if other:
        raise MemfitError(f"{other[0]}= does not apply to workload='generate': it takes {', '.join(_GENERATE)}")
    for name in ("prompt_len", "new_tokens"):
        if name not in kwargs:
            raise MemfitError(f"workload='generate' needs {name}=: the prompt's tokens (prompt_len) and the tokens to "
                              "generate (new_tokens)")
    return estimate_generate(model, **kwargs)


estimate.__doc__ = (estimate_step.__doc__ or "") + """
    With ``workload="generate"`` the estimate is of a Hugging Face ``generate`` instead
    (``memfit.generation.estimate_generate``): ``prompt_len``, ``new_tokens`` (both required),
    ``batch_size`` (prompts), ``precision`` (``bf16``, ``fp16``, ``fp32``; default the config's dtype, else
    bf16), ``cache``, ``weights``,
    ``padding``, ``logits_to_keep``, ``moe_routing``, ``progress``; no ``batch`` or training settings.
    """
