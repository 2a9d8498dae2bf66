"""The published Mac measurements (configs/reference/published.yaml) predicted by simulating what
each source ran, the Mac fit on them, and its cross-validation by source and chip."""
