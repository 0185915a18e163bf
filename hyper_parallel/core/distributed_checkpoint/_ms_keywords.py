"""The arguments of MindSpore's ``save_checkpoint`` / ``load_checkpoint`` / ``ModelCheckpoint`` not taken here.

A MindSpore user passes them out of habit to ``save_checkpoint``,
``load_checkpoint`` or ``CheckpointCallback``, by keyword or in MindSpore's
positional order; the refusal names the function the user called (not the
``dcp.save`` / ``dcp.load`` it calls), each argument by the MindSpore name its
position has there, and says what to do instead. Any other unknown keyword is
refused naming the keywords that are taken; a missing checkpoint id (``None``)
or a Cell where the id goes (arguments swapped) is refused naming the function.
A checkpoint id named like a MindSpore file (``net.ckpt``) is warned about: the
save writes a directory there, which ``mindspore.load_checkpoint`` cannot read.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable, Mapping

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError

__all__ = ["CALLBACK_INSTEAD", "CALLBACK_POSITIONS", "LOAD_INSTEAD", "LOAD_POSITIONS", "SAVE_INSTEAD",
           "SAVE_POSITIONS", "check_checkpoint_id", "check_keywords", "check_positional", "warn_file_name"]

_LOG = logging.getLogger(__name__)
#: The ids :func:`warn_file_name` warned about, oldest first: at most :data:`_KEPT_WARNED` (a loop saving to a new
#: such id each step would otherwise add one per save, for as long as the process runs).
_WARNED: dict[str, None] = {}
_KEPT_WARNED = 64

_ENCRYPTION_SAVE = (
    "hyper_parallel checkpoints are not encrypted: keep the checkpoint directory on encrypted storage, or write an "
    "encrypted MindSpore file with mindspore.save_checkpoint(net, FILE, enc_key=...)"
)
_ENCRYPTION_LOAD = (
    "hyper_parallel checkpoints are not encrypted, so there is nothing to decrypt: drop it (an encrypted MindSpore "
    "file is read with mindspore.load_checkpoint(FILE, dec_key=...))"
)
_CHECKSUMS = (
    "not needed: a save stores a checksum of every block it writes, and a load verifies the checksums stored "
    "(unless its storage_reader was made with verify_checksums=False; an item stored without one, which the format "
    "allows, is read unverified: `hp-ckpt verify CKPT` checks a whole checkpoint and counts such items); drop it"
)

#: MindSpore keyword -> what to do instead, for ``save_checkpoint``.
SAVE_INSTEAD: dict[str, str] = {
    "integrated_save": (
        "not needed: every rank saves its own shards and load_checkpoint reshards them to any layout; drop it "
        "(for one file of whole tensors run `hp-ckpt export-mindspore CKPT OUT`)"
    ),
    "async_save": (
        "save in the background with hyper_parallel.core.distributed_checkpoint.async_save(net.parameters_dict(), "
        "checkpoint_id=...) and call .result() on the handle it returns (under Model.train, "
        "hyper_parallel.CheckpointCallback saves in the background by default)"
    ),
    "enc_key": _ENCRYPTION_SAVE,
    "enc_mode": _ENCRYPTION_SAVE,
    "choice_func": (
        "pass the Parameters to save as a dict instead: "
        "save_checkpoint({p.name: p for p in net.get_parameters() if choice_func(p.name)}, checkpoint_id)"
    ),
    "crc_check": _CHECKSUMS,
    "format": (
        "a checkpoint is always a directory of safetensors files with its metadata; for MindSpore .ckpt or "
        ".safetensors files run `hp-ckpt export-mindspore CKPT OUT --format ckpt` on the saved checkpoint"
    ),
    "global_step_num": "store the step as a value: append_dict={'global_step_num': step}",
    "incremental": (
        "each save writes a checkpoint directory of its own; save to a new checkpoint_id each time "
        "(hyper_parallel.core.distributed_checkpoint.CheckpointManager numbers and prunes them)"
    ),
}

#: MindSpore keyword -> what to do instead, for ``load_checkpoint``.
LOAD_INSTEAD: dict[str, str] = {
    "dec_key": _ENCRYPTION_LOAD,
    "dec_mode": _ENCRYPTION_LOAD,
    "crc_check": _CHECKSUMS,
    "remove_redundancy": (
        "not needed: each rank reads the values of its own layout whether the save stored a replica once or on "
        "every rank; drop it"
    ),
    "format": (
        "load_checkpoint reads hyper_parallel checkpoint directories; convert MindSpore .ckpt or .safetensors "
        "files once with `hp-ckpt import FILE OUT_DIR` and load OUT_DIR"
    ),
}


#: The CheckpointConfig settings CheckpointCallback takes as keywords of its own.
_CONFIG_SETTINGS = ("save_checkpoint_steps", "save_checkpoint_seconds", "keep_checkpoint_max",
                    "keep_checkpoint_per_n_minutes", "async_save", "exception_save")


def _config_advice(config: Any) -> str:
    settings = ", ".join(f"{name}={getattr(config, name)!r}" for name in _CONFIG_SETTINGS
                         if getattr(config, name, None) is not None)  # (None: a setting the config left unset)
    return (f"pass its settings as keywords: CheckpointCallback(directory, {settings or '...'}) "
            "(append_info= as in CheckpointConfig)")


#: ModelCheckpoint / CheckpointConfig keyword -> what to do instead, for ``CheckpointCallback``.
CALLBACK_INSTEAD: dict[str, Any] = {
    **{key: advice for key, advice in SAVE_INSTEAD.items() if key not in ("async_save", "global_step_num")},
    "prefix": "steps are saved as directory/step_<n>; drop it (give each run a directory of its own)",
    "config": _config_advice,
    "saved_network": "the callback saves the network Model.train trains and its optimizer; drop it",
    "remove_redundancy": "a save stores each replicated Parameter once already; drop it",
}


#: The parameters of ``mindspore.save_checkpoint`` after ``save_obj, ckpt_file_name``, in order.
SAVE_POSITIONS = ("integrated_save", "async_save", "append_dict", "enc_key", "enc_mode", "choice_func", "crc_check",
                  "format")
#: The parameters of ``mindspore.load_checkpoint`` after ``ckpt_file_name, net``, in order.
LOAD_POSITIONS = ("strict_load", "filter_prefix", "dec_key", "dec_mode", "specify_prefix", "choice_func", "crc_check",
                  "remove_redundancy", "format")
#: The parameters of ``mindspore.train.ModelCheckpoint``, in order (all of them: its first is not a directory).
CALLBACK_POSITIONS = ("prefix", "directory", "config")


def _short(value: Any) -> str:
    """``value`` for a message: a path or plain value as it is, any other of a long repr (a Cell) by its type."""
    text = repr(os.fspath(value) if isinstance(value, os.PathLike) else value)
    plain = isinstance(value, (str, bytes, int, float, os.PathLike)) or value is None
    return text if (plain or len(text) <= 60) and "\n" not in text else f"<{type(value).__name__}>"


def check_positional(function: str, taken: tuple[str, ...], extra: tuple[Any, ...], names: tuple[str, ...],
                     accepted: Iterable[str], instead: dict[str, Any], *, origin: str | None = None) -> None:
    """Refuse the positional arguments ``extra`` that ``function`` does not take (it takes ``taken``), naming each
    by the parameter its position has in MindSpore's API (``names``) and saying what to do instead. Any rank; no
    communication.

    Args:
        function: The name the user called (``"save_checkpoint"``).
        taken: The parameters ``function`` takes positionally.
        extra: The positional arguments past ``taken`` (or, for ``names`` that cover every position, all of them).
        names: The MindSpore parameters these positions are, in order.
        accepted: The keywords ``function`` takes (those of ``names`` among them are to be passed by keyword).
        instead: MindSpore parameters not taken, each with what to do instead (a str, or a function of the value).
        origin: The MindSpore API (default ``mindspore.<function>``).

    Raises:
        TypeError: when ``extra`` is not empty.
    """
    if not extra:
        return
    origin = origin or f"mindspore.{function}"
    keywords = set(accepted)
    lines = []
    for name, value in zip(names, extra):
        if name in taken:
            lines.append(f"{name}={_short(value)}: pass it as the first argument")
        elif name in keywords:
            lines.append(f"{name}={_short(value)}: pass it by keyword ({name}=...)")
        else:
            advice = instead[name]
            lines.append(f"{name}={_short(value)}: {advice(value) if callable(advice) else advice}")
    if len(extra) > len(names):
        lines.append(f"{len(extra) - len(names)} more than {origin} takes")
    raise TypeError(
        f"{function}() takes only {' and '.join(taken)} positionally, the rest by keyword; in {origin}'s order "
        "the arguments given are: " + "; ".join(lines)
    )


def check_checkpoint_id(function: str, checkpoint_id: Any, storage: Any, kind: str) -> None:
    """Refuse a missing checkpoint id (``None`` and no ``kind`` storage) or a Cell given as the id, naming
    ``function``. Any rank; no communication.

    Raises:
        CheckpointValueError: as said.
    """
    if checkpoint_id is None and storage is None:
        raise CheckpointValueError(
            f"{function}() got checkpoint_id=None: pass the checkpoint directory (a path, or an s3:// URL), or a "
            f"{kind}"
        )
    if hasattr(checkpoint_id, "parameters_dict"):
        order = "save_obj, checkpoint_id" if function == "save_checkpoint" else "checkpoint_id, net"
        raise CheckpointValueError(
            f"{function}() got a {type(checkpoint_id).__name__} (a Cell) as checkpoint_id: the arguments go in the "
            f"order {function}({order}), as in mindspore.{function}"
        )


def check_keywords(function: str, given: Mapping[str, Any], accepted: Iterable[str], instead: dict[str, Any], *,
                   origin: str | None = None) -> None:
    """Refuse keywords ``function`` does not take, naming ``function``. Any rank; no communication.

    Args:
        function: The name the user called (``"save_checkpoint"``).
        given: The keywords passed, with their values.
        accepted: The keywords ``function`` takes.
        instead: MindSpore keywords not taken, each with what to do instead (a str, or a function of the
            value given returning it).
        origin: The MindSpore API the keywords come from (default ``mindspore.<function>``).

    Raises:
        TypeError: A keyword not in ``accepted``; a MindSpore one says what to do instead, any other lists
            the keywords taken.
    """
    taken = set(accepted)
    unknown = [key for key in given if key not in taken]
    if not unknown:
        return
    origin = origin or f"mindspore.{function}"
    lines = [f"{key}= (a keyword of {origin}) is not supported by hyper_parallel.{function}: "
             f"{instead[key](given[key]) if callable(instead[key]) else instead[key]}"
             for key in unknown if key in instead]
    others = [key for key in unknown if key not in instead]
    if others:
        lines.append(f"unexpected keyword argument(s) {', '.join(repr(k) for k in others)}; "
                     f"it takes {', '.join(sorted(taken))}")
    raise TypeError(f"{function}(): " + "; ".join(lines))


def warn_file_name(checkpoint_id: Any) -> None:
    """Warn (once per id, of the last :data:`_KEPT_WARNED`) that a ``save_checkpoint`` id named like a MindSpore
    file is written as a directory.

    Any rank; no communication. Ids of other kinds (a storage URL object) are let be.
    """
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        return
    name = os.fspath(checkpoint_id)
    if not str(name).endswith((".ckpt", ".safetensors")) or name in _WARNED:
        return
    _WARNED[name] = None
    if len(_WARNED) > _KEPT_WARNED:
        del _WARNED[next(iter(_WARNED))]
    _LOG.warning(
        "save_checkpoint: %s is named like a MindSpore checkpoint file, but a hyper_parallel checkpoint is a "
        "directory, written there now: mindspore.load_checkpoint cannot read it. Load it with "
        "hyper_parallel.load_checkpoint, or write MindSpore files from it with `hp-ckpt export-mindspore %s OUT` "
        "(a directory name without the suffix avoids the confusion)", name, name)
