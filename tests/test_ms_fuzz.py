"""Seeded random reshards compared bit for bit with MindSpore's ``transform_checkpoints`` (tests/ms_fuzz.py).

A fixed set of seeds runs here; a longer search: ``nice -n 10 python -m tests.ms_fuzz --first 1000 --count 5000``.
"""

from __future__ import annotations

import mindspore
import pytest

from tests.ms_fuzz import DTYPES, splits_evenly, make_case, run_case

mindspore.set_device("CPU")

#: Seeds run by the suite (about 0.2 s each).
SEEDS = range(40)


def _features(seed: int) -> set[str]:
    case = make_case(seed)
    found = set(case.dtypes.values()) | {f"import {case.import_format}", f"export {case.export_format}",
                                             f"strategy {case.strategy_format}"}
    found |= {f"{len(shape)}-D" for shape in case.shapes.values()}
    if case.states:
        found.add("optimizer states")
    if not splits_evenly(case.dst, case.shapes):
        found.add("uneven destination")
    for job in (case.src, case.dst):
        found.add(f"{len(job.stages)} stages")
        for param in (p for stage in job.stages for p in stage):
            if param.dev_matrix and max(param.dev_matrix) >= 8:
                found.add("a mesh dim of 8 or more")
            if any(d % 3 == 0 for d in param.dev_matrix):
                found.add("a mesh dim of 3 or 6")
            if param.opt_weight_shard_size:
                found.add("optimizer parallel")
            if any(isinstance(e, tuple) for e in param.tensor_map):
                found.add("dim over several mesh dims")
            if -1 in param.tensor_map:
                found.add("replicated dim")
    return found


def test_the_seeds_cover_every_feature():
    covered = set().union(*(_features(seed) for seed in SEEDS))
    wanted = set(DTYPES) | {
        "import safetensors", "export safetensors", "strategy json", "strategy merged", "strategy directory",
        "1 stages", "2 stages", "4 stages",
        "optimizer parallel", "dim over several mesh dims", "replicated dim", "0-D", "4-D", "uneven destination",
        "optimizer states", "a mesh dim of 8 or more", "a mesh dim of 3 or 6", "3 stages",
    }
    assert wanted <= covered, wanted - covered


def test_cases_are_reproducible():
    assert make_case(7) == make_case(7) and make_case(7) != make_case(8)


@pytest.mark.parametrize("first", range(SEEDS.start, SEEDS.stop, 10))
def test_random_reshards_agree_with_mindspore(tmp_path, first):
    ran = 0
    for seed in range(first, first + 10):
        outcome = run_case(make_case(seed), tmp_path / str(seed))
        assert not outcome.defects, (seed, outcome.defects)
        ran += not outcome.refused or outcome.refused.endswith("(expected)")
    assert ran >= 8  # unexpected refusals are rare: most cases are compared
