"""Tests for hyper_parallel.core.distributed_checkpoint.type_handlers."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import pickle
import struct
import subprocess
import sys

import mindspore
import numpy as np
import pytest

from hyper_parallel.core.distributed_checkpoint import type_handlers as th
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointValueError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
    UnsupportedTypeError,
)
from hyper_parallel.core.distributed_checkpoint.type_handlers import (
    TypeHandler,
    TypeHandlerRegistry,
    deserialize_value,
    get_type_handler,
    register_type_handler,
    serialize_value,
)
from hyper_parallel.platform import numpy_dtype

mindspore.set_device("CPU")

BF16 = numpy_dtype("bfloat16")


@pytest.fixture
def fresh_registry(monkeypatch):
    """Give the test its own copy of the default registry; the original is restored after."""
    registry = th.default_registry().copy()
    monkeypatch.setattr(th, "_default", registry)
    return registry


def round_trip(value, **kwargs):
    type_string, payload = serialize_value(value, key="k", **kwargs)
    assert isinstance(payload, bytes)
    return type_string, deserialize_value(type_string, payload, key="k", **kwargs)


# ------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    ("value", "type_string"),
    [
        (0, "int"),
        (-7, "int"),
        (2**200 + 1, "int"),
        (True, "bool"),
        (False, "bool"),
        (None, "none"),
        (1.5, "float"),
        (float("inf"), "float"),
        (float("-inf"), "float"),
        (5e-324, "float"),
        ("", "str"),
        ("héllo wörld ✓ 漢字 🎉", "str"),
        ("lone \ud800 surrogate", "str"),
        (b"", "bytes"),
        (bytes(range(256)), "bytes"),
    ],
)
def test_builtin_round_trip(value, type_string):
    stored, result = round_trip(value)
    assert stored == type_string
    assert type(result) is type(value)
    assert result == value


def test_huge_int_beyond_str_digit_limit():
    value = -(10**5000) - 3  # beyond Python's default int<->str digit limit
    stored, result = round_trip(value)
    assert stored == "int" and type(result) is int and result == value


def test_bool_is_not_int():
    assert serialize_value(True, key="k") == ("bool", b"\x01")
    assert serialize_value(1, key="k") == ("int", b"1")
    assert get_type_handler(bool).type_string == "bool"
    assert get_type_handler(int).type_string == "int"


def test_float_negative_zero_and_nan_bitwise():
    _, zero = round_trip(-0.0)
    assert zero == 0.0 and math.copysign(1.0, zero) == -1.0
    nan = struct.unpack("<d", bytes.fromhex("010000000000f87f"))[0]  # nan with a payload
    type_string, payload = serialize_value(nan, key="k")
    assert payload == bytes.fromhex("010000000000f87f")
    result = deserialize_value(type_string, payload, key="k")
    assert math.isnan(result) and struct.pack("<d", result) == struct.pack("<d", nan)


@pytest.mark.parametrize(
    "value",
    [np.float16(1.5), np.float32(-0.0), np.float64(np.nan), np.int8(-3), np.uint64(2**64 - 1),
     np.int64(-(2**63)), np.bool_(True), np.uint16(7)],
)
def test_numpy_scalar_round_trip(value):
    stored, result = round_trip(value)
    assert stored == "numpy.scalar"
    assert type(result) is type(value)
    assert result.tobytes() == value.tobytes()


def test_numpy_bfloat16_scalar_round_trip():
    value = np.array([3.25], dtype=np.float32).astype(BF16)[0]
    stored, result = round_trip(value)
    assert stored == "numpy.scalar"
    assert type(result) is type(value)
    assert result.dtype == BF16
    assert np.asarray(result).view(np.uint16) == np.asarray(value).view(np.uint16)


@pytest.mark.parametrize(
    "array",
    [
        np.array(3.5, dtype=np.float32),
        np.arange(24, dtype=np.int64).reshape(2, 3, 4),
        np.zeros((0, 3), dtype=np.float16),
        np.array([[True, False]]),
        np.arange(12, dtype=np.float64).reshape(3, 4).T,  # not C-contiguous
        np.arange(6, dtype=">i4"),  # big-endian input
        np.array([-0.0, np.nan, np.inf], dtype=np.float32),
    ],
)
def test_numpy_array_round_trip(array):
    stored, result = round_trip(array)
    assert stored == "numpy.ndarray"
    assert type(result) is np.ndarray
    assert result.shape == array.shape
    assert result.dtype == array.dtype.newbyteorder("=")
    assert result.tobytes() == np.ascontiguousarray(array, dtype=result.dtype).tobytes()
    assert result.flags.writeable and result.flags.c_contiguous


def test_numpy_bfloat16_array_round_trip():
    array = np.linspace(-3, 3, 24, dtype=np.float32).astype(BF16).reshape(2, 3, 4)
    _, payload = serialize_value(array, key="k")
    assert payload.startswith(b'{"dtype":"bfloat16","shape":[2,3,4]}\n')
    result = deserialize_value("numpy.ndarray", payload, key="k")
    assert result.dtype == BF16 and result.shape == (2, 3, 4)
    np.testing.assert_array_equal(result.view(np.uint16), array.view(np.uint16))


@pytest.mark.parametrize(
    "array",
    [
        np.array(1.25, dtype=np.float32),
        np.arange(24, dtype=np.float32).reshape(2, 3, 4),
        np.array([[1, -2], [3, 4]], dtype=np.int32),
        np.array([True, False, True]),
        np.arange(5, dtype=np.uint8),
    ],
)
def test_mindspore_tensor_round_trip(array):
    tensor = mindspore.Tensor(array)
    stored, result = round_trip(tensor)
    assert stored == "mindspore.Tensor"
    assert isinstance(result, mindspore.Tensor)
    assert result.dtype == tensor.dtype and result.shape == tensor.shape
    np.testing.assert_array_equal(result.asnumpy(), array)


@pytest.mark.parametrize("shape", [(), (2, 3, 4)])
def test_mindspore_bfloat16_tensor_round_trip(shape):
    values = np.linspace(-5, 5, int(np.prod(shape)), dtype=np.float32).reshape(shape)
    tensor = mindspore.Tensor(values, mindspore.bfloat16)
    stored, result = round_trip(tensor)
    assert stored == "mindspore.Tensor"
    assert isinstance(result, mindspore.Tensor)
    assert result.dtype == mindspore.bfloat16 and result.shape == shape
    np.testing.assert_array_equal(result.asnumpy().view(np.uint16), tensor.asnumpy().view(np.uint16))


def test_mindspore_parameter_saved_as_tensor():
    param = mindspore.Parameter(mindspore.Tensor(np.ones((2, 2), np.float32)), name="w")
    stored, result = round_trip(param)
    assert stored == "mindspore.Tensor"
    np.testing.assert_array_equal(result.asnumpy(), np.ones((2, 2), np.float32))


def test_module_import_does_not_import_mindspore():
    code = (
        "import sys\n"
        "import hyper_parallel.core.distributed_checkpoint.type_handlers as th\n"
        "th.serialize_value(1, key='k'); th.serialize_value(__import__('numpy').ones(2), key='k')\n"
        "assert 'mindspore' not in sys.modules, 'mindspore imported'\n"
    )
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env)


# ------------------------------------------------------------ unknown types


class Opaque:
    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return type(other) is Opaque and other.value == self.value


def test_unknown_type_error_names_key_type_and_fixes():
    with pytest.raises(UnsupportedTypeError) as info:
        serialize_value(Opaque(1), key="model.extra")
    message = str(info.value)
    assert "'model.extra'" in message
    assert f"{__name__}.Opaque" in message
    assert "register a handler with hyper_parallel.core.distributed_checkpoint.register_type_handler(...)" in message
    assert "pass allow_pickle=True" in message
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


def test_unknown_type_pickled_when_allowed():
    stored, result = round_trip(Opaque([1, 2]), allow_pickle=True)
    assert stored == "pickle"
    assert result == Opaque([1, 2])


@pytest.mark.parametrize(
    "array", [np.array([object()], dtype=object), np.array([1 + 2j]), np.array(["a"])]
)
def test_unstorable_arrays_refused(array):
    with pytest.raises(UnsupportedTypeError) as info:
        serialize_value(array, key="arr")
    message = str(info.value)
    assert "'arr'" in message and "numpy.ndarray" in message
    assert "register_type_handler" in message and "allow_pickle=True" in message


def test_object_array_pickled_only_when_allowed():
    array = np.array([{"a": 1}, None], dtype=object)
    stored, result = round_trip(array, allow_pickle=True)
    assert stored == "pickle"
    assert result.dtype == object and list(result) == [{"a": 1}, None]


def test_unpicklable_value_with_allow_pickle():
    with pytest.raises(UnsupportedTypeError, match="'fn'"):
        serialize_value(lambda: None, key="fn", allow_pickle=True)


# ------------------------------------------------------------- pickle gate


class _CreatesFile:
    """Unpickling this touches a file: a stand-in for arbitrary code."""

    def __init__(self, path: pathlib.Path):
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (self.path,))


def test_pickle_gate_blocks_code_execution(tmp_path):
    target = tmp_path / "pwned"
    payload = pickle.dumps(_CreatesFile(target), protocol=5)

    with pytest.raises(UnsafeCheckpointError) as info:
        deserialize_value("pickle", payload, key="x")
    assert not target.exists()
    message = str(info.value)
    assert "'x'" in message
    assert "pickled object" in message
    assert "could run arbitrary code" in message
    assert "allow_pickle=True" in message and "trust" in message
    assert "register_type_handler" in message

    with pytest.raises(UnsafeCheckpointError):
        th.default_registry().handler_for_type_string("pickle").deserialize(payload)
    assert not target.exists()

    deserialize_value("pickle", payload, key="x", allow_pickle=True)
    assert target.exists()  # the gate is real: allowing pickle runs the code


def test_bad_pickle_payload_is_corrupt():
    with pytest.raises(CorruptCheckpointError, match="'x'"):
        deserialize_value("pickle", b"not a pickle", key="x", allow_pickle=True)


# ---------------------------------------------------------- corrupt payloads


def _array_payload(header: dict | str, body: bytes) -> bytes:
    text = header if isinstance(header, str) else json.dumps(header)
    return text.encode() + b"\n" + body


@pytest.mark.parametrize(
    ("type_string", "payload"),
    [
        ("numpy.ndarray", serialize_value(np.arange(6, dtype=np.float32), key="k")[1][:-1]),  # truncated
        ("numpy.ndarray", serialize_value(np.arange(6, dtype=np.float32), key="k")[1] + b"\0"),  # too long
        ("numpy.ndarray", _array_payload('{"dtype": "float32", "shape": [2]', b"\0" * 8)),  # bad JSON
        ("numpy.ndarray", b"\0" * 16),  # no header line
        ("numpy.ndarray", _array_payload({"dtype": "object", "shape": [1]}, b"\0" * 8)),
        ("numpy.ndarray", _array_payload({"dtype": "float31", "shape": [1]}, b"\0" * 4)),
        ("numpy.ndarray", _array_payload({"dtype": "float32", "shape": [-1]}, b"")),
        ("numpy.ndarray", _array_payload({"dtype": "float32", "shape": [1.0]}, b"\0" * 4)),
        ("numpy.ndarray", _array_payload({"dtype": "float32", "shape": [True]}, b"\0" * 4)),
        ("numpy.ndarray", _array_payload({"dtype": "float32", "shape": 1}, b"\0" * 4)),
        ("numpy.ndarray", _array_payload({"dtype": "float32", "shape": [1], "x": 1}, b"\0" * 4)),
        ("numpy.ndarray", _array_payload([1, 2], b"")),
        ("numpy.scalar", _array_payload({"dtype": "float32", "shape": [1]}, b"\0" * 4)),  # not 0-d
        ("mindspore.Tensor", _array_payload({"dtype": "int32", "shape": [2, 2]}, b"\0" * 15)),
        ("int", b"12a"),
        ("int", b""),
        ("int", b" 12"),
        ("float", b"\0" * 7),
        ("bool", b"\x02"),
        ("bool", b""),
        ("none", b"x"),
        ("str", b"\xff\xfe"),
    ],
)
def test_corrupt_payloads(type_string, payload):
    with pytest.raises(CorruptCheckpointError) as info:
        deserialize_value(type_string, payload, key="bad.key")
    assert "'bad.key'" in str(info.value)


def test_unknown_type_string():
    with pytest.raises(UnsupportedFormatError) as info:
        deserialize_value("no.such.type", b"", key="k1")
    message = str(info.value)
    assert "'k1'" in message and "'no.such.type'" in message
    assert "'numpy.ndarray'" in message and "'pickle'" in message


# ------------------------------------------------------------ registration


@dataclasses.dataclass(frozen=True)
class Point:
    x: int
    y: float
    label: str


class PointHandler(TypeHandler):
    type_string = "test.Point"

    def serialize(self, value: Point) -> bytes:
        return json.dumps(dataclasses.asdict(value)).encode()

    def deserialize(self, data: bytes) -> Point:
        return Point(**json.loads(data))


class OtherPointHandler(PointHandler):
    type_string = "test.Point.v2"


def test_user_handler_round_trip(fresh_registry):
    with pytest.raises(UnsupportedTypeError):
        serialize_value(Point(1, 2.5, "a"), key="p")
    handler = PointHandler()
    register_type_handler(Point, handler)
    assert get_type_handler(Point) is handler
    stored, result = round_trip(Point(1, 2.5, "ä"))
    assert stored == "test.Point"
    assert result == Point(1, 2.5, "ä")


def test_user_handler_errors_become_corrupt(fresh_registry):
    register_type_handler(Point, PointHandler())
    with pytest.raises(CorruptCheckpointError, match="'p'"):
        deserialize_value("test.Point", b"{not json", key="p")


def test_duplicate_registration(fresh_registry):
    register_type_handler(Point, PointHandler())
    with pytest.raises(CheckpointValueError, match="already has a type handler"):
        register_type_handler(Point, OtherPointHandler())
    with pytest.raises(CheckpointValueError, match="already has a type handler"):
        register_type_handler(int, PointHandler())
    replacement = OtherPointHandler()
    register_type_handler(Point, replacement, override=True)
    assert get_type_handler(Point) is replacement
    assert serialize_value(Point(0, 0.0, ""), key="p")[0] == "test.Point.v2"
    # payloads written with the old type string still load
    assert deserialize_value("test.Point", b'{"x": 1, "y": 2.0, "label": ""}', key="p") == Point(1, 2.0, "")


def test_type_string_claimed_by_two_handlers(fresh_registry):
    class Other:
        pass

    register_type_handler(Point, PointHandler())
    with pytest.raises(CheckpointValueError, match="'test.Point' is already claimed"):
        register_type_handler(Other, PointHandler())
    assert get_type_handler(Other) is None

    replacement = PointHandler()
    register_type_handler(Other, replacement, override=True)
    assert th.default_registry().handler_for_type_string("test.Point") is replacement
    # Point's old handler no longer owns its type string, so Point is unregistered
    assert get_type_handler(Point) is None


def test_same_handler_for_several_types(fresh_registry):
    class Sub(Point):
        pass

    handler = PointHandler()
    register_type_handler(Point, handler)
    register_type_handler(Sub, handler)  # same handler object: fine
    register_type_handler(Point, handler)  # re-registering the identical pair: fine
    assert get_type_handler(Sub) is handler


def test_override_builtin_type_string(fresh_registry):
    class HexInt(TypeHandler):
        type_string = "int"

        def serialize(self, value):
            return hex(value).encode()

        def deserialize(self, data):
            return int(data, 16)

    with pytest.raises(CheckpointValueError):
        register_type_handler(int, HexInt())
    register_type_handler(int, HexInt(), override=True)
    assert serialize_value(255, key="k") == ("int", b"0xff")
    assert serialize_value(True, key="k") == ("bool", b"\x01")


def test_pickle_type_string_reserved(fresh_registry):
    class Sneaky(TypeHandler):
        type_string = "pickle"

        def serialize(self, value):
            return b""

        def deserialize(self, data):
            return None

    with pytest.raises(CheckpointValueError, match="reserved"):
        register_type_handler(Point, Sneaky(), override=True)


def test_bad_registration_arguments(fresh_registry):
    with pytest.raises(CheckpointValueError):
        register_type_handler("Point", PointHandler())
    with pytest.raises(CheckpointValueError):
        register_type_handler(Point, object())


def test_subclass_uses_most_specific_handler(fresh_registry):
    class Base:
        pass

    class Child(Base):
        pass

    class Grandchild(Child):
        pass

    class BaseHandler(PointHandler):
        type_string = "test.Base"

    class ChildHandler(PointHandler):
        type_string = "test.Child"

    register_type_handler(Base, BaseHandler())
    register_type_handler(Child, ChildHandler())
    assert get_type_handler(Grandchild).type_string == "test.Child"
    assert th.default_registry().handler_for_value(Base()).type_string == "test.Base"


def test_fixture_restored_default_registry():
    assert get_type_handler(Point) is None
    assert get_type_handler(int).type_string == "int"
    assert serialize_value(255, key="k") == ("int", b"255")


def test_explicit_registry_argument():
    registry = TypeHandlerRegistry()
    registry.register(Point, PointHandler())
    type_string, payload = serialize_value(Point(1, 1.0, "x"), key="p", registry=registry)
    assert deserialize_value(type_string, payload, key="p", registry=registry) == Point(1, 1.0, "x")
    with pytest.raises(UnsupportedTypeError):
        serialize_value(1, key="k", registry=registry)
    assert get_type_handler(Point) is None
