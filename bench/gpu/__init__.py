"""On a CUDA GPU: estimates made on a CPU against what the card allocates, reserves and holds outside torch."""
