"""The record-only commit of the indexed form: each rank writes its own index file, the coordinator gets a summary.

Simulated ranks (tests/sim_ranks.py) run the plan, write and commit steps of
``dcp.save``; the checkpoint they commit is compared byte for byte (save ids
aside) with the one the coordinator builds from every rank's write results.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle

import mindspore as ms
import numpy as np
import pytest
import xxhash

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.core.distributed_checkpoint._index_plan import RankIndexSummary, plan_index, record_only_metadata
from hyper_parallel.core.distributed_checkpoint._metadata_form import plan_wants_index
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError, CorruptCheckpointError
from s3_server import new_filesystem, s3_endpoint, s3_url  # noqa: F401  (fixtures)
from sim_ranks import plan_ranks, simulate_save

FULL = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
STACKED = np.arange(8 * 3, dtype=np.float32).reshape(8, 3) * -1


def _states(ranks: int = 4, layout: Layout = Layout((2, 2), (1, 0)), tensors: int = 1) -> list[dict]:
    states = []
    for rank in range(ranks):
        state = {f"w{k}": DTensor.from_global(ms.Tensor(FULL + k), layout, rank=rank) for k in range(tensors)}
        state["rep"] = ms.Tensor(np.full((3, 2), 5.0, np.float32))  # a replica on every rank: one writer
        # a Megatron-style tensor (a general item of the layout-form plan), rows over the ranks: a grid tensor too
        state["st"] = dcp.ShardedTensor.from_rank_offsets("st", STACKED[2 * rank:2 * rank + 2].copy(), (0, rank, ranks))
        state["scale"] = ms.Tensor(np.float32(2.5))  # a 0-d tensor: no grid, its entry stays in-line
        state["step"] = 7
        states.append(state)
    return states


def _files(path, save_id: str) -> dict[str, bytes]:
    """Every file of the checkpoint, the save id in names and contents replaced by ``ID``.

    The digests of the index files (which name the save id) are checked against the files by an independent
    ``xxhash`` call, then replaced by ``D``.
    """
    out = {}
    for name in sorted(os.listdir(path)):
        if name.startswith("."):
            continue
        out[name.replace(save_id, "ID")] = (path / name).read_bytes().replace(save_id.encode(), b"ID")
    document = json.loads((path / "metadata.json").read_bytes())
    for record in document.get("rank_indexes", []):
        data = (path / record["file"]).read_bytes()
        assert record["digest"] == xxhash.xxh3_64_hexdigest(data) and record["length"] == len(data)
        record["digest"] = "D"
    out["metadata.json"] = json.dumps(document).replace(save_id, "ID").encode()
    return out


def _save_both(tmp_path, states, **kwargs):
    """The coordinator-built and the record-only checkpoint of ``states``; each committed metadata and its files."""
    out = []
    for record_only in (False, True):
        path = tmp_path / ("record" if record_only else "built")
        sent: list = []
        committed, written = simulate_save(states, path, rank_indexes=record_only, sent=sent, **kwargs)
        out.append((committed, _files(path, committed.storage_meta.save_id), sent, written))
    return out


def _kind_recording(seen: list) -> type:
    """A filesystem writer class whose commit appends to ``seen`` what rank 0 sent (its type name)."""

    class Recording(dcp.FileSystemWriter):
        def finish(self, metadata, results, **kwargs):
            seen.append(type(results[0]).__name__)
            return super().finish(metadata, results, **kwargs)

    return Recording


def _load_all(path, ranks: int, layout: Layout, tensors: int = 1) -> None:
    for rank in range(ranks):
        for k in range(tensors):
            param = ms.Parameter(ms.Tensor(np.zeros(layout.local_shape(FULL.shape), np.float32)), name="w")
            target = DTensor(param, layout, FULL.shape, rank=rank)
            state = {f"w{k}": target, "rep": np.zeros((3, 2), np.float32), "step": 0,
                     "st": np.zeros((8, 3), np.float32), "scale": np.zeros((), np.float32)}
            dcp.load(state, checkpoint_id=path, no_dist=True)
            assert np.array_equal(state["st"], STACKED) and float(state["scale"]) == 2.5
            rows, cols = param.shape
            offset = target.global_offset
            assert np.array_equal(param.asnumpy(), (FULL + k)[offset[0]:offset[0] + rows, offset[1]:offset[1] + cols])
            assert np.all(state["rep"] == 5.0) and state["step"] == 7


@pytest.mark.parametrize("layout_form", [False, True])
def test_record_only_commit_writes_the_same_checkpoint_as_the_coordinator(tmp_path, layout_form):
    states = _states(tensors=3)
    (built, built_files, built_sent, _), (record, record_files, sent, _) = _save_both(
        tmp_path, states, writer_options={"metadata_form": "indexed"}, layout_form=layout_form)
    assert all(isinstance(s, RankIndexSummary) for s in sent)
    assert all(isinstance(s, list) for s in built_sent)
    assert record_files == built_files  # metadata.json, every index file and data file, byte for byte
    assert sorted(n for n in record_files if "_index." in n) == [f"r0000{r}_index.ID.json" for r in range(4)]
    document = json.loads(record_files["metadata.json"])
    assert sorted(e["fqn"] for e in document["storage_data"]) == ["scale", "step"]
    assert "grid" in document["state_dict_metadata"]["w0"] and "grid" not in document["state_dict_metadata"]["scale"]
    assert record.state_dict_metadata == built.state_dict_metadata
    assert [(r.rank, r.length) for r in record.storage_data.records.values()] == [
        (r.rank, r.length) for r in built.storage_data.records.values()]
    # the coordinator's returned metadata looks entries up from the files (it never held them)
    assert record.storage_data[dcp.MetadataIndex("w1", (4, 6))].relative_path.startswith("r00003_")
    for layout, ranks in ((Layout((2, 2), (1, 0)), 4), (Layout((2,), (-1, 0)), 2)):
        _load_all(tmp_path / "record", ranks, layout, tensors=3)


def test_coordinator_receives_the_same_bytes_whatever_the_chunk_count(tmp_path):
    """What the commit receives per rank: write results grow with the chunks, a summary does not."""
    sizes = {}
    for tensors in (4, 64):
        (_, _, built_sent, _), (_, _, sent, _) = _save_both(
            tmp_path / str(tensors), _states(tensors=tensors), writer_options={"metadata_form": "indexed"},
            layout_form=True)
        sizes[tensors] = ([len(pickle.dumps(s)) for s in built_sent], [len(pickle.dumps(s)) for s in sent])
    built_small, record_small = sizes[4]
    built_large, record_large = sizes[64]
    assert all(b > 16 * 100 for b in built_large)  # ~131 bytes per chunk and more
    assert max(record_large) == max(record_small) and max(record_large) < 1500  # O(1) per rank
    # Rank 0 also sends the in-line entries (the replicated tensor and the step it writes): a few, whatever the chunks.
    assert all(r < b for r, b in zip(record_large, built_large))


@pytest.mark.parametrize("layout_form", [False, True])
def test_replicas_kept_each_chunk_indexed_by_its_lowest_writer(tmp_path, layout_form):
    """``remove_redundancy=False``: every holder writes its replica; the lowest lists it in its index (the
    coordinator-built form keeps the first in rank order), told by a held bitmask with its plan."""
    states = _states(layout=Layout((2, 2), (0, -1)), tensors=2)  # rows over one axis, the other a replica axis
    (built, built_files, _, written), (_, record_files, sent, record_written) = _save_both(
        tmp_path, states, writer_options={"metadata_form": "indexed"}, remove_redundancy=False,
        layout_form=layout_form)
    assert all(isinstance(s, RankIndexSummary) for s in sent)
    assert record_files == built_files and written == record_written
    # w0, w1: row half 0 on ranks 0 and 2, half 1 on ranks 1 and 3 (the inner mesh axis): ranks 0 and 1 hold
    # them; st: one chunk per rank; rep: every rank writes it, rank 0 holds it
    assert [s.entries for s in sent] == [4, 3, 1, 1]
    assert [s.record.rank for s in sent] == [0, 1, 2, 3]
    _load_all(tmp_path / "record", 2, Layout((2,), (-1, 0)), tensors=2)

    with_replicas = _states(layout=Layout((2, 2), (0, -1)))
    planners, plans = plan_ranks(with_replicas, remove_redundancy=False)
    final, metadata = planners[0].build_global_plan(plans)
    found = plan_index(metadata, final, replicas=True)
    assert found.entries == (3, 2, 1, 1) and len(found.held) == 4
    assert plan_index(metadata, final) is None  # a chunk written twice, where replicas were not kept


class _Reversing(dcp.StandardSavePlanner):
    """A custom planner whose ``finalize_plan`` writes its items in reverse order."""

    def finalize_plan(self, plan):
        return dataclasses.replace(plan, items=tuple(reversed(plan.items)))


class _StFirst(dcp.StandardSavePlanner):
    """A custom planner whose ``finalize_plan`` writes the Megatron-style tensor ``st`` first."""

    def finalize_plan(self, plan):
        return dataclasses.replace(plan, items=tuple(sorted(plan.items, key=lambda item: item.index.fqn != "st")))


class _DroppingLast(dcp.StandardSavePlanner):
    """A custom planner whose ``finalize_plan`` drops its last grid chunk (``w0``)."""

    def finalize_plan(self, plan):
        last = max(i for i, item in enumerate(plan.items) if item.index.fqn == "w0")
        return dataclasses.replace(plan, items=plan.items[:last] + plan.items[last + 1:])


def _index_keys(path) -> list[set]:
    """The (name, offset) of every entry of each rank's index file."""
    from hyper_parallel.core.distributed_checkpoint._format.rank_index import IndexRecord, decode_rank_index

    document = json.loads((path / "metadata.json").read_bytes())
    files = [(IndexRecord(**r), (path / r["file"]).read_bytes()) for r in document["rank_indexes"]]
    return [set(decode_rank_index(data, record=record, save_id=json.loads(data)["save_id"], source=record.file))
            for record, data in files]


