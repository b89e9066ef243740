"""The public entry points (re-exported by ckptstore/__init__.py)."""
