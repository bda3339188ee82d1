"""Meet users in their trainers: read a trainer's config file into memfit's terms (``read.py``)."""
