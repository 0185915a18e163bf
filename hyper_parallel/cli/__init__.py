"""``hp-ckpt``: command-line tools for hyper_parallel checkpoints, also usable as functions.

- :func:`inspect_checkpoint` (``hp-ckpt inspect DIR [--json]``): keys, dtypes,
  shapes, chunks, files and who wrote them, from the metadata alone.
- :func:`list_steps` (``hp-ckpt list ROOT [--json]``): a manager root's steps,
  committed or in progress, their size, kept-forever flags and metrics.
- :func:`verify_checkpoint` (``hp-ckpt verify DIR``): re-reads every chunk,
  checks checksums, safetensors headers and coverage.
- :func:`convert_to_safetensors` (``hp-ckpt convert DIR OUT --to safetensors``):
  full tensors in Hugging Face safetensors shards plus an index json; the
  model only unless ``--all``, with ``--include`` / ``--exclude`` /
  ``--strip-prefix`` / ``--rename`` (a :class:`KeySelection`).
- :func:`import_checkpoint` (``hp-ckpt import SRC OUT [--strategy FILE ...]``):
  from a MindSpore ``.ckpt``/``.safetensors`` file, a MindSpore parallel job's
  per-rank files (with its strategy files) or a Hugging Face directory.
- :func:`export_mindspore` (``hp-ckpt export-mindspore CKPT OUT [--strategy
  FILE ...]``): MindSpore files per rank of a strategy, or one unified file.
- :func:`diff_checkpoints` (``hp-ckpt diff A B``): differing keys, shapes,
  dtypes and values.

Importing this package does not import MindSpore.
"""

from hyper_parallel.cli.convert_cmd import ConvertResult, convert_to_safetensors
from hyper_parallel.cli.diff_cmd import DiffReport, KeyDifference, diff_checkpoints
from hyper_parallel.cli.export_ms_cmd import ExportResult, export_mindspore
from hyper_parallel.cli.import_cmd import import_checkpoint
from hyper_parallel.cli.inspect_cmd import inspect_checkpoint
from hyper_parallel.cli.list_cmd import StepEntry, list_steps
from hyper_parallel.cli._key_select import KeySelection
from hyper_parallel.cli.main import main
from hyper_parallel.cli.verify_cmd import VerifyProblem, VerifyReport, verify_checkpoint

__all__ = [
    "ConvertResult",
    "DiffReport",
    "ExportResult",
    "KeyDifference",
    "KeySelection",
    "StepEntry",
    "VerifyProblem",
    "VerifyReport",
    "convert_to_safetensors",
    "diff_checkpoints",
    "export_mindspore",
    "import_checkpoint",
    "inspect_checkpoint",
    "list_steps",
    "main",
    "verify_checkpoint",
]
