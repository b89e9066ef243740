"""The 1.x writer of a store's durable step, kept as a fixture: it rewrites a committed format 2.0
step (manifest.json naming part files) as the writer before format 2.0 committed it: manifest.json
listing every chunk (format 1.1), and, optionally, index.json beside it. Old checkpoints must keep
loading, and this is how tests get one from today's writer."""

from __future__ import annotations

import json
from pathlib import Path

from ckptstore.checkpoint.index import build_index
from ckptstore.checkpoint.sharded import Directory, read_manifest
from ckptstore.format.checksum import checksum
from ckptstore.format.manifest import FORMAT_VERSION, layout_digest
from ckptstore.names import INDEX, MANIFEST


def downgrade(step_dir: Path, *, index: bool = True) -> bytes:
    """Rewrite ``step_dir``'s committed manifest in format 1.1 (with its index when ``index``);
    returns the new manifest's bytes."""
    manifest = read_manifest(Directory(str(step_dir), None))
    manifest.format_version = FORMAT_VERSION
    body = manifest.to_json_bytes()
    parts = []
    for path in sorted((step_dir / "parts").glob("*.json")):
        data = path.read_bytes()
        parts.append({**json.loads(data), "part_file": f"parts/{path.name}", "part_checksum": checksum(data)})
    (step_dir / MANIFEST).write_bytes(body)
    if index:
        built = build_index(manifest, parts, layout_digest(manifest))
        assert built is not None
        (step_dir / INDEX).write_bytes(built)
    return body
