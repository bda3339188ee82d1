"""How long memfit itself takes: estimates, plans, the depth fast path, device_map placement."""
