"""Estimates, plans and fits against the CPU allocator's own peaks: the truths memfit is graded by."""