@pytest.mark.parametrize("layout_form", [False, True])
@pytest.mark.parametrize("planner_class", [_StFirst, _Reversing])
def test_a_finalize_plan_reordering_its_items_keeps_each_index_to_the_chunks_its_rank_holds(tmp_path, layout_form,
                                                                                          planner_class):
    """The held bits mark items by position in the plan sent. Before, a ``finalize_plan`` writing ``st`` first
    made rank 1 list the replicated ``rep`` (held by rank 0) and not its ``st`` chunk: the commit succeeded and
    the load failed; reversed items failed the save (rank 0 listed 2 of its 4 chunks)."""
    states = _states(layout=Layout((2, 2), (0, -1)), tensors=2)
    options = {"writer_options": {"metadata_form": "indexed"}, "remove_redundancy": False,
               "layout_form": layout_form, "rank_indexes": True}
    sent: list = []
    simulate_save(states, tmp_path / "standard", **options)
    simulate_save(states, tmp_path / "reordered", sent=sent, planner_class=planner_class, **options)
    assert all(isinstance(s, RankIndexSummary) for s in sent) and [s.entries for s in sent] == [4, 3, 1, 1]
    assert _index_keys(tmp_path / "reordered") == _index_keys(tmp_path / "standard")
    _load_all(tmp_path / "reordered", 2, Layout((2,), (-1, 0)), tensors=2)

    with pytest.raises(CheckpointValueError, match=r"rank 0: wrote 3 chunk.* gives it 4.*finalize_plan"):
        simulate_save(states, tmp_path / "dropped", planner_class=_DroppingLast, **options)
    assert not (tmp_path / "dropped" / "metadata.json").exists()


