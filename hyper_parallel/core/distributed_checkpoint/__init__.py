"""hyper_parallel distributed checkpoint: sharded save and load for MindSpore jobs.

``import hyper_parallel.core.distributed_checkpoint as dcp`` then
``dcp.save(state_dict, checkpoint_id=path)`` and
``dcp.load(state_dict, checkpoint_id=path)`` on every rank. See docs/guide.md.

Where things are: planning in :mod:`.planner` (types), :mod:`.standard_planner`
and :mod:`._global_plan` (the coordinator's merge); bytes written in
:mod:`.filesystem_writer` (data files laid out and streamed in :mod:`._data_writing`,
the commit guarded in :mod:`._commit_guard`); bytes read in :mod:`.filesystem_reader`
and :mod:`._run_reads`; the on-disk format (spec: docs/format.md) in :mod:`._format`;
layouts cut in :mod:`hyper_parallel.core.layout`; the steps in order in :mod:`.api`,
then :mod:`._engine` (save), :mod:`._async_engine` (async save) and
:mod:`._load_engine` (load).
Modules whose name starts with ``_`` are internal. ``CheckpointCallback``
(a ``mindspore.train.Callback``, so it imports MindSpore) is loaded on first
use.
"""

from typing import Any

from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointIOError,
    ConcurrentSaveError,
    CheckpointNotFoundError,
    CheckpointValueError,
    CollectiveStepError,
    CollectiveTimeoutError,
    ConcurrentSaveError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LayoutError,
    MissingKeyError,
    PlanValidationError,
    ShapeMismatchError,
    SlicedParameterError,
    StrategyFileError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
    UnsupportedTypeError,
)
from hyper_parallel.core.distributed_checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorProperties,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from hyper_parallel.core.distributed_checkpoint.storage import StorageReader, StorageWriter, WriteResult
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import FileSystemWriter
from hyper_parallel.core.distributed_checkpoint.filesystem_reader import FileSystemReader
from hyper_parallel.core.distributed_checkpoint._fsspec_writer import FsspecWriter
from hyper_parallel.core.distributed_checkpoint._fsspec_reader import FsspecReader
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardLoadPlanner, StandardSavePlanner
from hyper_parallel.core.distributed_checkpoint.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)
from hyper_parallel.core.distributed_checkpoint.type_handlers import (
    TypeHandler,
    get_type_handler,
    register_type_handler,
)
from hyper_parallel.core.distributed_checkpoint.strategies import (
    StrategyAction,
    get_default_strategy,
    register_default_strategy,
)
from hyper_parallel.core.distributed_checkpoint.api import load, read_metadata, save
from hyper_parallel.core.distributed_checkpoint._one_line import load_checkpoint, save_checkpoint
from hyper_parallel.core.distributed_checkpoint._async_queue import AsyncCallsQueue, AsyncRequest
from hyper_parallel.core.distributed_checkpoint.async_checkpoint import AsyncSaveHandle, async_save, prepare_async_save
from hyper_parallel.core.distributed_checkpoint.manager import CheckpointManager

__all__ = [
    "AsyncCallsQueue",
    "AsyncRequest",
    "AsyncSaveHandle",
    "async_save",
    "prepare_async_save",
    "BytesStorageMetadata",
    "CheckpointCallback",
    "CheckpointManager",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointIOError",
    "ConcurrentSaveError",
    "CheckpointNotFoundError",
    "CheckpointValueError",
    "ChunkStorageMetadata",
    "CollectiveStepError",
    "CollectiveTimeoutError",
    "ConcurrentSaveError",
    "CorruptCheckpointError",
    "FileSystemReader",
    "FileSystemWriter",
    "FsspecReader",
    "FsspecWriter",
    "IncompleteCheckpointError",
    "LayoutError",
    "LoadItemType",
    "LoadPlan",
    "LoadPlanner",
    "LocalNonpersistentObject",
    "Metadata",
    "MetadataIndex",
    "MissingKeyError",
    "PlanValidationError",
    "ReadItem",
    "SavePlan",
    "SavePlanner",
    "ShapeMismatchError",
    "SlicedParameterError",
    "StrategyFileError",
    "ShardedObject",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StandardLoadPlanner",
    "StandardSavePlanner",
    "StorageInfo",
    "StorageReader",
    "StorageWriter",
    "StrategyAction",
    "TensorProperties",
    "TensorStorageMetadata",
    "TypeHandler",
    "UnsafeCheckpointError",
    "UnsupportedFormatError",
    "UnsupportedTypeError",
    "WriteItem",
    "WriteItemType",
    "WriteResult",
    "apply_factories",
    "apply_factory_merges",
    "get_default_strategy",
    "get_type_handler",
    "is_main_replica",
    "load",
    "load_checkpoint",
    "read_metadata",
    "register_default_strategy",
    "register_type_handler",
    "save",
    "save_checkpoint",
]


def __getattr__(name: str) -> Any:
    if name != "CheckpointCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # pylint: disable-next=import-outside-toplevel
    from hyper_parallel.core.distributed_checkpoint.callback import CheckpointCallback

    globals()[name] = CheckpointCallback
    return CheckpointCallback
