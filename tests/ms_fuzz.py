"""Seeded random reshards compared with MindSpore's own ``transform_checkpoints``.

One case (:func:`make_case`) is a random source job and a random destination
job over the same parameters: device matrices, tensor maps (replicated dims,
``-1`` entries, a tensor dim split over several mesh dims), optimizer-parallel
shard sizes, pipeline stages and dtypes. :func:`run_case` then

1. saves the known full tensors and lets MindSpore slice them into the source
   job's per-rank files (``transform_checkpoints`` from no strategy);
2. lets MindSpore reshard those files to the destination job, and slice the
   full tensors straight to the destination job (the reference);
3. imports the source rank files with ``hp-ckpt import`` (compared with the full
   tensors), exports them for the destination job with ``export-mindspore``
   (compared rank file by rank file with the reference), loads each destination
   rank's sliced Parameters through the strategy files, and places each rank's
   slice by :func:`layouts_from_strategy` and by ``Layout.from_mindspore_layout``
   of the ``parameter_layout_dict`` entry the rank would get.

With ``--load-distributed`` MindSpore's ``load_distributed_checkpoint`` also
merges the source files; where it disagrees with the full tensors (it does for
some optimizer-parallel layouts over several replica dims, where
``transform_checkpoints`` and hyper_parallel agree with the full tensors) that
is noted as MindSpore's own disagreement.

A destination that cannot split a tensor evenly (some cases are sized for the
source job only) must be refused by every path, naming the parameter.

A result that differs is returned as a message; MindSpore disagreeing with
itself is noted separately (its own bug, not ours). Longer run::

    nice -n 10 python -m tests.ms_fuzz --first 100 --count 500
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from tests.strategy_files import ParamStrategy, StrategyCase, strategy_for_mindspore, write_case

__all__ = ["FuzzCase", "Outcome", "make_case", "run_case", "splits_evenly"]

DTYPES = ("float32", "float16", "bfloat16", "int32", "bool")
#: Tensors no strategy lists (replicated whole on every rank).
EXTRAS = {"global_step": np.array([7], dtype=np.int32)}
#: Prefix of the optimizer states some cases add: listed in MindSpore's strategy, not in the one
#: hyper_parallel reads (a state follows its parameter's layout there).
STATE = "adam_m."


@dataclass(frozen=True)
class FuzzCase:
    """A source and a destination job over the same parameters."""

    seed: int
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    src: StrategyCase
    dst: StrategyCase
    #: Format of the source rank files handed to the import, and of the exported files.
    import_format: str = "ckpt"
    export_format: str = "ckpt"
    #: The strategy hyper_parallel reads: ``ckpt`` / ``json`` stage files, ``merged`` (one file by
    #: merge_pipeline_strategys) or ``directory`` (MindSpore's tools always get protobuf).
    strategy_format: str = "ckpt"
    #: Whether every parameter has an optimizer state ``adam_m.<name>`` sliced like it.
    states: bool = False
    #: Whether MindSpore's load_distributed_checkpoint is also asked to merge the source files
    #: (for notes on MindSpore's own disagreements only).
    check_load_distributed: bool = False


@dataclass
class Outcome:
    """What one case found: our defects, MindSpore's own disagreements, refusals."""

    seed: int
    defects: list[str] = field(default_factory=list)
    mindspore: list[str] = field(default_factory=list)
    refused: str = ""


def _random_entry(rng: np.random.Generator, free: list[int], mesh: tuple[int, ...], *, several: bool):
    """-1, one free mesh dim (counted from the right), or two of them (outermost first) if ``several``.

    A 1-D tensor's dim is never split over several mesh dims: the strategy file cannot say so (its one
    ``TensorMap`` then reads as a map of one dim per entry, in MindSpore's reader as in ours).
    """
    choice = rng.random()
    usable = [k for k in free if mesh[len(mesh) - 1 - k] > 1] or free
    if not usable or choice < 0.35:
        return -1
    if choice > 0.85 and len(usable) >= 2 and several:
        pair = sorted(rng.choice(usable, size=2, replace=False).tolist(), reverse=True)
        for k in pair:
            free.remove(k)
        return tuple(pair)
    k = int(rng.choice(usable))
    free.remove(k)
    return k