def test_plan_deltas_keep_the_order_the_coordinator_planned():
    """A rank receives its final plan as a keep mask over its local plan only when that keeps the coordinator's
    order (the held bits of the indexed form mark items by position)."""
    from hyper_parallel.core.distributed_checkpoint._engine import _compress, _expand

    _, plans = plan_ranks(_states(ranks=1))
    local = plans[0]
    subset = dataclasses.replace(local, items=local.items[1:])
    assert _expand(local, _compress(local, subset)).items == subset.items
    assert not isinstance(_compress(local, subset), dcp.SavePlan)  # a small mask
    swapped = dataclasses.replace(local, items=local.items[1:2] + local.items[:1] + local.items[2:])
    assert _compress(local, swapped) is swapped and _expand(local, _compress(local, swapped)).items == swapped.items


def test_inline_form_and_small_auto_saves_send_results(tmp_path):
    for form in ("inline", "auto"):
        sent: list = []
        simulate_save(_states(), tmp_path / form, rank_indexes=True, sent=sent, writer_options={"metadata_form": form})
        assert all(isinstance(s, list) for s in sent)
        assert not [n for n in os.listdir(tmp_path / form) if "_index." in n]


def test_auto_form_is_decided_from_the_plan_as_at_commit():
    """``"auto"``: the plan-time estimate counts chunks and the checksum digests of each chunk's size."""
    planners, plans = plan_ranks(_states())
    _, metadata = planners[0].build_global_masks([p.compact_local_plan(plan) for p, plan in zip(planners, plans)])
    assert not plan_wants_index("auto", metadata, block_bytes=1 << 20)
    assert plan_wants_index("indexed", metadata, block_bytes=1 << 20)
    assert not plan_wants_index("inline", metadata, block_bytes=1 << 20)
    # 96 float32 per w chunk of 24 elements = 96 bytes: with 1-byte blocks, 95 extra digests per chunk of each rank
    many = metadata.replace(state_dict_metadata={
        f"t{k}": metadata.state_dict_metadata["w0"] for k in range(40_000)})
    assert plan_wants_index("auto", many, block_bytes=1)
    assert not plan_wants_index("auto", many, block_bytes=1 << 20)


