"""Verified resharded loads keep narrow regions in private buffers, filling the budget up to a slab edge.

Row-split checkpoints (two simulated ranks) are loaded column-split with
verification on: the column halves of rows of 4 KiB (float32) and 2 KiB
(bfloat16) are narrower than pages, so they are read with exact device reads
into private buffers of ``thread_count x max_inflight_bytes`` and copied into
the targets once every byte of the load is hashed. A region that does not
fit whole keeps its leading rows (up to a slab edge of its tile grid); its
other rows are verified in place. Device reads are measured from
``/proc/self/io`` read_bytes with the files dropped from the page cache.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.core.distributed_checkpoint._format.safetensors_file import read_header
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError
from s3_server import s3_endpoint, s3_url  # noqa: F401  (fixtures)
from sim_ranks import simulate_save
from device_io import device_counts, fewest_device_bytes

#: Tile slabs of 64 rows for the narrow matrices (tiles of about 64 KiB).
_BLOCK = 64 << 10
#: name -> (global shape, dtype): column halves of 2 KiB and 1 KiB (narrow, 2 MiB and 1 MiB per stored chunk) and
#: of 8 KiB (whole pages).
_SHAPES = {"a": ((2048, 1024), "float32"), "b": ((2048, 1024), "bfloat16"), "w": ((256, 4096), "float32")}
_NARROW = 6 << 20  # bytes of a and b one rank needs
_NEEDED = _NARROW + (2 << 20)  # ... and of w


def _values(name: str) -> np.ndarray:
    (rows, cols), _ = _SHAPES[name]
    i, j = np.arange(rows)[:, None], np.arange(cols)[None, :]
    return ((i * 7 + j * 13 + len(name)) % 256).astype(np.float32)  # exact in bfloat16


def _tensor(values: np.ndarray, dtype: str) -> ms.Tensor:
    return ms.Tensor(values, ms.bfloat16 if dtype == "bfloat16" else ms.float32)


def _save_row_split(path) -> None:
    rows = Layout((2,), (0, -1))
    states = []
    for rank in range(2):
        state = {}
        for name, (shape, dtype) in _SHAPES.items():
            part = _values(name)[rank * shape[0] // 2:(rank + 1) * shape[0] // 2]
            state[name] = DTensor(_tensor(part, dtype), rows, shape, rank=rank)
        states.append(state)
    simulate_save(states, path, writer_options={"checksum_block_bytes": _BLOCK})


def _targets(rank: int, fill: float = 0.0) -> dict:
    cols = Layout((2,), (-1, 0))
    return {name: DTensor(_tensor(np.full((shape[0], shape[1] // 2), fill, np.float32), dtype), cols, shape,
                          rank=rank) for name, (shape, dtype) in _SHAPES.items()}


def _local(targets: dict, name: str) -> np.ndarray:
    return targets[name].to_local().asnumpy().astype(np.float32)


def _cold_load(path, rank: int, **options) -> int:
    """Device bytes of a cold column-split load on ``rank`` (bit-exact checked)."""

    def load() -> None:
        targets = _targets(rank)
        dcp.load(targets, storage_reader=dcp.FileSystemReader(path, **options), no_dist=True)
        for name, (shape, _) in _SHAPES.items():
            half = shape[1] // 2
            assert np.array_equal(_local(targets, name), _values(name)[:, rank * half:(rank + 1) * half]), name

    return fewest_device_bytes(path, load)


def test_row_split_loads_column_split_bit_exact_and_reads_the_needed_bytes(tmp_path):
    """Default settings (everything fits the budget), then budgets that fit one and a half narrow chunks."""
    _save_row_split(tmp_path)
    counts = device_counts(tmp_path)
    for rank in range(2):
        fetched = _cold_load(tmp_path, rank)
        if counts:  # metadata and headers: a few KiB on top
            assert fetched <= 1.05 * _NEEDED, (rank, fetched / _NEEDED)
    for threads, inflight in ((1, 5 << 19), (2, 5 << 18)):  # 2.5 MiB of private buffers in all
        budget = threads * inflight
        fetched = _cold_load(tmp_path, 0, thread_count=threads, max_inflight_bytes=inflight)
        if not counts:
            continue
        # Bytes beyond the budget cost their pages' other halves (2x); a region that does not fit whole keeps
        # its leading rows up to a slab edge (64 rows: 128 KiB at most). Whole regions only (the budget
        # rounded down to a chunk of 1 or 2 MiB, half a MiB more beyond it) would read at least 0.5 MiB more.
        assert fetched <= _NEEDED + (_NARROW - budget) + (192 << 10), (threads, fetched - _NEEDED)
        assert fetched >= _NEEDED + (_NARROW - budget) - (64 << 10), (threads, fetched - _NEEDED)


def _corrupt(path, name: str, rank: int, row: int) -> None:
    """Flip a byte of ``name``'s stored chunk of ``rank`` at local ``row``, column 0 (in column half 0)."""
    (shape, dtype) = _SHAPES[name]
    row_bytes = shape[1] * (2 if dtype == "bfloat16" else 4)
    for data_file in sorted(path.glob("*.safetensors")):
        entries, data_start = read_header(data_file)
        for key, entry in entries.items():
            if key == f"{name}@{rank * shape[0] // 2},0":  # the stored chunk's safetensors name
                offset = data_start + entry["data_offsets"][0] + row * row_bytes
                with open(data_file, "r+b") as handle:
                    handle.seek(offset)
                    byte = handle.read(1)
                    handle.seek(offset)
                    handle.write(bytes([byte[0] ^ 0x40]))
                return
    raise AssertionError(f"no stored chunk of {name} from rank {rank} in {sorted(p.name for p in path.iterdir())}")


