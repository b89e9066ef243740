"""The on-disk format: manifest schema, tagged-JSON tree, chunk codecs, checksums, single-file container.

Pure data transformations over bytes and JSON; no file or network I/O lives here.
"""
