"""memfit train: its speed against hand-written loops, on the CPU and on a GPU."""
