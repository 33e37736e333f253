"""One module per architecture family: how its weights map and how a layer computes (no I/O here)."""
