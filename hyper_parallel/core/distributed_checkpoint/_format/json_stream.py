"""Walking one JSON text a value at a time, for decoding large metadata without its whole tree.

:class:`Cursor` decodes the value at its position with the standard JSON
decoder and steps over object and array punctuation; :func:`batches` decodes
a bounded run of members of the array or object just opened with one JSON call
while the text is in the writer's compact form. :mod:`.metadata_json` builds
its streaming decoder on both.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterator

from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError

__all__ = ["Cursor", "batches"]

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")
_WHITE = frozenset(" \t\n\r")


class Cursor:
    """Walks one JSON text a value at a time (the streaming half of :func:`metadata_from_json`)."""

    def __init__(self, text: str, source: str) -> None:
        self.text = text
        self.source = source
        self.position = 0

    def skip(self) -> str:
        """Skip white space; return the next character ('' at the end)."""
        char = self.text[self.position : self.position + 1]
        if char in _WHITE:  # compact JSON (this writer's) has none: no regex then
            self.position = _SPACE.match(self.text, self.position).end()
            char = self.text[self.position : self.position + 1]
        return char

    def expect(self, char: str) -> None:
        if self.skip() != char:
            raise CorruptCheckpointError(
                f"{self.source}: not valid JSON metadata (expected {char!r} at char {self.position})"
            )
        self.position += 1

    def value(self) -> Any:
        """Decode the value at the cursor (any JSON value, however nested, within Python's limits)."""
        self.skip()
        try:
            value, self.position = _DECODER.raw_decode(self.text, self.position)
        except (ValueError, RecursionError) as exc:  # bad JSON, too deep, an integer too long
            raise CorruptCheckpointError(f"{self.source}: not valid JSON metadata ({exc})") from exc
        return value

    def members(self, close: str) -> Any:
        """Yield once per member of the object or array just opened, until ``close``; the caller decodes it."""
        if self.skip() == close:
            self.position += 1
            return
        while True:
            yield
            following = self.skip()
            self.position += 1
            if following == close:
                return
            if following != ",":
                raise CorruptCheckpointError(
                    f"{self.source}: not valid JSON metadata (expected ',' or {close!r} at char {self.position - 1})"
                )

    def key(self) -> str:
        """Decode an object member's name and its ``:``."""
        if self.skip() != '"':
            raise CorruptCheckpointError(
                f"{self.source}: not valid JSON metadata (expected a member name at char {self.position})"
            )
        name = self.value()
        self.expect(":")
        return name


#: Members decoded by one JSON call while the text is in the writer's compact form (a bounded batch:
#: the decode stays streaming, with less Python per member).
_BATCH = 256


def batches(cursor: Cursor, boundary: str, wrap: str) -> Iterator[Any]:
    """Decode the next members of the array or object just opened, ``_BATCH`` at a time, by one JSON call each.

    A batch ends at the ``_BATCH``-th ``boundary`` (``},{"fqn":`` between storage entries, ``},"``
    between items) and is decoded wrapped in ``wrap``. Decoding from a member's start succeeds only
    when the cut is between two members of this level (a cut inside a string or a nested value leaves
    it unclosed), so a decoded batch is exactly the next ``_BATCH`` members. Stops at the first batch
    that is not (another spacing, a nested match, the last members, bad JSON): the caller decodes the
    rest member by member, which also reports any error.
    """
    text = cursor.text
    while True:
        start = cut = cursor.position
        for _ in range(_BATCH):
            cut = text.find(boundary, cut + 1)
            if cut < 0:
                return
        try:
            batch = json.loads(wrap[0] + text[start : cut + 1] + wrap[1])
        except (ValueError, RecursionError):
            return
        if len(batch) != _BATCH:  # an object's duplicate keys, or a match inside a value: member by member
            return
        cursor.position = cut + 2
        yield batch
