"""Type handlers: how a non-tensor-shard value becomes bytes and comes back.

A :class:`TypeHandler` turns one value into a payload (``bytes``) and names its
encoding with a short, stable *type string* that is stored next to the payload.
Loading looks the handler up by that string, so a checkpoint never says *how*
to rebuild a value, only *which* known encoding it used.

Built in: ``int``, ``float``, ``bool``, ``None``, ``str``, ``bytes``, numpy
scalars and arrays, and MindSpore tensors. Other types need a handler
(:func:`register_type_handler`) or ``allow_pickle=True``; a pickled payload is
only ever unpickled by :func:`deserialize_value` with ``allow_pickle=True``,
because unpickling can run arbitrary code.

Lookup by value walks ``type(value).__mro__`` and picks the most specific
registered type, so ``True`` uses the ``bool`` handler although ``bool`` is a
subclass of ``int``. A subclass without its own handler is stored (and loaded)
as its registered base type.

The built-in handlers live in :mod:`._builtin_handlers`; this module holds the
registry, the container handler and the two entry points.

MindSpore is never imported here at module import time: its tensor handler is
registered lazily and resolved once ``mindspore`` appears in ``sys.modules``.
"""

from __future__ import annotations

import base64
import binascii
import json
import sys
import threading
from typing import Any

import numpy as np

from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointError,
    CheckpointValueError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
    UnsupportedTypeError,
)
from hyper_parallel.core.distributed_checkpoint._builtin_handlers import (
    PICKLE_TYPE_STRING,
    REGISTER_HINT,
    BoolHandler,
    BytesHandler,
    FloatHandler,
    IntHandler,
    MindSporeTensorHandler,
    NoneHandler,
    NumpyArrayHandler,
    NumpyScalarHandler,
    PickleHandler,
    StrHandler,
    TypeHandler,
    pickle_refusal,
    qualified_name,
)

__all__ = [
    "PICKLE_TYPE_STRING",
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
    "ContainerHandler",
    "TypeHandlerRegistry",
    "default_registry",
    "register_type_handler",
    "get_type_handler",
    "serialize_value",
    "deserialize_value",
    "value_refusal",
]

_PICKLE_HANDLER = PickleHandler()


# ------------------------------------------------------------------ registry