def test_a_replaced_index_file_aborts_the_commit_naming_rank_and_file(tmp_path):
    """The coordinator checks every index file's length and digest against its rank's summary before committing."""
    from hyper_parallel.core.distributed_checkpoint import _index_plan

    path = tmp_path / "c"
    original = _index_plan.summarise_rank

    def damaged(plan, results, *, rank, save_id):
        summary, data = original(plan, results, rank=rank, save_id=save_id)
        if rank == 2:  # the file on storage will differ (one byte) from what the rank reports
            data = data.replace(b'"rank":2', b'"rank":3')
        return summary, data

    _index_plan_patch = pytest.MonkeyPatch()
    import hyper_parallel.core.distributed_checkpoint._writer_index_form as index_form_writing
    _index_plan_patch.setattr(index_form_writing, "summarise_rank", damaged)
    try:
        with pytest.raises(CorruptCheckpointError,
                           match=r"index file r00002_index\.\w+\.json of rank 2 does not match"):
            simulate_save(_states(), path, rank_indexes=True, writer_options={"metadata_form": "indexed"})
    finally:
        _index_plan_patch.undo()
    assert not (path / "metadata.json").exists()


def test_a_truncated_index_file_aborts_and_abort_removes_every_index(tmp_path):
    path = tmp_path / "c"
    writer0 = []

    class Truncating(dcp.FileSystemWriter):
        def store_rank_index(self, record, data):
            super().store_rank_index(record, data[:-1] if self.rank == 1 else data)

        def finish(self, metadata, results, **kwargs):
            writer0.append(self)
            return super().finish(metadata, results, **kwargs)

    with pytest.raises(CorruptCheckpointError, match=r"index file r00001_index\.\w+\.json of rank 1 does not match"):
        simulate_save(_states(), path, rank_indexes=True, writer_class=Truncating,
                      writer_options={"metadata_form": "indexed"})
    assert len([n for n in os.listdir(path) if "_index." in n]) == 4  # written before the commit, durable
    writer0[0].abort()  # what dcp.save does on the failure: every file of the save goes
    assert not (path / "metadata.json").exists() and not [n for n in os.listdir(path) if not n.startswith(".")]


