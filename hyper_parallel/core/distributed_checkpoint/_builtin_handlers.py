"""The built-in type handlers: how plain values, arrays and tensors become bytes.

:class:`TypeHandler` is the interface; the registry that picks a handler for a
value or a stored type string is in :mod:`.type_handlers`. Every payload
format here is specified in ``docs/format.md``.
"""

from __future__ import annotations

import abc
import functools
import json
import math
import pickle
import re
import struct
import sys
from typing import Any

import numpy as np

from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointValueError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    UnsupportedTypeError,
)
from hyper_parallel.platform import DTYPE_NAMES, dtype_name, from_numpy, numpy_dtype, to_numpy

__all__ = [
    "MAX_INT_DIGITS",
    "PICKLE_TYPE_STRING",
    "REGISTER_HINT",
    "TypeHandler",
    "IntHandler",
    "FloatHandler",
    "BoolHandler",
    "NoneHandler",
    "StrHandler",
    "BytesHandler",
    "NumpyScalarHandler",
    "NumpyArrayHandler",
    "MindSporeTensorHandler",
    "PickleHandler",
    "qualified_name",
    "pickle_refusal",
]

#: The reserved type string of pickled payloads.
PICKLE_TYPE_STRING = "pickle"

REGISTER_HINT = "register a handler with hyper_parallel.core.distributed_checkpoint.register_type_handler(...)"
_MAX_HEADER_BYTES = 64 * 1024
_INT_TEXT = re.compile(rb"-?[0-9]+")
#: Largest ``int`` (in decimal digits) a checkpoint stores; a longer payload is refused as hostile.
MAX_INT_DIGITS = 1_000_000
# Below this many digits Python's own conversions are fast (and within its str-digits limit).
_SMALL_DIGITS = 3000


@functools.lru_cache(maxsize=64)
def _power_of_ten(exponent: int) -> int:
    return 10**exponent


def _parse_digits(text: bytes) -> int:
    """Decimal digits to ``int`` by halves: sub-quadratic (Karatsuba products) instead of quadratic."""
    if len(text) <= _SMALL_DIGITS:
        return int(text)
    low = len(text) // 2
    return _parse_digits(text[:-low]) * _power_of_ten(low) + _parse_digits(text[-low:])