def _random_mesh(rng: np.random.Generator, size: int) -> tuple[int, ...]:
    """A device matrix of ``size`` ranks: 1-3 dims of 1, 2, 3, 4, 6, 8, 12 or 16 (mostly > 1)."""
    dims: list[int] = []
    left = size
    for _ in range(int(rng.integers(1, 4)) - 1):
        part = int(rng.choice([d for d in (1, 2, 2, 2, 3, 4) if left % d == 0 and (d < left or d == 1)]))
        dims.append(part)
        left //= part
    dims.append(left)
    rng.shuffle(dims)
    return tuple(dims)


def _random_param(rng: np.random.Generator, name: str, ndim: int, mesh: tuple[int, ...]) -> ParamStrategy:
    free = list(range(len(mesh)))
    tensor_map = tuple(_random_entry(rng, free, mesh, several=ndim > 1) for _ in range(ndim))
    used = {k for e in tensor_map for k in (e if isinstance(e, tuple) else (e,)) if k != -1}
    replica = [m for m in range(len(mesh)) if (len(mesh) - 1 - m) not in used and mesh[m] > 1]
    step = size = 0
    if ndim and replica and rng.random() < 0.5:
        total = math.prod(mesh[m] for m in replica)
        size = int(rng.choice([-1] + [d for d in (2, 4, 8) if total % d == 0]))
        step = math.prod(mesh[replica[0] + 1:]) if len(replica) == 1 else 1
    return ParamStrategy(name, mesh, tensor_map, opt_weight_shard_step=step, opt_weight_shard_size=size)


def _random_job(rng: np.random.Generator, ndims: dict[str, int]) -> StrategyCase:
    """1-4 pipeline stages of up to 16 ranks in all; a parameter on one stage or shared by several."""
    stages = int(rng.choice([1, 1, 1, 2, 2, 3, 4]))
    stage_size = int(rng.choice({1: [2, 3, 4, 4, 6, 8, 8, 12, 16], 2: [1, 2, 3, 4, 4, 6, 8], 3: [1, 2, 3, 4],
                                 4: [1, 2, 2, 3, 4]}[stages]))
    mesh = _random_mesh(rng, stage_size)
    per_stage: list[list[ParamStrategy]] = [[] for _ in range(stages)]
    for position, (name, ndim) in enumerate(sorted(ndims.items())):
        param = _random_param(rng, name, ndim, mesh)
        homes = [position % stages]
        if stages > 1 and rng.random() < 0.3:
            homes = sorted(set(rng.choice(stages, size=int(rng.integers(2, stages + 1)), replace=False).tolist()))
        for stage in homes:
            per_stage[stage].append(param)
    first = next(p for params in per_stage for p in params)
    for params in per_stage:
        if not params:  # every stage holds a parameter
            params.append(first)
    return StrategyCase(stages=tuple(tuple(p) for p in per_stage))


def _splits(job: StrategyCase, name: str, ndim: int) -> list[int]:
    """How many pieces each dim of ``name`` is cut into by ``job`` (model and optimizer parallel)."""
    param = next(p for stage in job.stages for p in stage if p.name == name)
    mesh = param.dev_matrix
    splits = []
    for entry in param.tensor_map:
        parts = entry if isinstance(entry, tuple) else (entry,)
        splits.append(math.prod(mesh[len(mesh) - 1 - k] for k in parts if k != -1))
    size = param.opt_weight_shard_size
    if size and ndim:
        splits[0] *= math.prod(mesh) // math.prod(splits) if size == -1 else size
    return splits


def make_case(seed: int) -> FuzzCase:
    """The random case of ``seed`` (the same on every machine)."""
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 5))
    ndims = {f"p{i}.weight": int(rng.choice([0, 1, 1, 2, 2, 2, 3, 3, 4])) for i in range(count)}
    dtypes = {name: str(rng.choice(DTYPES)) for name in ndims}
    src, dst = _random_job(rng, ndims), _random_job(rng, ndims)
    # Each dim a small multiple of what both jobs cut it into (a slice of one row included).
    shapes = {}
    for name, ndim in sorted(ndims.items()):
        cuts = zip(_splits(src, name, ndim), _splits(dst, name, ndim))
        shapes[name] = tuple(math.lcm(a, b) * int(rng.choice([1, 2, 3])) for a, b in cuts)
    import_format, export_format = (str(f) for f in rng.choice(["ckpt", "ckpt", "safetensors"], size=2))
    strategy_format = str(rng.choice(["ckpt", "ckpt", "json", "merged", "directory"]))
    if rng.random() < 0.15:  # sized for the source job only: the destination may not split evenly
        sizes = np.random.default_rng(seed + 7)
        shapes = {name: tuple(cut * int(sizes.choice([1, 3, 5])) for cut in _splits(src, name, ndim))
                  for name, ndim in sorted(ndims.items())}
    states = bool(rng.random() < 0.3)
    return FuzzCase(seed, shapes, dtypes, StrategyCase(src.stages, shapes), StrategyCase(dst.stages, shapes),
                    import_format, export_format, strategy_format, states)


