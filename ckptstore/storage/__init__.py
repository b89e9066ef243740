"""Where bytes go: local paths, binary file objects and fsspec URLs behind one small sink/source API."""
