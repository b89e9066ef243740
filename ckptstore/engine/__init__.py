"""Execution: carrying out plans against storage (single-file containers now; the pipeline later)."""