def _full_tensors(case: FuzzCase):
    import mindspore  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(case.seed + 1_000_003)
    tensors = {}
    shapes = sorted(case.shapes.items())
    if case.states:
        shapes += [(STATE + name, shape) for name, shape in shapes]
    for name, shape in shapes:
        dtype = case.dtypes[name.removeprefix(STATE)]
        if dtype == "bool":
            data = rng.random(shape) < 0.5
        elif dtype == "int32":
            data = rng.integers(-2**31, 2**31 - 1, size=shape, dtype=np.int32)
        else:
            data = rng.standard_normal(shape).astype(np.float32)
        tensor = mindspore.Tensor(data)
        if dtype == "bfloat16":
            tensor = tensor.astype(mindspore.bfloat16)
        elif dtype == "float16":
            tensor = mindspore.Tensor(data.astype(np.float16))
        tensors[name] = tensor
    tensors.update({name: mindspore.Tensor(value) for name, value in EXTRAS.items()})
    return tensors


def _with_states(job: StrategyCase, states: bool) -> StrategyCase:
    """``job`` with each parameter's state listed beside it (what MindSpore's tools read), if ``states``."""
    if not states:
        return job
    return StrategyCase(stages=tuple(params + tuple(replace(p, name=STATE + p.name) for p in params)
                                     for params in job.stages))


def _rank_files(directory: Path) -> dict[int, dict[str, np.ndarray]]:
    import mindspore  # pylint: disable=import-outside-toplevel

    found = {}
    for rank_dir in sorted(directory.glob("rank_*")):
        files = sorted(rank_dir.iterdir())
        assert len(files) == 1, files
        fmt = "safetensors" if files[0].suffix == ".safetensors" else "ckpt"
        loaded = mindspore.load_checkpoint(str(files[0]), format=fmt)
        found[int(rank_dir.name[5:])] = {k: v.asnumpy() for k, v in loaded.items()}
    return found


def _differences(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray], where: str) -> list[str]:
    out = []
    if sorted(actual) != sorted(expected):
        out.append(f"{where}: keys {sorted(actual)} != {sorted(expected)}")
    for name in sorted(set(actual) & set(expected)):
        got, want = actual[name], expected[name]
        if (got.dtype, got.shape) != (want.dtype, want.shape):
            out.append(f"{where}: {name} is {got.dtype}{got.shape}, expected {want.dtype}{want.shape}")
        elif got.tobytes() != want.tobytes():
            out.append(f"{where}: {name} values differ")
    return out


def _compare_ranks(actual, expected, where: str) -> list[str]:
    if sorted(actual) != sorted(expected):
        return [f"{where}: ranks {sorted(actual)} != {sorted(expected)}"]
    return [d for rank in sorted(expected) for d in _differences(actual[rank], expected[rank], f"{where} rank {rank}")]


def _boxes(dst_files: list[str], full: dict[str, np.ndarray], world: int) -> dict[int, dict[str, np.ndarray]]:
    """Each destination rank's slices, placed by the layouts a sliced Parameter gets on load."""
    from hyper_parallel.core.strategy_file import (  # pylint: disable=import-outside-toplevel
        layout_for_state_key,
        layouts_from_strategy,
    )

    out = {}
    for rank in range(world):
        tensors = {}
        layouts = layouts_from_strategy(dst_files, rank=rank)
        for name in sorted(set(full) - set(EXTRAS)):
            layout = layout_for_state_key(layouts, name)
            if layout is None:
                continue
            shape = full[name].shape
            offsets = layout.shard_offsets(shape, rank, name)
            local = layout.local_shape(shape, name)
            tensors[name] = full[name][tuple(slice(o, o + n) for o, n in zip(offsets, local))]
        tensors.update({k: full[k] for k in EXTRAS})
        out[rank] = tensors
    return out


