"""The embedding modules users hold, and their pure row math (row optimizers, resharding)."""
