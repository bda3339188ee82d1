"""Hugging Face generate and serving plans: estimates against the allocator, the fast path, vLLM's arithmetic."""