def _layout_dict_boxes(dst: StrategyCase, full: dict[str, np.ndarray], reference) -> dict[int, dict[str, np.ndarray]]:
    """Each destination rank's slices, placed by ``Layout.from_mindspore_layout`` of the
    ``Cell.parameter_layout_dict`` entry MindSpore would give that rank (slice shape from its file)."""
    from hyper_parallel.core.layout import Layout  # pylint: disable=import-outside-toplevel

    out = {}
    stage_size = math.prod(dst.stages[0][0].dev_matrix)
    for rank, tensors in reference.items():
        params = {p.name: p for p in dst.stages[rank // stage_size]}
        placed = {}
        for name, value in tensors.items():
            if name in EXTRAS:
                placed[name] = full[name]
                continue
            param = params[name.removeprefix(STATE)]
            tensor_map = [list(e) if isinstance(e, tuple) else e for e in param.tensor_map]
            group = "opt_group" if param.opt_weight_shard_size else ""
            entry = [list(param.dev_matrix), tensor_map, list(value.shape), 0, True, group,
                     list(full[name].shape), list(value.shape)]
            layout = Layout.from_mindspore_layout(entry, name=name, rank=rank)
            shape = full[name].shape
            offsets = layout.shard_offsets(shape, rank, name)
            local = layout.local_shape(shape, name)
            placed[name] = full[name][tuple(slice(o, o + n) for o, n in zip(offsets, local))]
        out[rank] = placed
    return out


def _load_sliced(ckpt: Path, dst_files: list[str], reference, world: int) -> dict[int, dict[str, np.ndarray]]:
    """Each destination rank loads ``ckpt`` into sliced Parameters placed by the strategy files."""
    import mindspore  # pylint: disable=import-outside-toplevel

    import hyper_parallel.core.distributed_checkpoint as dcp  # pylint: disable=import-outside-toplevel
    # pylint: disable-next=import-outside-toplevel
    from hyper_parallel.core.distributed_checkpoint._mindspore_sliced import apply_mindspore_layouts

    out = {}
    for rank in range(world):
        params = {}
        for name, value in reference[rank].items():
            param = mindspore.Parameter(mindspore.Tensor(np.zeros_like(value)), name=name, requires_grad=False)
            param.sliced = name not in EXTRAS
            params[name] = param
        state = apply_mindspore_layouts(params, source=dst_files, rank=rank)
        dcp.load(state, checkpoint_id=ckpt, no_dist=True)
        out[rank] = {name: param.asnumpy() for name, param in params.items()}
    return out


def _load_ours(path: Path) -> dict[str, np.ndarray]:
    import hyper_parallel.core.distributed_checkpoint as dcp  # pylint: disable=import-outside-toplevel

    targets = {name: None for name in dcp.read_metadata(path).state_dict_metadata}
    dcp.load(targets, checkpoint_id=path, no_dist=True)
    return {k: np.asarray(v) for k, v in targets.items()}


def _strategy_source(directory: Path, job: StrategyCase, how: str) -> list[str]:
    """The strategy hyper_parallel is given: per-stage protobuf or JSON files, the stages merged by
    ``merge_pipeline_strategys`` into one file, or the directory of the stage files."""
    paths = write_case(directory, job, fmt="json" if how == "json" else "ckpt")
    if how == "merged":
        return [strategy_for_mindspore(directory.parent / f"{directory.name}_merged", paths)]
    return [str(directory)] if how == "directory" else paths


def splits_evenly(job: StrategyCase, shapes: dict[str, tuple[int, ...]]) -> bool:
    """Whether ``job`` cuts every tensor of ``shapes`` into equal pieces."""
    return all(size % cut == 0 for name, shape in shapes.items()
               for size, cut in zip(shape, _splits(job, name, len(shape))))


def _must_refuse(case: FuzzCase, root: Path, src_files: list[str], dst_files: list[str], outcome: Outcome) -> Outcome:
    """A destination that does not split the tensors evenly: every path refuses, naming the parameter."""
    from hyper_parallel.cli import export_mindspore, import_checkpoint  # pylint: disable=import-outside-toplevel
    from hyper_parallel.core.distributed_checkpoint.errors import (  # pylint: disable=import-outside-toplevel
        CheckpointError,
    )

    uneven = sorted(name for name, shape in case.shapes.items()
                    if any(size % cut for size, cut in zip(shape, _splits(case.dst, name, len(shape)))))
    uneven += [STATE + name for name in uneven] if case.states else []
    try:
        import_checkpoint(root / "src", root / "ours", strategy_files=src_files)
    except CheckpointError as exc:
        outcome.refused = f"import: {type(exc).__name__}: {exc}"
        return outcome
    full = _load_ours(root / "ours")
    names = [repr(name) for name in full]
    paths = {"export": lambda: export_mindspore(root / "ours", root / "out", strategy_files=dst_files),
             "layouts_from_strategy box": lambda: _boxes(dst_files, full, case.dst.world_size)}
    for what, run in paths.items():
        try:
            run()
        except CheckpointError as exc:
            if not any(name in str(exc) for name in names):  # another tensor may be refused first
                outcome.defects.append(f"{what} refused an uneven destination without naming a tensor: {exc}")
        else:
            outcome.defects.append(f"{what} accepted a destination that splits {uneven} unevenly")
    outcome.refused = f"uneven destination for {uneven} (expected)"
    return outcome


def _load_distributed_checkpoint(root: Path, ms_src: str, full: dict[str, np.ndarray], world: int) -> list[str]:
    """MindSpore's other merge of the source rank files (``load_distributed_checkpoint``) vs the full tensors."""
    import mindspore  # pylint: disable=import-outside-toplevel

    net = mindspore.nn.Cell()
    names = sorted(set(full) - set(EXTRAS))
    for position, name in enumerate(names):
        setattr(net, f"p{position}", mindspore.Parameter(mindspore.Tensor(np.zeros_like(full[name])), name=name,
                                                         requires_grad=False))
    files = [str(next((root / "src" / f"rank_{rank}").iterdir())) for rank in range(world)]
    try:
        mindspore.load_distributed_checkpoint(net, files, None, train_strategy_filename=ms_src)
    except Exception as exc:  # pylint: disable=broad-except
        return [f"load_distributed_checkpoint refused: {type(exc).__name__}: {str(exc)[:200]}"]
    merged = {p.name: p.asnumpy() for p in net.get_parameters()}
    return [f"load_distributed_checkpoint: {name} differs from the full tensor"
            for name in names if merged[name].tobytes() != full[name].tobytes()]


def run_case(case: FuzzCase, root: Path) -> Outcome:
    """Run one case in ``root`` (a new directory); see the module docstring."""
    import mindspore  # pylint: disable=import-outside-toplevel

    from hyper_parallel.cli import export_mindspore, import_checkpoint  # pylint: disable=import-outside-toplevel
    from hyper_parallel.core.distributed_checkpoint.errors import (  # pylint: disable=import-outside-toplevel
        CheckpointError,
    )

    outcome = Outcome(case.seed)
    tensors = _full_tensors(case)
    full = {k: v.asnumpy() for k, v in tensors.items()}
    ms_src, ms_dst = (strategy_for_mindspore(root / where, write_case(root / where, _with_states(job, case.states)))
                      for where, job in (("src_strategy", case.src), ("dst_strategy", case.dst)))
    src_files, dst_files = (_strategy_source(root / where, job, case.strategy_format)
                            for where, job in (("src_ours", case.src), ("dst_ours", case.dst)))
    (root / "full" / "rank_0").mkdir(parents=True)
    mindspore.save_checkpoint([{"name": k, "data": v} for k, v in tensors.items()],
                              str(root / "full" / "rank_0" / "full.ckpt"))
    try:
        mindspore.parallel.transform_checkpoints(str(root / "full"), str(root / "src"), "c", None, ms_src)
    except Exception as exc:  # pylint: disable=broad-except
        outcome.mindspore.append(f"MindSpore cannot slice the full tensors: {type(exc).__name__}: {exc}")
        return outcome
    if case.check_load_distributed:
        outcome.mindspore += _load_distributed_checkpoint(root, ms_src, full, case.src.world_size)
    if not splits_evenly(case.dst, case.shapes):
        return _must_refuse(case, root, src_files, dst_files, outcome)
    try:
        mindspore.parallel.transform_checkpoints(str(root / "full"), str(root / "ref"), "c", None, ms_dst)
    except Exception as exc:  # pylint: disable=broad-except
        outcome.mindspore.append(f"MindSpore cannot slice the full tensors: {type(exc).__name__}: {exc}")
        return outcome
    reference = _rank_files(root / "ref")
    try:
        mindspore.parallel.transform_checkpoints(str(root / "src"), str(root / "ms"), "c", ms_src, ms_dst)
        outcome.mindspore += _compare_ranks(_rank_files(root / "ms"), reference, "MindSpore src->dst vs full->dst")
    except Exception as exc:  # pylint: disable=broad-except
        outcome.mindspore.append(f"MindSpore src->dst refused: {type(exc).__name__}: {exc}")
    source = root / "src"
    if case.import_format == "safetensors":  # MindSpore's own safetensors writer, from its ckpt rank files
        source = root / "src_safetensors"
        for path in sorted((root / "src").glob("rank_*/*.ckpt")):
            (source / path.parent.name).mkdir(parents=True)
            mindspore.save_checkpoint(dict(mindspore.load_checkpoint(str(path))),
                                      str(source / path.parent.name / path.with_suffix(".safetensors").name),
                                      format="safetensors")
    try:
        import_checkpoint(source, root / "ours", strategy_files=src_files)
    except CheckpointError as exc:
        outcome.refused = f"import: {type(exc).__name__}: {exc}"
        return outcome
    outcome.defects += _differences(_load_ours(root / "ours"), full, "import vs full")
    try:
        boxes = _boxes(dst_files, full, case.dst.world_size)
    except CheckpointError as exc:
        outcome.refused = f"destination layouts: {type(exc).__name__}: {exc}"
        return outcome
    outcome.defects += _compare_ranks(boxes, reference, "layouts_from_strategy box vs MindSpore")
    outcome.defects += _compare_ranks(_layout_dict_boxes(case.dst, full, reference), reference,
                                      "Layout.from_mindspore_layout box vs MindSpore")
    outcome.defects += _compare_ranks(_load_sliced(root / "ours", dst_files, reference, case.dst.world_size),
                                      reference, "load into sliced Parameters vs MindSpore")
    try:
        export_mindspore(root / "ours", root / "out", strategy_files=dst_files, fmt=case.export_format)
    except CheckpointError as exc:
        outcome.refused = f"export: {type(exc).__name__}: {exc}"
        return outcome
    outcome.defects += _compare_ranks(_rank_files(root / "out"), reference, "export vs MindSpore full->dst")
    return outcome


def main(argv: list[str] | None = None) -> int:
    """Run seeds ``first .. first + count - 1``; print a line per finding and a summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--minutes", type=float, default=0.0, help="stop after this long (0: no limit)")
    parser.add_argument("--load-distributed", action="store_true",
                        help="also note where MindSpore's load_distributed_checkpoint disagrees with the full tensors")
    args = parser.parse_args(argv)
    import mindspore  # pylint: disable=import-outside-toplevel

    mindspore.set_device("CPU")
    start, runs, bad, refused, ms_bad = time.monotonic(), 0, 0, 0, 0
    for seed in range(args.first, args.first + args.count):
        if args.minutes and time.monotonic() - start > args.minutes * 60:
            break
        root = Path(tempfile.mkdtemp(prefix=f"msfuzz{seed}_"))
        case = replace(make_case(seed), check_load_distributed=args.load_distributed)
        try:
            outcome = run_case(case, root)
        except Exception as exc:  # pylint: disable=broad-except
            outcome = Outcome(seed, defects=[f"crash: {type(exc).__name__}: {exc}"])
        runs += 1
        if runs % 200 == 0:
            print(f"progress: {runs} cases, {bad} with defects, {time.monotonic() - start:.0f} s", flush=True)
        bad += bool(outcome.defects)
        refused += bool(outcome.refused)
        ms_bad += bool(outcome.mindspore)
        for line in outcome.defects:
            print(f"seed {seed} DEFECT {line}", flush=True)
        for line in outcome.mindspore:
            print(f"seed {seed} MINDSPORE {line}"[:400], flush=True)
        if outcome.refused:
            print(f"seed {seed} REFUSED {outcome.refused}"[:400], flush=True)
        if outcome.defects or outcome.mindspore or outcome.refused:
            print(f"seed {seed} case src={case.src.stages} dst={case.dst.stages} shapes={case.shapes} "
                  f"dtypes={case.dtypes} formats={case.import_format}->{case.export_format} "
                  f"strategy={case.strategy_format} states={case.states}", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(f"ran {runs} cases in {time.monotonic() - start:.0f} s: {bad} with defects, {refused} refused, "
          f"{ms_bad} where MindSpore disagrees with itself or refuses")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
