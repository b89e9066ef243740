"""The docs cannot drift: every ```python block in docs/*.md and README.md runs, and docs/cli.md is
what the argparse parser renders.

A file's blocks run in order in one namespace (a page is one script), in a fresh directory, with
``s3://bucket/...`` served by the moto S3 server of the conftest fixtures. A block fenced
```python no-run is shown but not run (a multi-node launch, a path on your machine); keep them few.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
from conftest import wipe_ram

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)(.*)$")
RUN, SKIP = "python", "python no-run"


def python_blocks(path: Path) -> list[tuple[int, str, str]]:
    """(first line number, fence info, code) of every python block of a markdown page."""
    blocks, info, start, lines = [], None, 0, []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = FENCE.match(line)
        if info is None and m and m.group(1):
            info, start, lines = (m.group(1) + m.group(2)).strip(), n + 1, []
        elif info is not None and line.strip() == "```":
            if info.split()[0] == "python":
                blocks.append((start, info, "\n".join(lines) + "\n"))
            info = None
        elif info is not None:
            lines.append(line)
    return blocks


RUNNABLE = [p for p in PAGES if any(info == RUN for _, info, _ in python_blocks(p))]


def test_every_python_fence_is_runnable_or_marked_no_run():
    bad = [f"{p.name}:{n} ```{info}" for p in PAGES for n, info, _ in python_blocks(p) if info not in (RUN, SKIP)]
    assert not bad, f"python fences must be ```python (runs in the tests) or ```python no-run: {bad}"


@pytest.mark.parametrize("page", RUNNABLE, ids=[p.name for p in RUNNABLE])
def test_python_blocks_run(page: Path, tmp_path, s3_server, monkeypatch):
    import fsspec

    client = s3_server["client"]
    if "bucket" not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
        client.create_bucket(Bucket="bucket")
    monkeypatch.setitem(fsspec.config.conf, "s3", dict(s3_server["storage_options"], skip_instance_cache=True))
    monkeypatch.chdir(tmp_path)
    text = page.read_text()
    jobs = set(re.findall(r'CheckpointStore\(\s*"([^"]+)"', text))
    for job in jobs:
        wipe_ram(job)  # a page's stores start empty, whatever an earlier run left in /dev/shm
    namespace: dict = {"__name__": "__docs__"}
    try:
        for line, info, code in python_blocks(page):
            if info != RUN:
                continue
            with warnings.catch_warnings():
                # DCP's notice that it runs in a single process is what the page intends.
                warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
                # Lightning's notices about this tiny run (few workers, no logger), and a deprecation
                # inside its pytree helpers that torch 2.13 reports.
                warnings.filterwarnings("ignore", module=r"lightning(\.|$)")
                warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
                try:
                    exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), namespace)  # noqa: S102
                except Exception as exc:
                    raise AssertionError(f"the block at {page.relative_to(ROOT)}:{line} failed: {exc!r}") from exc
        closer = [v for v in namespace.values() if type(v).__name__ == "CheckpointStore"]
        for store in closer:
            store.close()
    finally:
        for job in jobs:
            wipe_ram(job)


def test_cli_reference_is_current():
    from ckptstore.cli_docs import REGENERATE, render

    current = (ROOT / "docs" / "cli.md").read_text()
    assert current == render(), f"docs/cli.md is stale (the CLI changed): regenerate it with `{REGENERATE}`"


def test_docs_link_to_pages_that_exist():
    missing = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+\.md)\)", page.read_text()):
            if not (page.parent / target).exists():
                missing.append(f"{page.name} -> {target}")
    assert not missing, missing

