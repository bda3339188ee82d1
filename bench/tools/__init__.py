"""Not benches of memfit's accuracy: the docs' pictures and a snapshot of every figure for refactors."""