class TypeHandlerRegistry:
    """Maps Python types to handlers, and type strings back to handlers.

    A type has one handler; a type string belongs to one handler (one handler
    may serve several types). ``override=True`` replaces both; types that
    still pointed at a displaced handler are dropped, so they fail loudly at
    save instead of writing payloads their type string no longer decodes.
    The type string ``"pickle"`` is reserved.
    """

    def __init__(self) -> None:
        self._by_type: dict[type, TypeHandler] = {}
        self._by_string: dict[str, TypeHandler] = {}
        self._lazy: list[tuple[str, str, TypeHandler]] = []
        self._lock = threading.RLock()

    def copy(self) -> TypeHandlerRegistry:
        """Return an independent registry with the same registrations."""
        with self._lock:
            other = TypeHandlerRegistry()
            other._by_type = dict(self._by_type)
            other._by_string = dict(self._by_string)
            other._lazy = list(self._lazy)
            return other

    def register(self, type_: type, handler: TypeHandler, override: bool = False) -> None:
        """Register ``handler`` for values of ``type_`` (and its subclasses).

        Args:
            type_: The type.
            handler: The handler; its ``type_string`` is stored with each payload.
            override: Replace an existing handler of ``type_`` or of the type string.

        Raises:
            CheckpointValueError: Bad arguments, ``type_`` already has a handler, or
                another handler already claims the type string (without ``override``).
        """
        if not isinstance(type_, type):
            raise CheckpointValueError(f"register expects a type, got {type_!r}")
        with self._lock:
            self._resolve_lazy()
            existing = self._by_type.get(type_)
            if existing is not None and existing is not handler and not override:
                raise CheckpointValueError(
                    f"type {qualified_name(type_)} already has a type handler "
                    f"({type(existing).__name__}, type string {existing.type_string!r}); "
                    "pass override=True to replace it"
                )
            self._claim_string(handler, override)
            self._by_type[type_] = handler

    def register_lazy(self, module: str, type_name: str, handler: TypeHandler, override: bool = False) -> None:
        """Register ``handler`` for ``module.type_name`` once ``module`` is imported.

        The type string is claimed at once, so payloads load without the module
        having been imported first (the handler imports what it needs). The type
        is resolved when ``module`` appears in ``sys.modules``; a handler already
        registered for it by then wins.

        Args:
            module: The module name, e.g. ``"mindspore"``.
            type_name: The attribute path of the type in the module, e.g. ``"Tensor"``.
            handler: The handler.
            override: As in :meth:`register`, for the type string.
        """
        with self._lock:
            self._claim_string(handler, override)
            self._lazy.append((module, type_name, handler))
            self._resolve_lazy()

    def handler_for_type(self, type_: type) -> TypeHandler | None:
        """Return the handler used for values of ``type_`` (most specific in its MRO)."""
        with self._lock:
            self._resolve_lazy()
            for base in type_.__mro__:
                handler = self._by_type.get(base)
                if handler is not None:
                    return handler
            return None

    def handler_for_value(self, value: Any) -> TypeHandler | None:
        """Return the handler for ``value``, or ``None`` if no type in its MRO has one."""
        return self.handler_for_type(type(value))

    def handler_for_type_string(self, type_string: str) -> TypeHandler:
        """Return the handler that wrote payloads tagged ``type_string``.

        Raises:
            UnsupportedFormatError: No handler knows ``type_string``.
        """
        if type_string == PICKLE_TYPE_STRING:
            return _PICKLE_HANDLER
        with self._lock:
            handler = self._by_string.get(type_string)
            if handler is None:
                known = ", ".join(repr(s) for s in sorted([*self._by_string, PICKLE_TYPE_STRING]))
                raise UnsupportedFormatError(
                    f"unknown stored type {type_string!r}: no registered type handler has this "
                    f"type string (known: {known}); {REGISTER_HINT} to load it"
                )
            return handler

    def _claim_string(self, handler: TypeHandler, override: bool) -> None:
        if not isinstance(handler, TypeHandler):
            raise CheckpointValueError(f"a type handler must subclass TypeHandler, got {type(handler).__name__}")
        type_string = getattr(handler, "type_string", None)
        if not isinstance(type_string, str) or not type_string:
            raise CheckpointValueError(f"{type(handler).__name__}.type_string must be a non-empty str")
        if type_string == PICKLE_TYPE_STRING:
            raise CheckpointValueError(f"the type string {PICKLE_TYPE_STRING!r} is reserved")
        previous = self._by_string.get(type_string)
        if previous is None or previous is handler:
            self._by_string[type_string] = handler
            return
        if not override:
            raise CheckpointValueError(
                f"type string {type_string!r} is already claimed by another handler "
                f"({type(previous).__name__}); pass override=True to replace it"
            )
        self._by_string[type_string] = handler
        self._by_type = {t: h for t, h in self._by_type.items() if h is not previous}
        self._lazy = [entry for entry in self._lazy if entry[2] is not previous]

    def _resolve_lazy(self) -> None:
        if not self._lazy:
            return
        pending = []
        for module_name, type_name, handler in self._lazy:
            module = sys.modules.get(module_name)
            if module is None:
                pending.append((module_name, type_name, handler))
                continue
            type_: Any = module
            for part in type_name.split("."):
                type_ = getattr(type_, part)
            self._by_type.setdefault(type_, handler)
        self._lazy = pending