def _format_digits(number: int, width: int = 0) -> str:
    """``number >= 0`` as decimal digits (left-padded with zeros to ``width``), by halves."""
    if number.bit_length() <= _SMALL_DIGITS * 3:
        return str(number).zfill(width)
    low = (number.bit_length() * 30103 // 100000 + 1) // 2
    high, rest = divmod(number, _power_of_ten(low))
    return _format_digits(high, max(width - low, 0)) + _format_digits(rest, low)


class TypeHandler(abc.ABC):
    """Turns values of some type into bytes and back.

    Subclasses set ``type_string`` (a class attribute or property): a short,
    stable name stored with every payload and used to find the handler again
    at load time. It must never change once checkpoints exist.
    """

    type_string: str

    @abc.abstractmethod
    def serialize(self, value: Any) -> bytes:
        """Encode ``value``.

        Args:
            value: The value to store.

        Returns:
            The payload.

        Raises:
            UnsupportedTypeError: The value cannot be encoded by this handler.
        """

    @abc.abstractmethod
    def deserialize(self, data: bytes) -> Any:
        """Decode a payload written by :meth:`serialize`.

        Args:
            data: The payload.

        Returns:
            The value.

        Raises:
            CorruptCheckpointError: The payload is malformed.
        """


def qualified_name(type_: type) -> str:
    return f"{type_.__module__}.{type_.__qualname__}"


# ----------------------------------------------------------------- built-ins


class IntHandler(TypeHandler):
    """``int`` of any size, as decimal ASCII text."""

    type_string = "int"

    def serialize(self, value: Any) -> bytes:
        number = int(value)
        if number.bit_length() > MAX_INT_DIGITS * 3.33:
            raise CheckpointValueError(
                f"an int of {number.bit_length()} bits has more than the {MAX_INT_DIGITS} decimal digits a "
                "checkpoint stores; store it as bytes (number.to_bytes(...)) instead"
            )
        text = ("-" if number < 0 else "") + _format_digits(abs(number))
        if len(text.lstrip("-")) > MAX_INT_DIGITS:
            raise CheckpointValueError(
                f"an int of {len(text)} decimal digits is more than the {MAX_INT_DIGITS} a checkpoint stores; "
                "store it as bytes (number.to_bytes(...)) instead"
            )
        return text.encode("ascii")

    def deserialize(self, data: bytes) -> int:
        data = bytes(data)
        if len(data) > MAX_INT_DIGITS + 1:
            raise UnsafeCheckpointError(
                f"int payload of {len(data)} bytes is longer than the {MAX_INT_DIGITS} digits a checkpoint "
                "stores; refused"
            )
        if not _INT_TEXT.fullmatch(data):
            raise CorruptCheckpointError(f"int payload is not decimal digits: {data[:40]!r}")
        if data.startswith(b"-"):
            return -_parse_digits(data[1:])
        return _parse_digits(data)


class FloatHandler(TypeHandler):
    """``float`` as 8-byte little-endian IEEE 754 (keeps nan, inf and -0.0)."""

    type_string = "float"

    def serialize(self, value: Any) -> bytes:
        return struct.pack("<d", float(value))

    def deserialize(self, data: bytes) -> float:
        if len(data) != 8:
            raise CorruptCheckpointError(f"float payload has {len(data)} bytes, expected 8")
        return struct.unpack("<d", data)[0]


class BoolHandler(TypeHandler):
    """``bool`` as one byte, 0 or 1."""

    type_string = "bool"

    def serialize(self, value: Any) -> bytes:
        return b"\x01" if value else b"\x00"

    def deserialize(self, data: bytes) -> bool:
        data = bytes(data)
        if data not in (b"\x00", b"\x01"):
            raise CorruptCheckpointError(f"bool payload must be b'\\x00' or b'\\x01', got {data[:8]!r}")
        return data == b"\x01"


class NoneHandler(TypeHandler):
    """``None`` as an empty payload."""

    type_string = "none"

    def serialize(self, value: Any) -> bytes:
        return b""

    def deserialize(self, data: bytes) -> None:
        if len(data) != 0:
            raise CorruptCheckpointError(f"none payload must be empty, got {len(data)} bytes")


class StrHandler(TypeHandler):
    """``str`` as UTF-8 (lone surrogates kept via ``surrogatepass``)."""

    type_string = "str"

    def serialize(self, value: Any) -> bytes:
        return str(value).encode("utf-8", "surrogatepass")

    def deserialize(self, data: bytes) -> str:
        try:
            return bytes(data).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            raise CorruptCheckpointError(f"str payload is not valid UTF-8: {exc}") from exc


class BytesHandler(TypeHandler):
    """``bytes`` stored as is."""

    type_string = "bytes"

    def serialize(self, value: Any) -> bytes:
        return bytes(value)

    def deserialize(self, data: bytes) -> bytes:
        return bytes(data)


def _encode_array(array: np.ndarray) -> bytes:
    """Encode an array as a JSON header line, then its raw little-endian C-order bytes."""
    try:
        name = dtype_name(array)
    except TypeError as exc:
        raise UnsupportedTypeError(f"numpy dtype {array.dtype} is not supported: {exc}") from exc
    if not array.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d into 1-d)
        array = array.copy(order="C")
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if sys.byteorder == "big":  # pragma: no cover - no big-endian CI
        array = array.byteswap()
    header = json.dumps({"dtype": name, "shape": list(array.shape)}, separators=(",", ":"))
    body = array.reshape(-1).view(np.uint8)
    return b"".join((header.encode("ascii"), b"\n", body.data))