def test_summary_disagreeing_with_the_plan_is_refused(tmp_path):
    committed_input = []

    class Recording(dcp.FileSystemWriter):
        def finish(self, metadata, results, **kwargs):
            committed_input.append((self, metadata, results))
            return super().finish(metadata, results, **kwargs)

    simulate_save(_states(), tmp_path / "c", rank_indexes=True, writer_class=Recording,
                  writer_options={"metadata_form": "indexed"})
    writer, metadata, summaries = committed_input[0]
    base = writer.committed_metadata(metadata, summaries)
    wrong = list(summaries)
    wrong[3] = RankIndexSummary(rank=3, record=None, entries=0, bytes_written=0, files=(), inline=())
    with pytest.raises(CorruptCheckpointError, match="rank 3: its index file r00003_index.* 0 entries"):
        record_only_metadata(base, wrong, writer.index_plan, save_id=writer.save_id)
    with pytest.raises(CheckpointValueError, match="planned no indexed form"):
        record_only_metadata(base, summaries, None, save_id=writer.save_id)


def test_a_rank_writing_other_chunks_than_planned_fails(tmp_path):
    from hyper_parallel.core.distributed_checkpoint._index_plan import RankIndexPlan, summarise_rank

    sent: list = []
    simulate_save(_states(), tmp_path / "c", rank_indexes=True, sent=sent, writer_options={"metadata_form": "indexed"})
    writer = dcp.FileSystemWriter(tmp_path / "d")
    plan = writer.prepare_global_plan([dcp.SavePlan(items=())])[0]
    import dataclasses
    plan = dataclasses.replace(plan, storage_data=dataclasses.replace(
        plan.storage_data, index=RankIndexPlan(inline_keys=frozenset(), entries=5)))
    with pytest.raises(CheckpointValueError, match="rank 1: wrote 0 chunk.* gives it 5"):
        summarise_rank(plan, [], rank=1, save_id="abc")


def test_plan_index_declines_plans_without_one_writer_per_chunk(tmp_path):
    planners, plans = plan_ranks([{"w": DTensor.from_global(ms.Tensor(FULL), Layout((2, 2), (0, -1)), rank=r)}
                                  for r in range(4)], remove_redundancy=False)
    compact = [p.compact_local_plan(plan) for p, plan in zip(planners, plans)]
    masks, metadata = planners[0].build_global_masks(compact)
    assert plan_index(metadata, compact, masks) is None  # two writers of every chunk
    assert plan_index(metadata, compact, masks, replicas=True).entries == (1, 1, 0, 0)
    planners, plans = plan_ranks([{"w": DTensor.from_global(ms.Tensor(FULL), Layout((2, 2), (0, -1)), rank=r)}
                                  for r in range(4)])
    final, metadata = planners[0].build_global_plan(plans)
    found = plan_index(metadata, final)
    assert found is not None and sum(found.entries) == 2 and found.inline_keys == frozenset()
    assert plan_index(metadata, [dcp.SavePlan(items=())] * 4) is None  # a chunk nobody writes
    assert plan_index(metadata, final + final) is None  # a chunk written twice
    # layout-form plans whose metadata describes other grids than their layouts: declined, never guessed
    from hyper_parallel.core.distributed_checkpoint._grid_chunks import GridChunks
    from hyper_parallel.core.distributed_checkpoint.metadata import TensorStorageMetadata

    planners, plans = plan_ranks(_states())
    compact = [p.compact_local_plan(plan) for p, plan in zip(planners, plans)]
    masks, metadata = planners[0].build_global_masks(compact)
    entries = plan_index(metadata, compact, masks).entries
    assert sum(entries) == 9 and min(entries) == 2  # w0 and st: one chunk per rank; rep: one rank (scale in-line)
    for fqn, size in (("w0", (8, 12)), ("rep", (3, 2))):
        item = metadata.state_dict_metadata[fqn]
        other = TensorStorageMetadata(item.properties, item.size, GridChunks(item.size, (1,) + item.size[1:]))
        changed = metadata.replace(state_dict_metadata={**metadata.state_dict_metadata, fqn: other})
        assert plan_index(changed, compact, masks) is None


