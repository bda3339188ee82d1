"""Many GPUs for real: ``truth.py`` runs a recipe's step under ``torchrun`` and reads each rank's
allocator. FSDP2 / DDP wrapping is a technique (``techniques/parallel.py``) and the cluster a step
runs on is ``hardware/cluster.py``, so estimate, apply and train share them; this package sits
beside ``training``: above ``planner``, below ``cli``."""
