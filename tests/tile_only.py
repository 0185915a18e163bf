"""Test helper: a checkpoint's tiled chunks without their flat block digests, as format 2.1 wrote them.

A load verifies a tiled chunk it reads whole by its flat block digests
(format 2.2, ``checksum.flat_digests``) when the checkpoint has them, by its
tiles otherwise. Tests of the tile path of whole reads (scattered slab reads,
tile windows shared between threads) take the flat digests out of
``metadata.json`` first: the member is optional, so the checkpoint stays valid.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["strip_flat_digests"]


def strip_flat_digests(path: Path) -> int:
    """Remove ``flat_digests`` from every in-line storage entry of checkpoint ``path``; return how many had one."""
    meta_path = Path(path) / "metadata.json"
    document = json.loads(meta_path.read_text())
    stripped = 0
    for entry in document["storage_data"]:
        checksum = entry.get("checksum") or {}
        if checksum.pop("flat_digests", None) is not None:
            stripped += 1
    meta_path.write_text(json.dumps(document, separators=(",", ":")))
    return stripped