def _decode_array(data: bytes) -> np.ndarray:
    """Decode :func:`_encode_array` output, validating every header field."""
    view = memoryview(data).cast("B")
    end = bytes(view[:_MAX_HEADER_BYTES]).find(b"\n")
    if end < 0:
        raise CorruptCheckpointError("array payload has no header line")
    try:
        header = json.loads(bytes(view[:end]).decode("ascii"))
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"array header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict) or set(header) != {"dtype", "shape"}:
        raise CorruptCheckpointError(f"array header must hold exactly 'dtype' and 'shape': {header!r}")
    name, shape = header["dtype"], header["shape"]
    if not isinstance(name, str) or name not in DTYPE_NAMES:
        raise CorruptCheckpointError(f"array header names unknown dtype {name!r}")
    if not isinstance(shape, list) or not all(type(dim) is int and dim >= 0 for dim in shape):
        raise CorruptCheckpointError(f"array shape must be a list of ints >= 0, got {shape!r}")
    count = math.prod(shape)
    expected = count * DTYPE_NAMES[name]
    actual = len(view) - end - 1
    if actual != expected:
        raise CorruptCheckpointError(
            f"array payload of dtype {name} and shape {tuple(shape)} needs {expected} bytes, got {actual}"
        )
    dtype = numpy_dtype(name)
    array = np.frombuffer(view, dtype=dtype, count=count, offset=end + 1).reshape(tuple(shape)).copy()
    if sys.byteorder == "big":  # pragma: no cover - no big-endian CI
        array = array.byteswap()
    return array


class NumpyArrayHandler(TypeHandler):
    """``numpy.ndarray`` of a storable dtype (bool, ints, floats, bfloat16).

    Payload: ``{"dtype":...,"shape":[...]}`` and a newline, then the raw
    C-order little-endian bytes. Object, string and complex arrays are refused.
    """

    type_string = "numpy.ndarray"

    def serialize(self, value: Any) -> bytes:
        return _encode_array(np.asarray(value))

    def deserialize(self, data: bytes) -> np.ndarray:
        return _decode_array(data)


class NumpyScalarHandler(TypeHandler):
    """numpy scalars (``numpy.generic``); loads back the exact numpy type."""

    type_string = "numpy.scalar"

    def serialize(self, value: Any) -> bytes:
        return _encode_array(np.asarray(value))

    def deserialize(self, data: bytes) -> np.generic:
        array = _decode_array(data)
        if array.ndim != 0:
            raise CorruptCheckpointError(f"numpy scalar payload has shape {array.shape}, expected ()")
        return array[()]


class MindSporeTensorHandler(TypeHandler):
    """MindSpore ``Tensor`` (and ``Parameter``), encoded like a numpy array.

    Loads back a ``mindspore.Tensor`` of the same dtype, bfloat16 included.
    """

    type_string = "mindspore.Tensor"

    def serialize(self, value: Any) -> bytes:
        return _encode_array(to_numpy(value))

    def deserialize(self, data: bytes) -> Any:
        return from_numpy(_decode_array(data))


class PickleHandler(TypeHandler):
    """Any picklable value, with pickle protocol 5.

    :meth:`deserialize` always refuses: unpickling can run code from the
    checkpoint, so it happens only in :func:`deserialize_value` with
    ``allow_pickle=True``.
    """

    type_string = PICKLE_TYPE_STRING

    def serialize(self, value: Any) -> bytes:
        return pickle.dumps(value, protocol=5)

    def deserialize(self, data: bytes) -> Any:
        raise UnsafeCheckpointError(pickle_refusal(None))

    @staticmethod
    def _loads_trusted(data: bytes) -> Any:
        return pickle.loads(data)  # noqa: S301 - gated by allow_pickle=True


def pickle_refusal(key: str | None) -> str:
    item = "the checkpoint item" if key is None else f"checkpoint item {key!r}"
    return (
        f"{item} holds a pickled object, and loading it could run arbitrary code from the "
        "checkpoint. Pass allow_pickle=True (only for checkpoints you trust), or "
        f"{REGISTER_HINT} for its type and save it again."
    )