def test_one_process_save_and_plan_cache_reuse_commit_from_the_summary(tmp_path):
    """``dcp.save`` without collectives runs the same steps: the second save reuses the cached plan and holders."""
    from hyper_parallel.core.distributed_checkpoint._plan_cache import STATS

    state = {"w": ms.Parameter(ms.Tensor(FULL.copy()), name="w"), "step": 3}
    seen: list = []
    Recording = _kind_recording(seen)

    reused = STATS.reused
    for step, form in enumerate(("inline", "indexed", "indexed")):  # the holders of a reused plan: computed once asked
        path = tmp_path / f"s{step}"
        dcp.save(state, checkpoint_id=path, no_dist=True, storage_writer=Recording(path, metadata_form=form))
        whole = {"w": np.zeros_like(FULL), "step": 0}
        dcp.load(whole, checkpoint_id=path, no_dist=True)
        assert np.array_equal(whole["w"], FULL) and whole["step"] == 3
    assert seen == ["list"] + ["RankIndexSummary"] * 2 and STATS.reused == reused + 2


def test_record_only_on_s3(s3_url):
    sent: list = []
    committed, _ = simulate_save(_states(), s3_url, rank_indexes=True, sent=sent, layout_form=True,
                                 writer_options={"metadata_form": "indexed"}, writer_class=dcp.FsspecWriter)
    assert all(isinstance(s, RankIndexSummary) for s in sent)
    fs = new_filesystem()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(s3_url[len("s3://"):], refresh=True))
    assert len([n for n in names if "_index." in n]) == 4
    assert committed.storage_data[dcp.MetadataIndex("w0", (4, 6))].relative_path.startswith("r00003_")
    for rank in range(2):
        layout = Layout((2,), (-1, 0))
        param = ms.Parameter(ms.Tensor(np.zeros(layout.local_shape(FULL.shape), np.float32)), name="w")
        target = DTensor(param, layout, FULL.shape, rank=rank)
        dcp.load({"w0": target}, checkpoint_id=s3_url, no_dist=True)
        assert np.array_equal(param.asnumpy(), FULL[:, 6 * rank:6 * rank + 6])


def test_version_two_results_record_carries_the_summary(tmp_path):
    """The async background commit's results record (version 2): the summary round-trips, hostile ones are refused."""
    from hyper_parallel.core.distributed_checkpoint._rank_records import (
        RankRecord,
        decode_rank_record,
        encode_rank_record,
        results_of,
    )

    sent: list = []
    committed, _ = simulate_save(_states(), tmp_path / "c", rank_indexes=True, sent=sent,
                                 writer_options={"metadata_form": "indexed"})
    save_id = committed.storage_meta.save_id
    records = {}
    for summary in sent:
        record = RankRecord(save_id, summary.rank, (), summary=summary)
        data = encode_rank_record(record)
        assert b'"version":2' in data and decode_rank_record(data, source="r") == record
        records[summary.rank] = decode_rank_record(data, source="r")
    assert results_of(records, save_id=save_id, world_size=4) == sent
    assert len(encode_rank_record(records[3])) < 600  # one index file named, no entry of its chunks
    plain = RankRecord(save_id, 1, ())
    assert b"version" not in encode_rank_record(plain)
    assert decode_rank_record(encode_rank_record(plain), source="r") == plain
    good = json.loads(encode_rank_record(records[1]))
    for edit, match in ((lambda d: d["index"].update(entries=-1), "malformed rank index summary"),
                        (lambda d: d["index"].update(files=[3]), "malformed rank index summary"),
                        (lambda d: d["index"]["record"].update(
                            rank=0, file=d["index"]["record"]["file"].replace("r00001", "r00000")),
                         "index file of rank 0 in the record of rank 1"),
                        (lambda d: d["index"]["record"].update(rank=2), "not a new rank"),
                        (lambda d: d["index"]["record"].update(file="../x"), "is not named")):
        document = json.loads(json.dumps(good))
        edit(document)
        with pytest.raises((CorruptCheckpointError, dcp.CheckpointError), match=match):
            decode_rank_record(json.dumps(document).encode(), source="r")