@pytest.mark.parametrize("row", [3, 1000], ids=["kept-rows", "rows-beyond-the-budget"])
def test_corruption_in_a_partly_kept_region_raises_and_changes_no_target(tmp_path, row):
    """A flipped byte in the rows read into a private buffer or in the rows verified in place: the load
    raises naming the key and the file, and every target keeps its values."""
    _save_row_split(tmp_path)
    names = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(names) == 2, names
    _corrupt(tmp_path, "a", 0, row)
    targets = _targets(0, fill=5.0)
    # 1.25 MiB of private buffers: a's first chunk (2 MiB) keeps at most its first 640 rows, whichever comes first.
    reader = dcp.FileSystemReader(tmp_path, thread_count=1, max_inflight_bytes=5 << 18)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as caught:
        dcp.load(targets, storage_reader=reader, no_dist=True)
    assert "'a'" in str(caught.value) and ".safetensors" in str(caught.value), caught.value
    for name in _SHAPES:
        assert np.all(_local(targets, name) == 5.0), name


def test_object_storage_keeps_the_leading_slabs_and_fetches_only_the_rest_twice(s3_url):
    """Without a page cache every verified region is worth keeping: what does not fit is fetched once to be
    verified and once more to be copied. A region of two tile slabs (8 MiB) with 5 MiB of private buffer keeps
    its first slab (4 MiB): 12 MiB fetched instead of 16."""
    full = (np.arange(4096 * 1024, dtype=np.int64) % 65521).astype(np.float32).reshape(4096, 1024)  # slabs of 1024 rows
    dcp.save({"w": ms.Tensor(full)}, checkpoint_id=s3_url, no_dist=True)
    target = DTensor(ms.Tensor(np.zeros((2048, 1024), np.float32)), Layout((2,), (0, -1)), full.shape, rank=0)
    reader = dcp.FsspecReader(s3_url, thread_count=1, max_inflight_bytes=5 << 20)
    dcp.load({"w": target}, storage_reader=reader, no_dist=True)
    np.testing.assert_array_equal(target.to_local().asnumpy(), full[:2048])
    header = 4096  # the data file's safetensors header, checked against the metadata
    assert reader.bytes_fetched - header == (4 << 20) + 2 * (4 << 20), reader.bytes_fetched


def test_object_storage_keeps_a_0d_tensor_whole(s3_url):
    """A 0-d tensor is kept whole (it has no rows to split), next to a region split by the budget."""
    full = (np.arange(4096 * 1024, dtype=np.int64) % 65521).astype(np.float32).reshape(4096, 1024)
    dcp.save({"w": ms.Tensor(full), "s": ms.Tensor(np.float32(2.5))}, checkpoint_id=s3_url, no_dist=True)
    targets = {"s": ms.Tensor(np.float32(0)), "w": ms.Tensor(np.zeros((4096, 1024), np.float32))}
    reader = dcp.FsspecReader(s3_url, thread_count=1, max_inflight_bytes=5 << 20)
    dcp.load(targets, storage_reader=reader, no_dist=True)
    assert float(targets["s"].asnumpy()) == 2.5
    np.testing.assert_array_equal(targets["w"].asnumpy(), full)