class ContainerHandler(TypeHandler):
    """``dict`` (str keys), ``list`` and ``tuple`` of values that have handlers, nested.

    For containers that are one value, such as the data of a ``ShardedObject``
    (nested containers directly in a state dict are flattened instead). The
    payload is JSON: ``{"d": [[key, node], ...]}``, ``{"l": [...]}``,
    ``{"t": [...]}`` or, for a leaf, ``{"v": [type_string, base64 payload]}``.
    Leaves never use pickle.
    """

    type_string = "container"

    def _encode(self, value: Any, depth: int) -> Any:
        if depth > 64:
            raise UnsupportedTypeError("container nested more than 64 levels")
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise UnsupportedTypeError("dict keys must all be str")
            return {"d": [[k, self._encode(v, depth + 1)] for k, v in value.items()]}
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return {"l" if isinstance(value, list) else "t": [self._encode(v, depth + 1) for v in value]}
        handler = _default.handler_for_value(value)
        if handler is None or isinstance(handler, ContainerHandler):
            raise UnsupportedTypeError(f"no type handler for {qualified_name(type(value))} inside the container")
        return {"v": [handler.type_string, base64.b64encode(handler.serialize(value)).decode("ascii")]}

    def _decode(self, node: Any) -> Any:
        if not isinstance(node, dict) or len(node) != 1:
            raise CorruptCheckpointError("malformed container payload")
        (tag, body), = node.items()
        if tag == "d" and isinstance(body, list):
            return {str(k): self._decode(v) for k, v in body}
        if tag in ("l", "t") and isinstance(body, list):
            items = [self._decode(v) for v in body]
            return items if tag == "l" else tuple(items)
        if tag == "v" and isinstance(body, list) and len(body) == 2 and body[0] != PICKLE_TYPE_STRING:
            handler = _default.handler_for_type_string(str(body[0]))
            return handler.deserialize(base64.b64decode(body[1]))
        raise CorruptCheckpointError(f"malformed container payload (tag {tag!r})")

    def serialize(self, value: Any) -> bytes:
        """Encode a nested container of handled values as JSON."""
        return json.dumps(self._encode(value, 0), separators=(",", ":")).encode("utf-8")

    def deserialize(self, data: bytes) -> Any:
        """Decode a container written by :meth:`serialize`."""
        try:
            node = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise CorruptCheckpointError(f"container payload is not JSON ({exc})") from exc
        try:
            return self._decode(node)
        except (TypeError, ValueError, binascii.Error) as exc:
            raise CorruptCheckpointError(f"malformed container payload ({exc})") from exc


def _build_default_registry() -> TypeHandlerRegistry:
    registry = TypeHandlerRegistry()
    registry.register(int, IntHandler())
    registry.register(float, FloatHandler())
    registry.register(bool, BoolHandler())
    registry.register(type(None), NoneHandler())
    registry.register(str, StrHandler())
    registry.register(bytes, BytesHandler())
    registry.register(np.generic, NumpyScalarHandler())
    registry.register(np.ndarray, NumpyArrayHandler())
    registry.register_lazy("mindspore", "Tensor", MindSporeTensorHandler())
    container = ContainerHandler()
    registry.register(dict, container)
    registry.register(list, container)
    registry.register(tuple, container)
    return registry


_default = _build_default_registry()


def default_registry() -> TypeHandlerRegistry:
    """Return the process-wide registry used when no ``registry`` is passed."""
    return _default


def register_type_handler(type: type, handler: TypeHandler, override: bool = False) -> None:  # noqa: A002
    """Register ``handler`` for ``type`` in the default registry.

    The first parameter is named ``type`` as the public contract spells it.

    Args:
        type: The type (its subclasses use the handler too, unless they have their own).
        handler: The handler.
        override: Replace an existing registration instead of raising.

    Raises:
        CheckpointValueError: ``type`` or the handler's type string is already
            registered and ``override`` is false.
    """
    _default.register(type, handler, override=override)


def get_type_handler(type_: type) -> TypeHandler | None:
    """Return the default registry's handler for values of ``type_``, or ``None``."""
    return _default.handler_for_type(type_)


def _with_key(exc: CheckpointError, key: str) -> CheckpointError:
    try:
        return type(exc)(f"checkpoint item {key!r}: {exc}")
    except TypeError:  # an error class with a different constructor
        return exc


def _unsupported(key: str, value: Any, reason: str) -> str:
    return (
        f"cannot save checkpoint item {key!r} of type {qualified_name(type(value))}: {reason}. "
        f"Either {REGISTER_HINT}, or pass allow_pickle=True (the value is then pickled, and "
        "loading it will need allow_pickle=True too)."
    )