def test_a_missing_index_file_aborts_the_commit(tmp_path):
    class Deleting(dcp.FileSystemWriter):
        def finish(self, metadata, results, **kwargs):
            os.unlink(self.path / results[2].record.file)  # another process removed it before the commit
            return super().finish(metadata, results, **kwargs)

    with pytest.raises(CorruptCheckpointError,
                       match=r"r00002_index\.\w+\.json of rank 2 does not match.*stored: -1 bytes"):
        simulate_save(_states(), tmp_path / "c", rank_indexes=True, writer_class=Deleting,
                      writer_options={"metadata_form": "indexed"})
    assert not (tmp_path / "c" / "metadata.json").exists()


def test_a_failed_index_write_names_the_rank_and_file(tmp_path, monkeypatch):
    import hyper_parallel.core.distributed_checkpoint._writer_index_form as index_form_writing

    real = index_form_writing.write_atomically

    def full_disk(path, data, **kwargs):
        if "_index." in path.name:
            raise OSError(28, "No space left on device (injected)")
        return real(path, data, **kwargs)

    monkeypatch.setattr(index_form_writing, "write_atomically", full_disk)
    with pytest.raises(dcp.CheckpointIOError, match=r"rank 0: writing its index file .*r00000_index\.\w+\.json failed"):
        simulate_save(_states(), tmp_path / "c", rank_indexes=True, writer_options={"metadata_form": "indexed"})


def test_an_interrupted_index_write_leaves_a_file_the_cleanup_removes(tmp_path, monkeypatch):
    """A rank whose index write stops before its rename (a crash) leaves a partial file named with the save id,
    whatever save id its own writer started with (a forked writer's parent never ran write_data): the
    coordinator's abort removes it with the rest of the save."""
    from hyper_parallel.core.distributed_checkpoint._file_ops import OS_FILE_OPS

    class Crashing(type(OS_FILE_OPS)):
        def replace(self, source, target):
            raise OSError(5, "power cut (injected)")

        def unlink(self, path):  # the process is gone: nothing removes its partial file
            raise OSError(5, "power cut (injected)")

    writers = []

    class Recording(dcp.FileSystemWriter):
        def write_rank_index(self, plan, results):
            writers.append(self)
            self.save_id = "0" * 12  # as a parent whose forked child wrote the data
            self.file_ops = Crashing()
            return super().write_rank_index(plan, results)

    with pytest.raises(dcp.CheckpointIOError, match="rank 0: writing its index file"):
        simulate_save(_states(), tmp_path / "c", rank_indexes=True, writer_class=Recording,
                      writer_options={"metadata_form": "indexed"})
    partial = [n for n in os.listdir(tmp_path / "c") if n.endswith(".partial")]
    assert partial and writers[0].save_id in partial[0] and "000000000000" not in partial[0]
    coordinator = writers[0]
    coordinator.file_ops = OS_FILE_OPS
    coordinator.abort()
    assert not [n for n in os.listdir(tmp_path / "c") if not n.startswith(".lease")], os.listdir(tmp_path / "c")


def test_s3_missing_index_object_or_failed_put_aborts(s3_url):
    """On object storage: an index object gone before the commit fails it naming rank and object; a failed PUT of
    an index object names the rank and object."""

    class Deleting(dcp.FsspecWriter):
        def finish(self, metadata, results, **kwargs):
            self.fs.rm_file(self._object(results[1].record.file))
            return super().finish(metadata, results, **kwargs)

    with pytest.raises(CorruptCheckpointError, match=r"r00001_index\.\w+\.json of rank 1 does not match"):
        simulate_save(_states(), s3_url, rank_indexes=True, writer_class=Deleting,
                      writer_options={"metadata_form": "indexed"})

    class Refusing:
        def __init__(self, fs):
            self.fs = fs

        def pipe_file(self, path, data):
            raise OSError(28, "quota exceeded (injected)")

        def __getattr__(self, name):
            return getattr(self.fs, name)

    class FailingPut(dcp.FsspecWriter):
        def store_rank_index(self, record, data):
            self.fs = Refusing(self.fs)
            super().store_rank_index(record, data)

    with pytest.raises(dcp.CheckpointIOError,
                       match=r"rank 0: writing its index object .*r00000_index\.\w+\.json failed"):
        simulate_save(_states(), s3_url + "x", rank_indexes=True, writer_class=FailingPut,
                      writer_options={"metadata_form": "indexed"})


