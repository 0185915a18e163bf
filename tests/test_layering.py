"""The package's imports point one way: API -> strategies -> engine -> storage -> format.

Walks every module of ``hyper_parallel`` with ``ast`` (imports inside
functions included, so a lazy import cannot hide a cycle) and fails on an
import circle between checkpoint modules, or on an import from a lower layer
to a higher one.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "hyper_parallel.core.distributed_checkpoint"

#: Layers of the checkpoint package, bottom first. A module may import its own
#: layer or a lower one. Names are module paths relative to PACKAGE.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("errors and metadata", frozenset({"errors", "metadata", "_options", "_gc_pause", "_grid_chunks", "_lazy_pool"})),
    ("on-disk format", frozenset({"_format", "_format.safetensors_file", "_format.metadata_json",
                                  "_format.checksum", "_format.byte_ranges", "_format.cover",
                                  "_format.header_check", "_format.json_stream",
                                  "_format.consistency", "_format.regular_runs", "_format.storage_entry",
                                  "_format.entry_checks", "_format.grid_holders", "_format.rank_index",
                                  "_format.indexed_storage", "_format.indexed_json",
                                  "_format.deferred_storage"})),
    ("plans and planners", frozenset({"planner", "mapping", "_chunk_search", "type_handlers", "_builtin_handlers",
                                      "_flatten", "_mindspore_sliced", "_device_targets",
                                      "_state_items", "_global_plan", "_replicated_read", "standard_planner",
                                      "_leaf_entry", "_save_planner", "_load_planner", "_load_target_checks",
                                      "_load_target_match", "_piece_reads",
                                      "_layout_plan", "_layout_merge", "_layout_writers", "_save_layout",
                                      "_layout_memo",
                                      "_whole_reads", "_unwritten_keys"})),
    ("storage", frozenset({"storage", "filesystem_writer", "filesystem_reader", "_run_reads", "_read_items",
                           "_safe_files", "_save_lease", "_file_ops", "_data_file", "_commit_cleanup", "_device_reads",
                           "_rank_records", "_data_writing", "_commit_guard", "_save_id", "_index_form", "_index_plan",
                           "_metadata_form", "_writer_index_form", "_writer_records", "_writer_set_up",
                           "_verify_reads", "_verify_windows", "_verify_tiles", "_verify_share", "_kept_files",
                           "_read_priming", "_metadata_file", "_reader_headers", "_reader_verify", "_reader_reads"})),
    ("object storage", frozenset({"_object_io", "_object_garbage", "_fsspec_writer", "_fsspec_reader", "_object_steps",
                                   "_index_objects"})),
    ("engine", frozenset({"_collectives", "_commit_receipt", "_engine", "_load_engine", "_async_engine",
                         "_storage_choice", "_staging", "_stage_copies", "_copy_threads", "_fork_writer",
                         "_async_queue", "_deferred_save", "_plan_cache", "_background_commit", "_one_checkpoint"})),
    ("strategies", frozenset({"strategies"})),
    ("public API", frozenset({"api", "async_checkpoint", "_one_line", "_ms_keywords", "_ms_name_match", "manager",
                              "_manager_record", "_step_dirs", "_retention", "callback", "_breakpoint_steps",
                              "_resume_position", ""})),
)

#: Imports that break the rule today, each to be removed by the change that fixes it.
KNOWN_VIOLATIONS: frozenset[tuple[str, str]] = frozenset()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every ``hyper_parallel`` module ``path`` imports (``from P import m`` counts as ``P.m`` if a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("hyper_parallel"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("hyper_parallel"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if _exists(candidate) else node.module)
    return found


def _exists(module: str) -> bool:
    base = ROOT.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in (ROOT / "hyper_parallel").rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def _layer_of(module: str) -> int | None:
    if module != PACKAGE and not module.startswith(PACKAGE + "."):
        return None
    short = module[len(PACKAGE) + 1:]
    for position, (_, members) in enumerate(LAYERS):
        if short in members:
            return position
    return None


def test_every_checkpoint_module_has_a_layer():
    unplaced = sorted(m for m in _graph() if m.startswith(PACKAGE) and _layer_of(m) is None)
    assert not unplaced, f"put these modules into a layer of tests/test_layering.py: {unplaced}"


def test_imports_only_point_down():
    graph = _graph()
    upward = []
    for module, targets in graph.items():
        low = _layer_of(module)
        for target in targets:
            high = _layer_of(target)
            if low is None or high is None or high <= low:
                continue
            pair = (module[len(PACKAGE) + 1:], target[len(PACKAGE) + 1:])
            if pair not in KNOWN_VIOLATIONS:
                upward.append(f"{module} ({LAYERS[low][0]}) imports {target} ({LAYERS[high][0]})")
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(upward))


def test_known_violations_still_exist():
    """Shrink KNOWN_VIOLATIONS when a violation is fixed."""
    graph = _graph()
    gone = [pair for pair in KNOWN_VIOLATIONS if f"{PACKAGE}.{pair[1]}" not in graph.get(f"{PACKAGE}.{pair[0]}", ())]
    assert not gone, f"remove from KNOWN_VIOLATIONS: {gone}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_in_the_checkpoint_package():
    graph = _graph()
    inner = {m: {t for t in ts if t.startswith(PACKAGE + ".") and (m, t) != (PACKAGE, t)}
             for m, ts in graph.items() if m.startswith(PACKAGE + ".")}
    allowed = {(f"{PACKAGE}.{a}", f"{PACKAGE}.{b}") for a, b in KNOWN_VIOLATIONS}
    inner = {m: {t for t in ts if (m, t) not in allowed} for m, ts in inner.items()}
    assert _cycles(inner) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_layout_and_dtensor_do_not_import_the_checkpoint_package():
    graph = _graph()
    for module in ("hyper_parallel.core.layout", "hyper_parallel.core.dtensor", "hyper_parallel.core._errors"):
        assert not [t for t in graph[module] if t.startswith(PACKAGE)], module
    code = ("import sys, hyper_parallel.core.layout, hyper_parallel.core.dtensor; "
            f"print(sorted(m for m in sys.modules if m.startswith({PACKAGE!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_layout_errors_are_the_checkpoint_errors():
    import hyper_parallel.core.distributed_checkpoint as dcp  # pylint: disable=import-outside-toplevel
    from hyper_parallel.core import _errors  # pylint: disable=import-outside-toplevel

    assert dcp.LayoutError is _errors.LayoutError is dcp.errors.LayoutError
    assert dcp.CheckpointError is _errors.CheckpointError
    assert issubclass(dcp.LayoutError, dcp.CheckpointValueError) and issubclass(dcp.LayoutError, ValueError)


def test_the_platform_and_the_core_never_import_upward():
    graph = _graph()
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if (module.startswith("hyper_parallel.platform")
            and target.startswith(("hyper_parallel.core", "hyper_parallel.cli")))
        or (module.startswith("hyper_parallel.core") and target.startswith("hyper_parallel.cli"))
    )
    assert not upward, upward
