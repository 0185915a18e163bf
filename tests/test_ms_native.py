"""``hp-ckpt import`` / ``export-mindspore`` of MindSpore's own per-rank checkpoints.

The per-rank files are made by MindSpore's ``transform_checkpoints`` from a
full checkpoint, with strategy files built by ``tests/strategy_files.py``;
every result is compared bit for bit with the full tensors and with
MindSpore's own tools (``transform_checkpoints``, ``merge_sliced_parameter``),
and the exported files are loaded with ``load_checkpoint`` +
``load_param_into_net``.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import mindspore
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.cli import export_mindspore, import_checkpoint, main
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointValueError,
    LayoutError,
    UnsupportedFormatError,
)
from tests.strategy_files import CASES, ParamStrategy, StrategyCase, strategy_for_mindspore, write_case

BF16 = mindspore.bfloat16
#: Tensors of every case that no strategy lists (replicated on every rank).
EXTRAS = {"global_step": np.array([42], dtype=np.int32), "learning_rate": np.array(0.125, dtype=np.float32)}


def _full_tensors(case_name: str) -> dict[str, mindspore.Tensor]:
    rng = np.random.default_rng(len(case_name))
    tensors = {}
    for position, (name, shape) in enumerate(sorted(CASES[case_name].shapes.items())):
        data = rng.standard_normal(shape).astype(np.float32)
        tensor = mindspore.Tensor(data)
        if position == 0:
            tensor = tensor.astype(BF16)  # one bfloat16 parameter per case
        elif position == 1:
            tensor = mindspore.Tensor(data.astype(np.float16))
        tensors[name] = tensor
    tensors.update({name: mindspore.Tensor(value) for name, value in EXTRAS.items()})
    return tensors


def _save(tensors: dict[str, mindspore.Tensor], path: Path, fmt: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    mindspore.save_checkpoint([{"name": k, "data": v} for k, v in tensors.items()], str(path), format=fmt)


class Job:
    """One case: strategy files, the full tensors and the per-rank files MindSpore made from them.

    The rank files are ``transform_checkpoints``'s ``.ckpt`` output; for ``fmt="safetensors"`` each is then
    re-saved by ``mindspore.save_checkpoint(..., format="safetensors")``. (MindSpore 2.10's own safetensors
    transform writes a slice that is not contiguous in the full tensor, e.g. a column split, from the full
    tensor's buffer, ignoring strides, so its safetensors output is not a reference.)
    """

    def __init__(self, root: Path, case_name: str, fmt: str = "ckpt") -> None:
        self.root, self.fmt, self.case = root, fmt, CASES[case_name]
        self.full = _full_tensors(case_name)
        self.stage_files = write_case(root / "strategy", self.case)
        self.ms_strategy = strategy_for_mindspore(root, self.stage_files)
        _save(self.full, root / "full" / "rank_0" / "full.ckpt", "ckpt")
        self.ranks = root / "ranks"
        mindspore.parallel.transform_checkpoints(str(root / "full"), str(self.ranks), "checkpoint_", None,
                                                 self.ms_strategy)
        if fmt == "safetensors":
            for path in sorted(self.ranks.glob("rank_*/*.ckpt")):
                loaded = mindspore.load_checkpoint(str(path))
                _save(dict(loaded), path.with_suffix(".safetensors"), "safetensors")
                path.unlink()


@pytest.fixture(name="jobs", scope="module")
def fixture_jobs(tmp_path_factory):
    cache: dict[tuple[str, str], Job] = {}

    def get(case_name: str, fmt: str = "ckpt") -> Job:
        if (case_name, fmt) not in cache:
            cache[(case_name, fmt)] = Job(tmp_path_factory.mktemp(f"{case_name}_{fmt}"), case_name, fmt)
        return cache[(case_name, fmt)]

    return get


def _load_file(path: Path) -> dict[str, np.ndarray]:
    fmt = "safetensors" if path.suffix == ".safetensors" else "ckpt"
    return {k: v.asnumpy() for k, v in mindspore.load_checkpoint(str(path), format=fmt).items()}


def _assert_same(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray], where: str) -> None:
    assert sorted(actual) == sorted(expected), where
    for name, value in expected.items():
        got = actual[name]
        assert (got.dtype, got.shape) == (value.dtype, value.shape), f"{where}: {name}"
        assert got.tobytes() == value.tobytes(), f"{where}: {name} differs"


def _load_ours(path: Path) -> dict[str, np.ndarray]:
    metadata = dcp.read_metadata(path)
    targets = {name: None for name in metadata.state_dict_metadata}
    dcp.load(targets, checkpoint_id=path, no_dist=True)
    return targets


def _rank_dirs(directory: Path) -> dict[str, dict[str, np.ndarray]]:
    return {d.name: _load_file(next(d.iterdir())) for d in sorted(directory.iterdir())}


# ---------------------------------------------------------------- import


@pytest.mark.parametrize("case_name", ["tp2d_8", "dp_replicas_4", "opt_parallel_8", "pipeline_2x2"])
def test_import_gives_the_full_tensors_as_mindspore_merges_them(jobs, tmp_path, case_name):
    job = jobs(case_name)
    metadata = import_checkpoint(job.ranks, tmp_path / "ours", strategy_files=job.stage_files)
    expected = {k: v.asnumpy() for k, v in job.full.items()}
    _assert_same(_load_ours(tmp_path / "ours"), expected, "import")
    # Each distinct slice stored once: the data written is the full tensors' size, replicas skipped.
    assert sum(info.length for info in metadata.storage_data.values()) == sum(v.nbytes for v in expected.values())
    # MindSpore's own merge of the same rank files gives the same tensors.
    mindspore.parallel.transform_checkpoints(str(job.ranks), str(tmp_path / "ms_full"), "full_", job.ms_strategy,
                                             None)
    _assert_same(_load_file(tmp_path / "ms_full" / "rank_0" / "full_0.ckpt"), expected, "transform_checkpoints")


def test_import_matches_merge_sliced_parameter(jobs, tmp_path):
    job = jobs("tp2d_8")
    import_checkpoint(job.ranks, tmp_path / "ours", strategy_files=job.stage_files)
    ours = _load_ours(tmp_path / "ours")
    strategy = mindspore.parallel.build_searched_strategy(job.ms_strategy)
    per_rank = [mindspore.load_checkpoint(str(next((job.ranks / f"rank_{r}").iterdir()))) for r in range(8)]
    # merge_sliced_parameter reads only the first TensorMap of a layout, so it cannot merge a tensor
    # dim split over several mesh dims (proj.weight); transform_checkpoints can (the test above).
    for name in ("dense.weight", "dense.bias"):
        slices = [files[name] for files in per_rank]
        merged = mindspore.parallel.merge_sliced_parameter(slices, strategy)
        merged = merged.astype(slices[0].dtype)  # it widens bfloat16 to float32 (exactly)
        assert merged.asnumpy().tobytes() == ours[name].tobytes(), name


@pytest.mark.parametrize("case_name", ["tp2d_8", "dp_replicas_4", "opt_parallel_8"])
def test_import_matches_load_distributed_checkpoint(jobs, tmp_path, case_name):
    job = jobs(case_name)
    import_checkpoint(job.ranks, tmp_path / "ours", strategy_files=job.stage_files)
    ours = _load_ours(tmp_path / "ours")
    # load_distributed_checkpoint fails on a tensor dim split over several mesh dims (proj.weight)
    # and leaves the parameters the strategy does not list alone: compare the others.
    names = [n for n in job.case.shapes if n != "proj.weight"]
    net = _net_of({n: ours[n] for n in names})
    files = [str(next((job.ranks / f"rank_{r}").iterdir())) for r in range(job.case.world_size)]
    mindspore.load_distributed_checkpoint(net, files, None, train_strategy_filename=job.ms_strategy)
    _assert_same({p.name: p.asnumpy() for p in net.get_parameters()}, {n: ours[n] for n in names}, case_name)


def test_import_progress_bars(jobs, tmp_path, capsys):
    job = jobs("dp_replicas_4")
    import_checkpoint(job.ranks, tmp_path / "ours", strategy_files=job.stage_files, show_progress=True)
    err = capsys.readouterr().err
    assert "index rank files" in err and "import" in err


def test_import_with_merged_pipeline_strategy_and_cli(jobs, tmp_path, capsys):
    job = jobs("pipeline_2x2")
    code = main(["import", str(job.ranks), str(tmp_path / "ours"), "--strategy", job.ms_strategy])
    assert code == 0 and "imported 5 tensor(s)" in capsys.readouterr().out
    _assert_same(_load_ours(tmp_path / "ours"), {k: v.asnumpy() for k, v in job.full.items()}, "merged strategy")


def test_import_safetensors_rank_files(jobs, tmp_path):
    job = jobs("opt_parallel_8", "safetensors")
    import_checkpoint(job.ranks, tmp_path / "ours", strategy_files=job.stage_files)
    _assert_same(_load_ours(tmp_path / "ours"), {k: v.asnumpy() for k, v in job.full.items()}, "safetensors")


# ---------------------------------------------------------------- export


def _transform(job: Job, dst_strategy: str | None, out: Path) -> Path:
    """MindSpore's reshard of the job's rank files (``.ckpt`` ones: see :class:`Job`)."""
    source = job.ranks if job.fmt == "ckpt" else job.root / "ranks_ckpt"
    if job.fmt != "ckpt" and not source.exists():
        for path in sorted(job.ranks.glob("rank_*/*.safetensors")):
            _save(dict(mindspore.load_checkpoint(str(path), format="safetensors")),
                  source / path.parent.name / path.with_suffix(".ckpt").name, "ckpt")
    mindspore.parallel.transform_checkpoints(str(source), str(out), "checkpoint_", job.ms_strategy, dst_strategy)
    return out


@pytest.mark.parametrize("case_name", ["tp2d_8", "dp_replicas_4", "opt_parallel_8", "pipeline_2x2"])
def test_export_to_the_source_strategy_gives_mindspore_rank_files_back(jobs, tmp_path, case_name):
    job = jobs(case_name)
    import_checkpoint(job.ranks, tmp_path / "ours", strategy_files=job.stage_files)
    result = export_mindspore(tmp_path / "ours", tmp_path / "out", strategy_files=job.stage_files)
    assert len(result.files) == job.case.world_size
    assert [Path(f).relative_to(tmp_path / "out").as_posix() for f in result.files] == [
        f"rank_{r}/checkpoint_{r}.ckpt" for r in range(job.case.world_size)]
    exported, original = _rank_dirs(tmp_path / "out"), _rank_dirs(job.ranks)
    for rank_dir, tensors in original.items():
        _assert_same(exported[rank_dir], tensors, f"{case_name} {rank_dir}")


def _net_of(tensors: dict[str, np.ndarray]) -> mindspore.nn.Cell:
    net = mindspore.nn.Cell()
    for position, (name, value) in enumerate(sorted(tensors.items())):
        setattr(net, f"p{position}", mindspore.Parameter(mindspore.Tensor(np.zeros_like(value)), name=name))
    return net


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_export_reshard_8_to_4_equals_transform_checkpoints(jobs, tmp_path, fmt):
    job = jobs("tp2d_8", fmt)
    dst = write_case(tmp_path / "dst", CASES["reshard_dst_4"])
    import_checkpoint(job.ranks, tmp_path / "ours", strategy_files=job.stage_files)
    export_mindspore(tmp_path / "ours", tmp_path / "out", strategy_files=dst, fmt=fmt)
    reference = _rank_dirs(_transform(job, dst[0], tmp_path / "ms"))
    exported = _rank_dirs(tmp_path / "out")
    assert sorted(exported) == sorted(reference) == [f"rank_{r}" for r in range(4)]
    for rank_dir, tensors in reference.items():
        _assert_same(exported[rank_dir], tensors, f"8->4 {rank_dir}")
        # Each rank of the destination job loads its file into its (sliced) network.
        net = _net_of(tensors)
        path = next((tmp_path / "out" / rank_dir).iterdir())
        not_loaded, _ = mindspore.load_param_into_net(
            net, mindspore.load_checkpoint(str(path), format=fmt), strict_load=True)
        assert not not_loaded
        _assert_same({p.name: p.asnumpy() for p in net.get_parameters()}, tensors, f"net {rank_dir}")


#: Destinations of more reshards, each checked against transform_checkpoints: pipeline (2 stages of 2) to one
#: stage of 4, and optimizer parallel on 8 to plain tensor parallel on 2 (shapes as in tests/strategy_files.py).
RESHARDS = {
    "pipeline_2x2": StrategyCase(stages=((
        ParamStrategy("embed.weight", (4,), (-1, 0)),
        ParamStrategy("layer0.weight", (4,), (0, -1)),
        ParamStrategy("layer1.weight", (2, 2), (1, 0)),
    ),)),
    "opt_parallel_8": StrategyCase(stages=((
        ParamStrategy("dense.weight", (2,), (0, -1)),
        ParamStrategy("dense.bias", (2,), (0,)),
        ParamStrategy("head.weight", (2,), (-1, 0)),
        ParamStrategy("norm.gamma", (2,), (-1, -1)),
    ),)),
}


@pytest.mark.parametrize("case_name", sorted(RESHARDS))
def test_more_reshards_equal_transform_checkpoints(jobs, tmp_path, case_name):
    job = jobs(case_name)
    dst = write_case(tmp_path / "dst", RESHARDS[case_name])
    import_checkpoint(job.ranks, tmp_path / "ours", strategy_files=job.stage_files)
    export_mindspore(tmp_path / "ours", tmp_path / "out", strategy_files=dst)
    reference = _rank_dirs(_transform(job, dst[0], tmp_path / "ms"))
    exported = _rank_dirs(tmp_path / "out")
    assert sorted(exported) == sorted(reference)
    for rank_dir, tensors in reference.items():
        _assert_same(exported[rank_dir], tensors, f"{case_name} {rank_dir}")


def test_export_pipeline_stages_from_a_flat_job(jobs, tmp_path):
    """2 pipeline stages as destination: each rank's file holds its stage's parameters only."""
    job = jobs("pipeline_2x2")
    import_checkpoint(job.ranks, tmp_path / "ours", strategy_files=job.stage_files)
    export_mindspore(tmp_path / "ours", tmp_path / "one", strategy_files=None)
    unified = _load_file(tmp_path / "one" / "checkpoint.ckpt")
    _assert_same(unified, {k: v.asnumpy() for k, v in job.full.items()}, "unified")
    export_mindspore(tmp_path / "ours", tmp_path / "out", strategy_files=[job.ms_strategy])
    reference = _rank_dirs(_transform(job, job.ms_strategy, tmp_path / "ms"))
    exported = _rank_dirs(tmp_path / "out")
    assert "layer1.weight" not in exported["rank_0"] and "layer0.weight" not in exported["rank_3"]
    for rank_dir, tensors in reference.items():
        _assert_same(exported[rank_dir], tensors, rank_dir)


def test_export_strings_and_safetensors_unified(tmp_path, capsys):
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "note": "héllo", "step": 3, "none": None}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    code = main(["export-mindspore", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--name", "model"])
    out = capsys.readouterr().out
    assert code == 0 and "note: 'none'" in out and "note: 'step'" not in out
    loaded = mindspore.load_checkpoint(str(tmp_path / "out" / "model.ckpt"))
    assert loaded["note"] == "héllo" and loaded["w"].asnumpy().tobytes() == state["w"].tobytes()
    assert loaded["step"].asnumpy().item() == 3
    result = export_mindspore(tmp_path / "ckpt", tmp_path / "st", fmt="safetensors")
    assert [n for n, _ in result.skipped] == ["none", "note"]
    _assert_same(_load_file(tmp_path / "st" / "checkpoint.safetensors"), {"w": state["w"], "step": np.array(3)},
                 "safetensors")
    with pytest.raises(CheckpointExistsError):
        export_mindspore(tmp_path / "ckpt", tmp_path / "st")
    with pytest.raises(CheckpointValueError, match="format"):
        export_mindspore(tmp_path / "ckpt", tmp_path / "x", fmt="npz")


# ---------------------------------------------------------------- refusals


def test_rank_files_without_strategy_are_refused(jobs, tmp_path, capsys):
    job = jobs("dp_replicas_4")
    code = main(["import", str(job.ranks), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "slices" in err and "--strategy" in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointValueError, match="per-rank"):
        import_checkpoint(job.ranks / "rank_0" / "checkpoint_0.ckpt", tmp_path / "out",
                          strategy_files=job.stage_files)


def test_committed_output_is_never_replaced(jobs, tmp_path):
    job = jobs("dp_replicas_4")
    first = import_checkpoint(job.ranks, tmp_path / "ours", strategy_files=job.stage_files)
    before = (tmp_path / "ours" / "metadata.json").read_bytes()
    with pytest.raises(CheckpointExistsError, match="committed checkpoint"):
        import_checkpoint(job.ranks, tmp_path / "ours", strategy_files=job.stage_files)
    assert (tmp_path / "ours" / "metadata.json").read_bytes() == before and first.storage_data


@pytest.mark.parametrize("where", ["weights.ckpt", "hf/model.safetensors.index.json", "ranks/rank_0/c.ckpt"])
def test_fifo_source_is_refused_without_blocking(tmp_path, where):
    fifo = tmp_path / where
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    src = tmp_path / where.split("/")[0]
    strategy = write_case(tmp_path / "strategy", CASES["dp_replicas_4"]) if where.startswith("ranks") else None
    outcome: list[BaseException] = []
    worker = threading.Thread(target=lambda: _capture(outcome, src, tmp_path / "out", strategy), daemon=True)
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), "import blocked on a FIFO"
    assert isinstance(outcome[0], UnsupportedFormatError) and "regular file" in str(outcome[0])


def _capture(outcome: list[BaseException], src: Path, out: Path, strategy: list[str] | None) -> None:
    try:
        import_checkpoint(src, out, strategy_files=strategy)
    except BaseException as exc:  # pylint: disable=broad-except
        outcome.append(exc)


def test_missing_and_contradicting_rank_files(jobs, tmp_path):
    job = jobs("tp2d_8")
    partial = tmp_path / "partial"
    shutil.copytree(job.ranks, partial)
    shutil.rmtree(partial / "rank_5")
    with pytest.raises(CheckpointNotFoundError, match="rank_5"):
        import_checkpoint(partial, tmp_path / "a", strategy_files=job.stage_files)
    shutil.copy(next((partial / "rank_4").iterdir()), partial / "rank_4" / "older.ckpt")
    with pytest.raises(UnsupportedFormatError, match="rank_4"):
        import_checkpoint(partial, tmp_path / "b", strategy_files=job.stage_files)
    other = write_case(tmp_path / "other", CASES["dp_replicas_4"])  # another job's strategy
    with pytest.raises((LayoutError, CheckpointValueError)):
        import_checkpoint(job.ranks, tmp_path / "c", strategy_files=other)
    assert not any((tmp_path / name / "metadata.json").exists() for name in "abc")


# ---------------------------------------------------------------- optimizer states and unlisted tensors


def _with_extra_entries(job: Job, out: Path, extra) -> Path:
    """A copy of the job's rank files (re-saved by MindSpore) with ``extra(rank, entries)`` added."""
    for rank_dir in sorted(job.ranks.iterdir()):
        rank = int(rank_dir.name.split("_")[1])
        entries = dict(mindspore.load_checkpoint(str(next(rank_dir.iterdir()))))
        entries.update(extra(rank, entries))
        _save(entries, out / rank_dir.name / f"checkpoint_{rank}.ckpt", "ckpt")
    return out


def test_optimizer_state_follows_its_parameter_in_and_out(jobs, tmp_path):
    job = jobs("tp2d_8")
    bias = job.full["dense.bias"]
    src = _with_extra_entries(job, tmp_path / "src", lambda rank, e: {
        "adam_m.proj.weight": mindspore.Tensor(e["proj.weight"].asnumpy() * 2),  # sliced like proj.weight
        "moment1.dense.bias": mindspore.Tensor(bias.asnumpy()),  # the full bias on every rank: stored whole
    })
    import_checkpoint(src, tmp_path / "ours", strategy_files=job.stage_files)
    ours = _load_ours(tmp_path / "ours")
    assert ours["adam_m.proj.weight"].tobytes() == (job.full["proj.weight"].asnumpy() * 2).tobytes()
    assert ours["moment1.dense.bias"].tobytes() == bias.asnumpy().tobytes()
    export_mindspore(tmp_path / "ours", tmp_path / "out", strategy_files=job.stage_files)
    exported, original = _rank_dirs(tmp_path / "out"), _rank_dirs(src)
    for rank_dir, tensors in original.items():
        # An unlisted state of its parameter's global shape is exported with the parameter's layout.
        assert exported[rank_dir].pop("moment1.dense.bias").tobytes() == tensors["dense.bias"].tobytes()
        tensors.pop("moment1.dense.bias")
        _assert_same(exported[rank_dir], tensors, rank_dir)


def test_unlisted_tensor_that_differs_between_ranks_is_refused(jobs, tmp_path):
    job = jobs("dp_replicas_4")
    src = _with_extra_entries(job, tmp_path / "src", lambda rank, e: {
        "stray": mindspore.Tensor(np.zeros(rank + 1, np.float32))})
    with pytest.raises(LayoutError, match="'stray' is not in the strategy.*sliced"):
        import_checkpoint(src, tmp_path / "out", strategy_files=job.stage_files)
    # Slices of one shape on every rank (a parameter the strategy does not list): only the bytes tell. The
    # import stored rank 0's slice as the whole tensor, silently.
    src = _with_extra_entries(job, tmp_path / "same_shape", lambda rank, e: {
        "stray": mindspore.Tensor(np.full((2, 3), rank, np.float32))})
    with pytest.raises(LayoutError) as refused:
        import_checkpoint(src, tmp_path / "out", strategy_files=job.stage_files)
    assert "'stray' is not in the strategy" in str(refused.value) and "ranks [1, 2, 3]" in str(refused.value)
    assert not (tmp_path / "out" / "metadata.json").exists()
    src = _with_extra_entries(job, tmp_path / "steps", lambda rank, e: {  # rank 3's file of a later step
        "global_step": mindspore.Tensor(np.array([43 if rank == 3 else 42], np.int32))})
    with pytest.raises(LayoutError, match=r"'global_step' is not in the strategy file but ranks \[3\]") as mixed:
        import_checkpoint(src, tmp_path / "out", strategy_files=job.stage_files)
    assert "different steps" in str(mixed.value)
    src = _with_extra_entries(job, tmp_path / "alike", lambda rank, e: {  # a replica everywhere: stored whole
        "stray": mindspore.Tensor(np.full((2, 3), 5, np.float32))})
    import_checkpoint(src, tmp_path / "alike_out", strategy_files=job.stage_files)
    assert _load_ours(tmp_path / "alike_out")["stray"].tolist() == [[5.0] * 3] * 2
    (tmp_path / "mixed" / "rank_0").mkdir(parents=True)
    (tmp_path / "mixed" / "rank_1").mkdir()
    shutil.copy(next((job.ranks / "rank_0").iterdir()), tmp_path / "mixed" / "rank_0")
    _save({"w": mindspore.Tensor(np.zeros(2, np.float32))}, tmp_path / "mixed" / "rank_1" / "a.safetensors",
          "safetensors")
    with pytest.raises(UnsupportedFormatError, match="mixes"):
        import_checkpoint(tmp_path / "mixed", tmp_path / "out", strategy_files=job.stage_files)
    (tmp_path / "empty" / "rank_0").mkdir(parents=True)
    with pytest.raises(UnsupportedFormatError, match="no .ckpt"):
        import_checkpoint(tmp_path / "empty", tmp_path / "out", strategy_files=job.stage_files)


def test_listed_replicas_that_differ_between_ranks_are_refused(jobs, tmp_path):
    """A box the strategy gives several ranks (a replica) whose copies differ used to be imported from its lowest
    rank, silently: a strategy from another compile (a data-parallel mesh dim where the job split the tensor) or
    rank files of different steps. Now refused naming the parameter, the box and the ranks; nothing committed."""
    job = jobs("dp_replicas_4")  # mesh (2, 2): ranks 2 and 3 hold the replicas of ranks 0 and 1
    src = _with_extra_entries(job, tmp_path / "src", lambda rank, e: {  # rank 3's weight rows of a later step
        "dense.weight": mindspore.Tensor(e["dense.weight"].asnumpy() + (rank == 3))})
    with pytest.raises(LayoutError) as refused:
        import_checkpoint(src, tmp_path / "out", strategy_files=job.stage_files)
    message = str(refused.value)
    assert "parameter 'dense.weight' (global shape [8, 6])" in message, message
    assert "ranks [3] hold other values than rank 1 for the box at [4, 0]" in message, message
    assert "different steps" in message and "strategy file" in message, message
    assert not (tmp_path / "out" / "metadata.json").exists()
    src = _with_extra_entries(job, tmp_path / "bias", lambda rank, e: {  # replicated everywhere: one differs
        "dense.bias": mindspore.Tensor(e["dense.bias"].asnumpy() * (2 if rank == 2 else 1))})
    with pytest.raises(LayoutError, match=r"'dense.bias'.*ranks \[2\] hold other values than rank 0 for the box "
                                          r"at \[0\]"):
        import_checkpoint(src, tmp_path / "out", strategy_files=job.stage_files)
    assert main(["import", str(src), str(tmp_path / "unchecked"), "--strategy", str(job.stage_files[0]),
                 "--no-check-replicas"]) == 0  # the caller's choice: rank 0's copies, unread replicas
    rank_0 = _load_file(src / "rank_0" / "checkpoint_0.ckpt")["dense.bias"]
    assert _load_ours(tmp_path / "unchecked")["dense.bias"].tobytes() == rank_0.tobytes()
    job = jobs("opt_parallel_8")  # optimizer-parallel shards of one shape on the ranks of a group: not replicas
    import_checkpoint(job.ranks, tmp_path / "opt", strategy_files=job.stage_files)
    _assert_same(_load_ours(tmp_path / "opt"), {k: v.asnumpy() for k, v in job.full.items()}, "opt_parallel_8")


def test_rank_files_saved_without_redundancy_import_whole(jobs, tmp_path):
    """Files saved with remove_redundancy (a replica's slice on one rank only) import as long as every slice is held."""
    job = jobs("dp_replicas_4")  # mesh (2, 2): ranks 2 and 3 hold the replicas of ranks 0 and 1
    for rank_dir in sorted(job.ranks.iterdir()):
        rank = int(rank_dir.name.split("_")[1])
        entries = dict(mindspore.load_checkpoint(str(next(rank_dir.iterdir()))))
        if rank >= 2:
            entries = {k: v for k, v in entries.items() if k not in CASES["dp_replicas_4"].shapes}
        _save(entries, tmp_path / "src" / rank_dir.name / f"checkpoint_{rank}.ckpt", "ckpt")
    import_checkpoint(tmp_path / "src", tmp_path / "ours", strategy_files=job.stage_files)
    _assert_same(_load_ours(tmp_path / "ours"), {k: v.asnumpy() for k, v in job.full.items()}, "no redundancy")


def test_a_strategy_whose_names_differ_by_a_prefix_is_refused_naming_it(jobs, tmp_path):
    """Rank files saved under other names than the strategy lists, by one prefix (``network.``: a wrapping
    Cell's naming), said "'dense.bias' is not in the strategy file" as if the parameter were unlisted, and a
    slice holding the same values on every rank was stored as the whole tensor. The prefix is named now, both
    ways, with the fix, before anything is written."""
    job = jobs("tp2d_8")
    src = tmp_path / "prefixed"
    for rank_dir in sorted(job.ranks.iterdir()):
        entries = dict(mindspore.load_checkpoint(str(next(rank_dir.iterdir()))))
        _save({(name if name in EXTRAS else f"network.{name}"): value for name, value in entries.items()},
              src / rank_dir.name / "checkpoint.ckpt", "ckpt")
    fix = ("all 3 parameters the strategy lists differ only by it), so no parameter would find its layout and each "
           "rank's slice would pass for a whole tensor (MindSpore's transform_checkpoints matches names exactly "
           "too). Pass the strategy file the job that wrote these rank files saved (its strategy_ckpt_config "
           "save_file), or save the rank files from the network the strategy was written for (a parameter named ")
    with pytest.raises(CheckpointValueError) as refused:
        import_checkpoint(src, tmp_path / "out", strategy_files=job.stage_files)
    assert str(refused.value) == (
        "the rank files name their parameters with the prefix 'network.' that the strategy's names lack ('dense.bias' "
        f"in the strategy, 'network.dense.bias' in {src / 'rank_0' / 'checkpoint.ckpt'}; {fix}'dense.bias')")
    case = CASES["tp2d_8"]
    renamed = StrategyCase(stages=tuple(tuple(ParamStrategy(f"model.{p.name}", p.dev_matrix, p.tensor_map)
                                              for p in stage) for stage in case.stages))
    with pytest.raises(CheckpointValueError) as reverse:
        import_checkpoint(job.ranks, tmp_path / "out", strategy_files=write_case(tmp_path / "renamed", renamed))
    assert str(reverse.value) == (
        "the strategy names its parameters with the prefix 'model.' that the rank files' names lack "
        f"('model.dense.bias' in the strategy, 'dense.bias' in {next((job.ranks / 'rank_0').iterdir())}; {fix}'model.dense.bias')")
    assert not (tmp_path / "out").exists()