def test_one_rank_async_saves_commit_from_the_summary_also_reusing_a_deferred_plan(tmp_path):
    """A one-rank async save of a new layout is planned after its snapshot (_deferred_save); it and the next save,
    which reuses that plan, both commit from this rank's summary."""
    from hyper_parallel.core.distributed_checkpoint._plan_cache import STATS

    state = {"w": ms.Parameter(ms.Tensor(FULL.copy()), name="w_deferred"), "step": 4}
    seen: list = []
    Recording = _kind_recording(seen)

    reused = STATS.reused
    for step in range(2):
        path = tmp_path / f"a{step}"
        dcp.async_save(state, checkpoint_id=path, no_dist=True, staging="copy",
                       storage_writer=Recording(path, metadata_form="indexed")).result()
        whole = {"w": np.zeros_like(FULL), "step": 0}
        dcp.load(whole, checkpoint_id=path, no_dist=True)
        assert np.array_equal(whole["w"], FULL) and whole["step"] == 4
    assert seen == ["RankIndexSummary"] * 2 and STATS.reused == reused + 1


@pytest.mark.parametrize("layout_form", [False, True])
def test_auto_estimate_counts_digests_beyond_the_first_of_each_chunk_exactly(monkeypatch, layout_form):
    """The plan-time ``"auto"`` estimate: 225 bytes per entry plus 19 per checksum digest past each chunk's first
    (ceil(chunk bytes / block) - 1), at the byte: a chunk of exactly one block adds none, one byte more adds one."""
    from hyper_parallel.core.distributed_checkpoint import _metadata_form

    planners, plans = plan_ranks([{"w": np.zeros(24, np.float32)}])  # one chunk of 96 bytes
    if layout_form:
        _, metadata = planners[0].build_global_masks([p.compact_local_plan(plan) for p, plan in zip(planners, plans)])
    else:
        _, metadata = planners[0].build_global_plan(plans)
    for block, size in ((96, 225), (95, 225 + 19), (32, 225 + 2 * 19), (1, 225 + 95 * 19)):
        monkeypatch.setattr(_metadata_form, "AUTO_INDEX_BYTES", size - 1)
        assert plan_wants_index("auto", metadata, block_bytes=block)
        monkeypatch.setattr(_metadata_form, "AUTO_INDEX_BYTES", size)
        assert not plan_wants_index("auto", metadata, block_bytes=block)


def test_auto_estimate_of_a_reused_plan_is_made_once(monkeypatch):
    """A cached plan's metadata comes back at every save: its in-line estimate is made once (the decision still
    follows the threshold of each call); another metadata object, or another block size, is estimated anew."""
    from hyper_parallel.core.distributed_checkpoint import _metadata_form

    planners, plans = plan_ranks([{"w": np.zeros(24, np.float32)}])
    _, metadata = planners[0].build_global_plan(plans)
    walks: list[int] = []

    class Counted(dict):
        def values(self):
            walks.append(1)
            return super().values()

    counted = metadata.replace(state_dict_metadata=Counted(metadata.state_dict_metadata))
    for _ in range(3):
        assert not plan_wants_index("auto", counted, block_bytes=1 << 20)
    assert len(walks) == 1
    monkeypatch.setattr(_metadata_form, "AUTO_INDEX_BYTES", 0)
    assert plan_wants_index("auto", counted, block_bytes=1 << 20) and len(walks) == 1
    assert plan_wants_index("auto", counted, block_bytes=32) and len(walks) == 2
    again = counted.replace(state_dict_metadata=Counted(metadata.state_dict_metadata))
    assert plan_wants_index("auto", again, block_bytes=1 << 20) and len(walks) == 3
