"""Load hostile checkpoints with the address space capped: no unbounded allocation.

Usage: ``hostile_child.py CASES_JSON RESULTS_JSON``

Each case is ``{"name", "path", "how"}`` with ``how`` one of ``load_none``
(``dcp.load`` into ``None`` placeholders, which take the stored shape),
``one_line`` (``load_checkpoint(path)`` without a target), ``read_header``
(of the file at ``path``). After the imports, the address space is capped at
what the process uses plus 2 GiB; a case that tries to allocate the sizes the
checkpoint declares fails with ``MemoryError`` instead of swapping the host.
RESULTS_JSON maps each case to the exception it raised (type, its classes,
message) or ``null``.
"""

from __future__ import annotations

import json
import re
import resource
import sys
from pathlib import Path
from typing import Any

import mindspore  # noqa: F401  (imported before the cap: one_line converts to MindSpore tensors)

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._one_line import load_checkpoint
from hyper_parallel.core.distributed_checkpoint._format.safetensors_file import read_header

CAP_HEADROOM = 2 << 30


def _cap_address_space() -> None:
    status = Path("/proc/self/status").read_text()
    used = int(re.search(r"VmSize:\s+(\d+) kB", status).group(1)) * 1024
    limit = used + CAP_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _run(case: dict[str, Any]) -> None:
    path = case["path"]
    if case["how"] == "load_none":
        metadata = dcp.read_metadata(path)
        dcp.load({fqn: None for fqn in metadata.state_dict_metadata}, checkpoint_id=path, no_dist=True)
    elif case["how"] == "one_line":
        load_checkpoint(path)
    elif case["how"] == "read_header":
        read_header(path)
    else:
        raise ValueError(case["how"])


def main(argv: list[str]) -> int:
    cases = json.loads(Path(argv[1]).read_text())
    _cap_address_space()
    results: dict[str, Any] = {}
    for case in cases:
        try:
            _run(case)
            results[case["name"]] = None
        except BaseException as exc:  # pylint: disable=broad-except
            results[case["name"]] = {
                "type": type(exc).__name__,
                "classes": [cls.__name__ for cls in type(exc).__mro__],
                "message": str(exc)[:2000],
            }
    Path(argv[2]).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
