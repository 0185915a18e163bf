"""metadata_form="auto" counts the checksum digests of the in-line form, not only its entries.

A save of few chunks, each with many checksum blocks (large tensors: one digest per MiB by default), has an
in-line metadata.json far over the auto threshold; counted by entries alone it stayed in-line (at the limit its
commit was refused, though the indexed form would have committed).
"""

from __future__ import annotations

import json

import mindspore as ms
import numpy as np

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.core.distributed_checkpoint import _metadata_form
from sim_ranks import simulate_save

FULL = (np.arange(64 * 128, dtype=np.float32) * 0.25).reshape(64, 128)  # 32 KiB


def _save(path, ranks: int) -> None:
    states = [{"w": DTensor.from_global(ms.Tensor(FULL), Layout((ranks,), (0, -1)), rank=r), "step": 1}
              for r in range(ranks)]
    simulate_save(states, path, writer_options={"metadata_form": "auto", "checksum_block_bytes": 64})


def test_auto_counts_the_digests_of_the_inline_form(tmp_path, monkeypatch):
    monkeypatch.setattr(_metadata_form, "AUTO_INDEX_BYTES", 4096)
    path = tmp_path / "c"
    _save(path, 2)  # 3 entries (675 estimated bytes), but 512 digests of 64-byte blocks: ~10 KB in-line
    document = json.loads((path / "metadata.json").read_bytes())
    assert "rank_indexes" in document and len((path / "metadata.json").read_bytes()) < 4096
    assert document["state_dict_metadata"]["w"]["grid"]["splits"] == [2, 1]
    whole = {"w": np.zeros_like(FULL), "step": 0}
    dcp.load(whole, checkpoint_id=path, no_dist=True)
    assert np.array_equal(whole["w"], FULL) and whole["step"] == 1
    monkeypatch.setattr(_metadata_form, "AUTO_INDEX_BYTES", 64 << 10)  # the same save under a threshold it fits
    _save(tmp_path / "small", 2)
    inline = (tmp_path / "small" / "metadata.json").read_bytes()
    assert "rank_indexes" not in json.loads(inline) and len(inline) < 64 << 10
