"""The tiered asynchronous engine: CheckpointStore and the parts it is made of (options, the
pipeline and its lanes, restore selection, retention, the cross-node exchange)."""
