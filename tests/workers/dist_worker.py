"""msrun worker for the distributed save/load tests (tests/test_distributed.py).

Usage: ``dist_worker.py PHASE BASE_DIR``. Phases run in this order across three
launches: ``two_first`` (2 ranks), ``four`` (4 ranks), ``two_last`` (2 ranks).
Each scenario returns plain values that the pytest side asserts.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import xxhash

from worker_lib import init_worker, run_scenarios

RANK, WORLD = init_worker()

import mindspore as ms  # noqa: E402  (after init_worker, which sets the device)

import hyper_parallel.core.distributed_checkpoint as dcp  # noqa: E402
import hyper_parallel  # noqa: E402
from hyper_parallel import DTensor, Layout  # noqa: E402

PHASE, BASE = sys.argv[1], Path(sys.argv[2])
FULL_X = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
FULL_Y = (np.arange(8 * 12, dtype=np.float32) * 0.5).reshape(8, 12)
BIAS = np.linspace(-1, 1, 8, dtype=np.float32)


def _param(array: np.ndarray, name: str) -> ms.Parameter:
    return ms.Parameter(ms.Tensor(array.copy()), name=name)


def _dtensor(full: np.ndarray, layout: Layout, name: str) -> DTensor:
    local = DTensor.from_global(full, layout, rank=RANK).to_local()
    return DTensor(_param(np.asarray(local), name), layout, full.shape)


def _zero_dtensor(full: np.ndarray, layout: Layout, name: str) -> DTensor:
    return DTensor(_param(np.zeros(layout.local_shape(full.shape), full.dtype), name), layout, full.shape)


def _expect(full: np.ndarray, target: DTensor) -> bool:
    local = target.to_local().asnumpy()
    box = tuple(slice(o, o + s) for o, s in zip(target.global_offset, local.shape))
    return bool(np.array_equal(local, full[box]))


def _failure(fn) -> dict:
    """Run ``fn`` expecting a failure on every rank; describe it."""
    start = time.monotonic()
    try:
        fn()
    except dcp.CheckpointError as exc:
        return {
            "type": type(exc).__name__,
            "failed_ranks": list(getattr(exc, "failed_ranks", ())),
            "message": str(exc),
            "is_missing_key": isinstance(exc, dcp.MissingKeyError),
            "is_validation": isinstance(exc, dcp.PlanValidationError),
            "seconds": time.monotonic() - start,
        }
    return {"type": None}


class FailingWriter(dcp.FileSystemWriter):
    """A writer whose disk is 'full' on one rank, or whose commit fails."""

    def __init__(self, path, *, fail_rank: int | None = None, fail_commit: bool = False) -> None:
        super().__init__(path)
        self.fail_rank = fail_rank
        self.fail_commit = fail_commit

    def write_data(self, plan, planner):
        if self.rank == self.fail_rank:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return super().write_data(plan, planner)

    def finish(self, metadata, results, *, background_cleanup=False):
        if self.fail_commit:
            raise OSError(errno.EIO, "I/O error during commit (injected)")
        return super().finish(metadata, results)


class FailingReader(dcp.FileSystemReader):
    """A reader that fails on one rank."""

    def __init__(self, path, *, fail_rank: int) -> None:
        super().__init__(path)
        self.fail_rank = fail_rank

    def read_data(self, plan, planner):
        if RANK == self.fail_rank:
            raise OSError(errno.EIO, "I/O error while reading (injected)")
        return super().read_data(plan, planner)


# ---------------------------------------------------------------- phase two_first (2 ranks)

def save_y() -> dict:
    layout = Layout((2,), (0, -1))
    bf = ms.Tensor(FULL_Y[:, :4], ms.bfloat16)
    from hyper_parallel.core.distributed_checkpoint._layout_merge import MERGE_STATS  # noqa: PLC0415

    state = {"y": _dtensor(FULL_Y, layout, "y"), "bf": bf, "bias": ms.Tensor(BIAS), "step": 7}
    before = (MERGE_STATS.by_layout, MERGE_STATS.fell_back)
    meta = dcp.save(state, checkpoint_id=BASE / "Y")
    return {"committed": (BASE / "Y" / "metadata.json").is_file(),
            "bytes_per_rank": list(meta.storage_meta.bytes_per_rank),
            "layout_merges": [MERGE_STATS.by_layout - before[0], MERGE_STATS.fell_back - before[1]]}


def async_loop() -> dict:
    layout = Layout((2,), (0, -1))
    param = _dtensor(FULL_Y, layout, "w")
    handles = []
    for step in range(5):
        param.to_local().asnumpy()[...] = step * 100.0 + RANK
        staging = "fork" if step % 2 else "copy"
        handles.append(dcp.async_save({"w": param, "step": step}, checkpoint_id=BASE / "async" / f"step{step}",
                                      staging=staging))
        param.to_local().asnumpy()[...] = -1.0  # the training step changes the tensor right away
    for handle in handles:
        handle.result()
    loaded = []
    for step in range(5):
        target = {"w": _zero_dtensor(FULL_Y, layout, "w"), "step": -1}
        dcp.load(target, checkpoint_id=BASE / "async" / f"step{step}")
        values = np.unique(target["w"].to_local().asnumpy()).tolist()
        loaded.append({"step": target["step"], "values": values})
    return {"loaded": loaded}


def plan_cache() -> dict:
    """Repeated saves of one layout reuse the plan on both ranks; a change on one rank re-plans on both."""
    from hyper_parallel.core.distributed_checkpoint._plan_cache import STATS  # noqa: PLC0415

    layout = Layout((2,), (0, -1))
    param = _dtensor(FULL_Y, layout, "w")
    counts = []
    for step in range(3):
        param.to_local().asnumpy()[...] = step * 10.0 + RANK
        dcp.save({"w": param, "rep": ms.Tensor(BIAS)}, checkpoint_id=BASE / "plan_cache" / f"s{step}")
        counts.append((STATS.reused, STATS.exchanged))
    extra = {"extra": ms.Tensor(np.ones(3, np.float32))} if RANK == 1 else {}  # only rank 1's plan changes
    dcp.save({"w": param, "rep": ms.Tensor(BIAS), **extra}, checkpoint_id=BASE / "plan_cache" / "changed")
    counts.append((STATS.reused, STATS.exchanged))
    handle = dcp.async_save({"w": param, "rep": ms.Tensor(BIAS), **extra}, checkpoint_id=BASE / "plan_cache" / "a")
    handle.result()
    counts.append((STATS.reused, STATS.exchanged))
    loaded = []
    for name in ("s0", "s1", "s2", "changed", "a"):
        target = {"w": _zero_dtensor(FULL_Y, layout, "w"), "rep": ms.Tensor(np.zeros(8, np.float32))}
        dcp.load(target, checkpoint_id=BASE / "plan_cache" / name)
        loaded.append((np.unique(target["w"].to_local().asnumpy()).tolist(),
                       bool(np.array_equal(target["rep"].asnumpy(), BIAS))))
    return {"counts": [[r - counts[0][0], e - counts[0][1]] for r, e in counts], "loaded": loaded}


def async_early_copies() -> dict:
    """Repeated async saves of replicated Parameters: from the second save on, each rank copies early (while
    planning) exactly the replicas it writes; the checkpoints hold the values of each call."""
    from hyper_parallel.core.distributed_checkpoint import _async_engine  # noqa: PLC0415

    pool = _async_engine._POOL  # pylint: disable=protected-access
    layout = Layout((2,), (0, -1))
    state = {f"r{i}": _param(np.zeros((8, 4 + i), np.float32), f"r{i}") for i in range(6)}
    state["w"] = _dtensor(FULL_Y, layout, "w")
    counts = []
    for step in range(3):
        for param in state.values():
            (param.to_local() if isinstance(param, DTensor) else param).asnumpy()[...] = step * 10.0
        before = (pool.early_copied, pool.early_items)
        handle = dcp.async_save(state, checkpoint_id=BASE / "early" / f"s{step}")
        for param in state.values():
            (param.to_local() if isinstance(param, DTensor) else param).asnumpy()[...] = -1.0
        handle.result()
        counts.append([pool.early_copied - before[0], pool.early_items - before[1]])
    # A grown state: the early copies fill the arena, the new 4 MiB replica gets a buffer of its own.
    state["big"] = _param(np.full((1024, 1024), 30.0, np.float32), "big")
    for name, param in state.items():
        if name != "big":
            (param.to_local() if isinstance(param, DTensor) else param).asnumpy()[...] = 30.0
    handle = dcp.async_save(state, checkpoint_id=BASE / "early" / "s3")
    for param in state.values():
        (param.to_local() if isinstance(param, DTensor) else param).asnumpy()[...] = -1.0
    handle.result()
    loaded = []
    for step in range(4):
        target = {f"r{i}": _param(np.ones((8, 4 + i), np.float32), f"r{i}") for i in range(6)}
        target["w"] = _zero_dtensor(FULL_Y, layout, "w")
        if step == 3:
            target["big"] = _param(np.zeros((1024, 1024), np.float32), "big")
        dcp.load(target, checkpoint_id=BASE / "early" / f"s{step}")
        values = {float(v) for p in target.values()
                  for v in np.unique((p.to_local() if isinstance(p, DTensor) else p).asnumpy())}
        loaded.append(sorted(values))
    return {"counts": counts, "loaded": loaded}


def async_deleted_tensors() -> dict:
    state = {"a": ms.Tensor(np.full((64, 64), 3.0, np.float32)), "b": np.full(10, 5, np.int64)}
    handle = dcp.async_save(state, checkpoint_id=BASE / "async_del")
    state["b"][...] = 0
    del state
    handle.result()
    target = {"a": np.zeros((64, 64), np.float32), "b": np.zeros(10, np.int64)}
    dcp.load(target, checkpoint_id=BASE / "async_del")
    return {"a": float(target["a"].mean()), "b": target["b"].tolist()}


def async_write_failure() -> dict:
    path = BASE / "async_fail"
    dcp.save({"v": ms.Tensor(np.ones(16, np.float32))}, checkpoint_id=path)  # an earlier complete checkpoint
    handle = dcp.async_save({"v": ms.Tensor(np.full(16, 9.0, np.float32))},
                            storage_writer=FailingWriter(path, fail_rank=1))
    info = _failure(handle.result)
    target = np.zeros(16, np.float32)
    dcp.load({"v": target}, checkpoint_id=path)
    info["old_values"] = target.tolist()
    return info


def no_collectives() -> dict:
    state = {"mine": np.full(4, RANK, np.int32), "step": RANK}
    dcp.save(state, checkpoint_id=BASE / "local", use_collectives=False)
    target = {"mine": np.zeros(4, np.int32), "step": -1}
    dcp.load(target, checkpoint_id=BASE / "local", use_collectives=False)
    hyper_parallel.platform.barrier()  # rank-local saves do not wait for each other
    return {"mine": target["mine"].tolist(), "step": target["step"],
            "files": sorted(os.listdir(BASE / "local"))}


def one_liners() -> dict:
    from mindspore import nn  # pylint: disable=import-outside-toplevel

    ms.set_seed(5)
    net = nn.Dense(4, 3)
    hyper_parallel.save_checkpoint(net, BASE / "oneline")
    other = nn.Dense(4, 3)
    hyper_parallel.load_checkpoint(BASE / "oneline", net=other)
    whole = hyper_parallel.load_checkpoint(BASE / "oneline")
    return {"same": all(np.array_equal(p.asnumpy(), other.parameters_dict()[k].asnumpy())
                        for k, p in net.parameters_dict().items()),
            "keys": sorted(whole), "weight_sum": float(whole["weight"].asnumpy().sum()),
            "expected_sum": float(net.weight.asnumpy().sum())}


# ---------------------------------------------------------------- phase four (4 ranks)

FULL_S = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)


def save_mapping() -> dict:
    """A ShardedTensor (rows over 4 ranks) and a flattened-range optimizer state (2 row shards x 2 flat parts)."""
    st = dcp.ShardedTensor.from_rank_offsets("decoder.w", FULL_S[RANK * 2:(RANK + 1) * 2].copy(), (0, RANK, 4))
    shard = FULL_S[(RANK // 2) * 4:(RANK // 2 + 1) * 4].reshape(-1)
    rng = slice(0, 10) if RANK % 2 == 0 else slice(10, 24)
    flat = dcp.ShardedTensor("optim.exp_avg", shard[rng].copy(), "float32", (4, 6), (8, 6), ((RANK // 2) * 4, 0),
                             (2, 1), flattened_range=rng)
    dcp.save({"model": {"w": st}, "optim": [flat], "rng": dcp.ShardedObject("rng", RANK * 11, (4,), (RANK,))},
             checkpoint_id=BASE / "mapping")
    return {"ok": True}


def load_y_on_four() -> dict:
    layout = Layout((2, 2), (1, 0))
    target = {"y": _zero_dtensor(FULL_Y, layout, "y"), "bf": ms.Tensor(np.zeros((8, 4), np.float32)), "step": 0}
    dcp.load(target, checkpoint_id=BASE / "Y")
    bf_expected = ms.Tensor(FULL_Y[:, :4], ms.bfloat16).asnumpy().astype(np.float32)
    bf_ok = bool(np.array_equal(target["bf"].asnumpy(), bf_expected))
    return {"ok": _expect(FULL_Y, target["y"]), "bf_ok": bf_ok, "step": target["step"]}


def replicated_bytes() -> dict:
    state = {f"rep{i}": ms.Tensor(np.full(1024, i, np.float32)) for i in range(40)}
    meta = dcp.save(state, checkpoint_id=BASE / "rep")
    sizes = {}
    for name in os.listdir(BASE / "rep"):
        if name.endswith(".safetensors"):
            sizes.setdefault(name[:6], 0)
            sizes[name[:6]] += (BASE / "rep" / name).stat().st_size
    return {"bytes_per_rank": list(meta.storage_meta.bytes_per_rank), "file_bytes": sizes}


def single_replica_read() -> dict:
    """Every rank loads the whole replicated state; each byte is read from storage once."""
    target = {f"rep{i}": np.zeros(1024, np.float32) for i in range(40)}
    reader = dcp.FileSystemReader(BASE / "rep")
    planner = dcp.StandardLoadPlanner(single_replica_read=True, exchange_round_bytes=16 << 10)
    dcp.load(target, storage_reader=reader, planner=planner)
    full = {"model": {"x": np.zeros((16, 8), np.float64)}}  # all ranks want the whole of X, as float64
    reader_x = dcp.FileSystemReader(BASE / "X")
    dcp.load(full, storage_reader=reader_x, planner=dcp.StandardLoadPlanner(single_replica_read=True,
                                                                             allow_partial_load=True))
    return {"ok": all(np.all(target[f"rep{i}"] == i) for i in range(40)), "bytes_read": reader.bytes_read,
            "x_ok": bool(np.array_equal(full["model"]["x"], FULL_X.astype(np.float64))),
            "x_bytes_read": reader_x.bytes_read}


def dedup_modes() -> dict:
    state = {f"r{i}": ms.Tensor(np.full(256, i, np.float32)) for i in range(8)}
    out = {}
    for mode, kwargs in {"min": {"save_to_minimum_rank": True}, "all": {"remove_redundancy": False},
                         "balanced": {}}.items():
        meta = dcp.save(state, checkpoint_id=BASE / f"dedup_{mode}", **kwargs)
        target = {f"r{i}": np.zeros(256, np.float32) for i in range(8)}
        dcp.load(target, checkpoint_id=BASE / f"dedup_{mode}")
        out[mode] = {"bytes": list(meta.storage_meta.bytes_per_rank),
                     "ok": all(np.all(target[f"r{i}"] == i) for i in range(8))}
    return out


def save_x() -> dict:
    layout = Layout((2, 2), (1, 0))
    state = {"model": {"x": _dtensor(FULL_X, layout, "x"), "bias": ms.Tensor(BIAS)}, "step": 42}
    meta = dcp.save(state, checkpoint_id=BASE / "X")
    kind = type(meta).__name__  # the coordinator's committed metadata; elsewhere a view read when used
    return {"visible_after_return": (BASE / "X" / "metadata.json").is_file(), "kind": kind,
            "chunks": len(meta.state_dict_metadata["model.x"].chunks),
            "same_as_committed": meta == dcp.read_metadata(BASE / "X")}


class ReceivingWriter(dcp.FileSystemWriter):
    """Records what its commit received from each rank (type and pickled bytes); ``built`` makes the coordinator
    build the index files from every rank's write results (the path before record-only gathers)."""

    def __init__(self, path, *, built: bool = False, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.built = built
        self.received: list = []
        self.gathered: list = []

    def wants_rank_indexes(self, metadata):
        return False if self.built else super().wants_rank_indexes(metadata)

    def finish(self, metadata, results, **kwargs):
        self.received = [(type(r).__name__, len(pickle.dumps(r))) for r in results]
        return super().finish(metadata, results, **kwargs)

    def committed_metadata(self, metadata, results):
        self.gathered.append([type(r).__name__ for r in results])  # by the commit, and by an async result()
        return super().committed_metadata(metadata, results)


def _normalised_files(path: Path) -> dict:
    """The checkpoint's files (index digests checked, then blanked; its save id replaced by ``ID``), as text."""
    document = json.loads((path / "metadata.json").read_bytes())
    save_id = document["save_id"]
    for record in document["rank_indexes"]:
        data = (path / record["file"]).read_bytes()
        assert record["digest"] == xxhash.xxh3_64_hexdigest(data) and record["length"] == len(data)
        record["digest"] = "D"
    out = {name.replace(save_id, "ID"): (path / name).read_bytes().replace(save_id.encode(), b"ID").hex()
           for name in sorted(os.listdir(path)) if not name.startswith(".") and name != "metadata.json"}
    out["metadata.json"] = json.dumps(document).replace(save_id, "ID")
    return out


def save_x_indexed() -> dict:
    """save_x's state in the indexed metadata form (format 2.1): grid tensors, one index file per rank, each
    written by its rank (the commit receives a summary per rank); the same save with the index files built by the
    coordinator from every rank's results gives the same files."""
    layout = Layout((2, 2), (1, 0))
    state = {"model": {"x": _dtensor(FULL_X, layout, "x"), "bias": ms.Tensor(BIAS)}, "step": 42}
    path = BASE / "Xi"
    writer = ReceivingWriter(path, metadata_form="indexed")
    meta = dcp.save(state, checkpoint_id=path, storage_writer=writer)
    built = ReceivingWriter(BASE / "Xi_built", metadata_form="indexed", built=True)
    dcp.save(state, checkpoint_id=BASE / "Xi_built", storage_writer=built)
    target = {"model": {"x": _zero_dtensor(FULL_X, layout, "x"), "bias": np.zeros(8, np.float32)}, "step": 0}
    dcp.load(target, checkpoint_id=path)
    same_files = _normalised_files(path) == _normalised_files(BASE / "Xi_built") if RANK == 0 else None
    kept = {}
    for by_coordinator in (False, True):  # replicas kept: every rank writes bias, rank 0 (the lowest) indexes it
        where = BASE / ("Xi_kept_built" if by_coordinator else "Xi_kept")
        kept[by_coordinator] = ReceivingWriter(where, metadata_form="indexed", built=by_coordinator)
        dcp.save(state, checkpoint_id=where, storage_writer=kept[by_coordinator], remove_redundancy=False)
    same_kept = _normalised_files(BASE / "Xi_kept") == _normalised_files(BASE / "Xi_kept_built") if RANK == 0 else None
    return {"indexes": sorted(n.split(".")[0] for n in os.listdir(path) if "_index." in n),
            "grid": "grid" in (path / "metadata.json").read_text(),
            "chunks": len(meta.state_dict_metadata["model.x"].chunks),
            "kind": type(meta).__name__, "same_as_committed": meta == dcp.read_metadata(path),
            "ok": _expect(FULL_X, target["model"]["x"]), "bias": target["model"]["bias"].tolist(),
            "step": target["step"],
            "received": writer.received, "received_built": built.received, "same_files": same_files,
            "received_kept": kept[False].received, "same_kept": same_kept}


def async_indexed_and_corrupt_index() -> dict:
    """4-rank async saves in the indexed form (copy and fork staging: rank results reach the background commit
    through results records), loaded resharded; then rank 3's index file is damaged: every rank fails, no target
    changed (the index is read while planning, before any target changes)."""
    layout = Layout((2, 2), (1, 0))
    loaded = []
    for staging in ("copy", "fork"):
        path = BASE / f"async_indexed_{staging}"
        writers = {}
        for built in (True, False):  # the index files built by the coordinator, then written by each rank
            where = path.with_name(path.name + "_built") if built else path
            writers[built] = ReceivingWriter(where, metadata_form="indexed", built=built)
            handle = dcp.async_save({"x": _dtensor(FULL_X, layout, "x"), "step": 6}, checkpoint_id=where,
                                    staging=staging, storage_writer=writers[built])
            handle.result()
        target = {"x": _zero_dtensor(FULL_X, Layout((4,), (0, -1)), "x"), "step": 0}
        dcp.load(target, checkpoint_id=path)  # also settles the background commits
        same = _normalised_files(path) == _normalised_files(path.with_name(path.name + "_built")) if RANK == 0 else None
        loaded.append({"ok": _expect(FULL_X, target["x"]), "step": target["step"],
                       "indexes": sorted(n.split(".")[0] for n in os.listdir(path) if "_index." in n),
                       "received": writers[False].received, "received_built": writers[True].received,
                       "gathered": writers[False].gathered, "same_files": same})
    path = BASE / "async_indexed_copy"
    if RANK == 3:  # damage its own index before the load starts (the load's planning is collective)
        name = next(n for n in os.listdir(path) if n.startswith("r00003_index."))
        data = bytearray((path / name).read_bytes())
        data[len(data) // 2] ^= 0x01
        (path / name).write_bytes(bytes(data))
    target = {"x": DTensor(_param(np.full((8, 4), 7, np.float32), "x"), layout, FULL_X.shape), "step": "keep"}
    info = _failure(lambda: dcp.load(target, checkpoint_id=path))
    info["untouched"] = bool(np.all(target["x"].to_local().asnumpy() == 7)) and target["step"] == "keep"
    return {"loaded": loaded, **info}


def save_failure_planning() -> dict:
    state = {"a": ms.Tensor(np.ones(4, np.float32))}
    if RANK == 2:
        state["weird"] = object()
    else:
        state["weird"] = 1
    return _failure(lambda: dcp.save(state, checkpoint_id=BASE / "fail_plan"))


def save_failure_write() -> dict:
    info = _failure(lambda: dcp.save({"a": ms.Tensor(np.ones(4, np.float32)), "b": np.full(4, 2)},
                                     storage_writer=FailingWriter(BASE / "fail_write", fail_rank=1)))
    info["committed"] = (BASE / "fail_write" / "metadata.json").exists()
    return info


def save_failure_commit() -> dict:
    info = _failure(lambda: dcp.save({"a": ms.Tensor(np.ones(4, np.float32))},
                                     storage_writer=FailingWriter(BASE / "fail_commit", fail_commit=True)))
    info["committed"] = (BASE / "fail_commit" / "metadata.json").exists()
    return info


def load_failure_missing_key() -> dict:
    target = {"model": {"x": _zero_dtensor(FULL_X, Layout((4,), (0, -1)), "x")}}
    if RANK == 3:
        target["nope"] = np.zeros(2)
    return _failure(lambda: dcp.load(target, checkpoint_id=BASE / "X"))


def load_failure_read() -> dict:
    target = {"model": {"x": _zero_dtensor(FULL_X, Layout((4,), (0, -1)), "x")}}
    return _failure(lambda: dcp.load(target, storage_reader=FailingReader(BASE / "X", fail_rank=1)))


def load_corrupt_on_one_rank() -> dict:
    """Rank 3's chunk is corrupt: every rank fails, and no rank's targets (tensor nor value) changed."""
    layout = Layout((4,), (0, -1))
    path = BASE / "corrupt_rank3"
    dcp.save({"x": DTensor.from_global(ms.Tensor(FULL_X), layout), "step": 5}, checkpoint_id=path)
    if RANK == 3:  # flip a byte of its own chunk before the load starts (the load's planning is collective)
        info = next(v for k, v in dcp.read_metadata(path).storage_data.items() if k.fqn == "x" and k.offset[0] == 12)
        data = bytearray((path / info.relative_path).read_bytes())
        data[info.offset + 3] ^= 0x10
        (path / info.relative_path).write_bytes(bytes(data))
    target = {"x": DTensor(_param(np.full((4, 8), 7, np.float32), "x"), layout, FULL_X.shape), "step": "keep"}
    info = _failure(lambda: dcp.load(target, checkpoint_id=path))
    info["untouched"] = bool(np.all(target["x"].to_local().asnumpy() == 7)) and target["step"] == "keep"
    return info


def differing_value() -> dict:
    return _failure(lambda: dcp.save({"step": RANK % 2, "a": np.ones(2)}, checkpoint_id=BASE / "differ"))


# ---------------------------------------------------------------- phase two_last (2 ranks)

def load_x_on_two() -> dict:
    layout = Layout((2,), (-1, 0))  # columns, where the save split rows and columns over 4 ranks
    target = {"model": {"x": _zero_dtensor(FULL_X, layout, "x"), "bias": np.zeros(8, np.float32)}, "step": 0}
    reader = dcp.FileSystemReader(BASE / "X", verify_checksums=False)
    dcp.load(target, storage_reader=reader)
    return {"ok": _expect(FULL_X, target["model"]["x"]), "bias": target["model"]["bias"].tolist(),
            "step": target["step"], "bytes_read": reader.bytes_read,
            "needed": target["model"]["x"].to_local().asnumpy().nbytes + BIAS.nbytes}


def load_x_indexed_on_two() -> dict:
    layout = Layout((2,), (-1, 0))  # columns, where the save split rows and columns over 4 ranks
    target = {"model": {"x": _zero_dtensor(FULL_X, layout, "x"), "bias": np.zeros(8, np.float32)}, "step": 0}
    dcp.load(target, checkpoint_id=BASE / "Xi")
    return {"ok": _expect(FULL_X, target["model"]["x"]), "bias": target["model"]["bias"].tolist(),
            "step": target["step"]}


def load_mapping_on_two() -> dict:
    layout = Layout((2,), (-1, 0))
    target_dt = _zero_dtensor(FULL_S, layout, "w")
    # Each rank holds all 8 rows flattened, split in two flat halves of different size than the save's.
    rng = slice(0, 20) if RANK == 0 else slice(20, 48)
    flat = dcp.ShardedTensor("optim.exp_avg", np.zeros(rng.stop - rng.start, np.float32), "float32", (8, 6),
                             (8, 6), (0, 0), (1, 1), flattened_range=rng)
    objs = [dcp.ShardedObject("rng", None, (4,), (k,)) for k in (RANK * 2, RANK * 2 + 1)]
    state = {"decoder.w": target_dt, "flat": flat, "objs": objs}
    dcp.load(state, checkpoint_id=BASE / "mapping")
    return {"dtensor_ok": _expect(FULL_S, target_dt),
            "flat_ok": bool(np.array_equal(flat.data, FULL_S.reshape(-1)[rng])),
            "objs": state["objs"]}


PHASES = {
    "two_first": [save_y, async_loop, async_early_copies, async_deleted_tensors, async_write_failure, no_collectives,
                  one_liners, plan_cache],
    "four": [load_y_on_four, replicated_bytes, dedup_modes, save_x, save_failure_planning, save_failure_write,
             save_failure_commit, load_failure_missing_key, load_failure_read, differing_value, save_mapping,
             single_replica_read, load_corrupt_on_one_rank, save_x_indexed,
             async_indexed_and_corrupt_index],
    "two_last": [load_x_on_two, load_mapping_on_two, load_x_indexed_on_two],
}

run_scenarios({fn.__name__: fn for fn in PHASES[PHASE]})