def serialize_value(
    value: Any, *, key: str, allow_pickle: bool = False, registry: TypeHandlerRegistry | None = None
) -> tuple[str, bytes]:
    """Encode ``value`` with its registered handler.

    Args:
        value: The value.
        key: The checkpoint key of the value (used in error messages).
        allow_pickle: Pickle values no handler can encode, instead of raising.
        registry: The registry to use (default: the process-wide one).

    Returns:
        ``(type_string, payload)``.

    Raises:
        UnsupportedTypeError: No handler for the type (or the handler refuses the
            value) and ``allow_pickle`` is false, or pickling failed.
    """
    registry = _default if registry is None else registry
    handler = registry.handler_for_value(value)
    if handler is not None:
        try:
            payload = handler.serialize(value)
        except UnsupportedTypeError as exc:
            if not allow_pickle:
                raise UnsupportedTypeError(_unsupported(key, value, f"{exc}")) from exc
        except CheckpointError as exc:
            raise _with_key(exc, key) from exc
        else:
            if not isinstance(payload, (bytes, bytearray, memoryview)):
                raise CheckpointValueError(
                    f"checkpoint item {key!r}: {type(handler).__name__}.serialize returned "
                    f"{type(payload).__name__}, expected bytes"
                )
            return handler.type_string, bytes(payload)
    elif not allow_pickle:
        raise UnsupportedTypeError(_unsupported(key, value, "no type handler for this type"))
    try:
        return PICKLE_TYPE_STRING, _PICKLE_HANDLER.serialize(value)
    except Exception as exc:
        raise UnsupportedTypeError(
            f"cannot save checkpoint item {key!r}: pickling type {qualified_name(type(value))} "
            f"failed ({type(exc).__name__}: {exc}); {REGISTER_HINT} instead"
        ) from exc


def value_refusal(
    type_string: str, *, key: str, allow_pickle: bool, registry: TypeHandlerRegistry | None = None
) -> CheckpointError | None:
    """The error :func:`deserialize_value` would raise for a payload tagged ``type_string`` before decoding it.

    A load asks this for every value it will read while planning, so a value it may not or cannot decode
    is refused before any target changes. Nested leaves of a ``container`` payload are checked when decoded.

    Returns:
        ``UnsafeCheckpointError`` for a pickled payload without ``allow_pickle``, ``UnsupportedFormatError``
        for a type string no registered handler knows (both naming ``key``), else ``None``.
    """
    if type_string == PICKLE_TYPE_STRING:
        return None if allow_pickle else UnsafeCheckpointError(pickle_refusal(key))
    try:
        (_default if registry is None else registry).handler_for_type_string(type_string)
    except CheckpointError as exc:
        return _with_key(exc, key)
    return None


def deserialize_value(
    type_string: str,
    data: bytes,
    *,
    key: str,
    allow_pickle: bool = False,
    registry: TypeHandlerRegistry | None = None,
) -> Any:
    """Decode a payload with the handler named by its stored type string.

    Args:
        type_string: The type string stored with the payload.
        data: The payload.
        key: The checkpoint key of the value (used in error messages).
        allow_pickle: Unpickle ``"pickle"`` payloads. This runs code from the
            checkpoint: pass it only for checkpoints you trust.
        registry: The registry to use (default: the process-wide one).

    Returns:
        The value.

    Raises:
        UnsafeCheckpointError: A pickled payload and ``allow_pickle`` is false.
        UnsupportedFormatError: No handler knows ``type_string``.
        CorruptCheckpointError: The payload cannot be decoded.
    """
    registry = _default if registry is None else registry
    if type_string == PICKLE_TYPE_STRING:
        if not allow_pickle:
            raise UnsafeCheckpointError(pickle_refusal(key))
        try:
            return PickleHandler._loads_trusted(data)  # pylint: disable=protected-access
        except Exception as exc:
            raise CorruptCheckpointError(
                f"checkpoint item {key!r}: cannot unpickle payload ({type(exc).__name__}: {exc})"
            ) from exc
    try:
        handler = registry.handler_for_type_string(type_string)
        return handler.deserialize(data)
    except CheckpointError as exc:
        raise _with_key(exc, key) from exc
    except Exception as exc:  # a user handler failing on bad bytes
        raise CorruptCheckpointError(
            f"checkpoint item {key!r}: cannot decode {type_string!r} payload ({type(exc).__name__}: {exc})"
        ) from exc
