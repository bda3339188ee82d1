"""memfit against peak-memory figures others measured on GPUs and published (the rows are data, quoted)."""
