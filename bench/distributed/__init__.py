"""Per-rank estimates against real torchrun runs on this CPU (gloo): data, tensor, pipeline, context, expert parallel."""
