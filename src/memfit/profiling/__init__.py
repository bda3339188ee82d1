"""Watching the user's own loop (``memfit profile``), the leak finder and ``memfit doctor``. Empty until
those land; it sits beside ``training``: above ``estimator``, below ``cli``."""
