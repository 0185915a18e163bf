"""Tensor <-> numpy conversion (dtype names: :mod:`hyper_parallel.platform.dtypes`).

The checkpoint works on numpy views of tensors: on CPU ``Tensor.asnumpy()``
shares memory with the tensor, so saving reads the tensor's own bytes and
loading can write straight into a Parameter. Where the framework hands back a
copy (a tensor in device memory, e.g. on Ascend), :func:`host_memory_shared`
is false, :func:`to_numpy` copies the tensor out, :func:`writable_view`
returns ``None`` and the caller writes regions with :func:`assign_region`
(or the whole tensor with :func:`assign`) instead.

Setting the environment variable ``HYPER_PARALLEL_DEVICE_COPIES=1`` makes
every MindSpore tensor take that device path on CPU too (read at each call),
so tests exercise it without an NPU.

MindSpore is imported lazily: a job that saves only numpy arrays never pays for
importing it.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from itertools import repeat
from operator import attrgetter, is_, itemgetter, methodcaller
from typing import Any, Callable, NamedTuple

import numpy as np

from hyper_parallel.platform.dtypes import ms_dtype, to_numpy_dtype

__all__ = [
    "all_plain_leaves",
    "is_tensor",
    "is_parameter",
    "is_cell",
    "parameter_and_cell_types",
    "all_parameters",
    "to_numpy",
    "writable_view",
    "writable_views",
    "view_of_other_memory",
    "shared_view",
    "shared_view_reader",
    "cached_views_at",
    "host_memory_shared",
    "assign_region",
    "DEVICE_COPIES_ENV",
    "from_numpy",
    "assign",
]

#: Environment variable forcing the device (copy out / copy in) path for every tensor.
DEVICE_COPIES_ENV = "HYPER_PARALLEL_DEVICE_COPIES"

_REGION_LOCK = threading.Lock()


def _mindspore() -> Any | None:
    return sys.modules.get("mindspore")


def host_memory_shared(value: Any) -> bool:
    """Tell whether numpy can alias ``value``'s memory (a numpy array, or a tensor in host memory).

    False for a MindSpore tensor whose ``device`` is not the CPU, and for every
    tensor while ``HYPER_PARALLEL_DEVICE_COPIES=1`` is set. Cheap: no copy.
    """
    if isinstance(value, np.ndarray):
        return True
    if os.environ.get(DEVICE_COPIES_ENV) == "1":
        return False
    return _on_host(value)


_HOST_DEVICES: dict[str, bool] = {}  # a tensor's ``device`` string -> whether it names the CPU


def _on_host(value: Any) -> bool:
    """Whether a tensor's ``device`` is the CPU (or says nothing)."""
    device = getattr(value, "device", None)
    if not isinstance(device, str) or not device:
        return True
    host = _HOST_DEVICES.get(device)
    if host is None:
        host = _HOST_DEVICES[device] = device.upper().startswith("CPU")
    return host


def is_tensor(value: Any) -> bool:
    """Tell whether ``value`` is a MindSpore Tensor (a Parameter is one too)."""
    ms = _mindspore()
    return ms is not None and isinstance(value, ms.Tensor)


def is_parameter(value: Any) -> bool:
    """Tell whether ``value`` is a MindSpore Parameter."""
    ms = _mindspore()
    return ms is not None and isinstance(value, ms.Parameter)


def is_cell(value: Any) -> bool:
    """Tell whether ``value`` is a MindSpore ``nn.Cell`` (a network or optimizer)."""
    ms = _mindspore()
    return ms is not None and isinstance(value, ms.nn.Cell)


def parameter_and_cell_types() -> tuple[type | tuple[()], type | tuple[()]]:
    """MindSpore's ``Parameter`` and ``nn.Cell`` classes, for ``isinstance`` in a walk over thousands of values
    (``()`` for each while MindSpore is not imported: nothing is an instance of it)."""
    ms = _mindspore()
    return (ms.Parameter, ms.nn.Cell) if ms is not None else ((), ())


def all_parameters(values: list[Any]) -> bool:
    """Whether ``values`` (not empty) are all MindSpore Parameters: each distinct type looked at once (a state of
    thousands of Parameters, as most are, is told in C loops). Pure."""
    if not values:
        return False
    parameter_type = parameter_and_cell_types()[0]
    kinds = set(map(type, values))
    return parameter_type != () and all(issubclass(kind, parameter_type) for kind in kinds)  # type: ignore[arg-type]


def all_plain_leaves(values: list[Any]) -> bool:
    """Whether ``values`` (not empty) are all MindSpore Parameters or plain numpy arrays (no subclass): each distinct
    type looked at once (a state of thousands of Parameters or arrays is told in C loops). Pure."""
    if not values:
        return False
    parameter_type = parameter_and_cell_types()[0]
    return all(kind is np.ndarray or parameter_type != () and issubclass(kind, parameter_type)  # type: ignore[arg-type]
               for kind in set(map(type, values)))


def to_numpy(value: Any) -> np.ndarray:
    """Return a numpy array holding ``value``'s elements, without copying if possible.

    On CPU the result shares memory with a MindSpore tensor: copy it before
    handing it to a background writer. bfloat16 comes back with MindSpore's
    numpy ``bfloat16`` dtype.
    """
    if isinstance(value, np.ndarray):
        return value
    if is_tensor(value):
        if not host_memory_shared(value):
            # A device tensor: asnumpy() copies it out. Forced on CPU, copy too (asnumpy would alias).
            out = value.asnumpy()
            return np.array(out, copy=True) if os.environ.get(DEVICE_COPIES_ENV) == "1" else out
        view = _host_view(value)
        return view if view is not None else value.asnumpy()
    if isinstance(value, np.generic):
        return np.asarray(value)
    raise TypeError(f"expected a MindSpore Tensor or numpy array, got {type(value).__name__}")


#: id(tensor) -> (weak reference to it, its numpy view, its data_ptr and its dtype when the view was made). A view
#: is reused only while the tensor is contiguous (see _contiguous).
_VIEWS: dict[int, tuple[Any, np.ndarray, int, Any]] = {}


def _contiguous(value: Any) -> bool:
    """Whether tensor ``value`` is laid out row-major in its memory, as its cached view reads it.

    ``Parameter.assign_value(p.T)`` of a square Parameter keeps its memory, shape and dtype and makes it a
    non-contiguous view (MindSpore 2.10): its cached view would read the old layout. A MindSpore without
    ``is_contiguous`` has no such views.
    """
    try:
        return bool(value.is_contiguous())
    except AttributeError:
        return True
    except (RuntimeError, TypeError, ValueError):
        return False


def shared_view(value: Any) -> np.ndarray | None:
    """A numpy array aliasing a MindSpore tensor's memory, cached per tensor; ``None`` if not shared.

    ``asnumpy()`` costs tens of microseconds for bfloat16 (numpy parses the
    buffer format); repeated saves and loads of the same tensors reuse the
    view while the tensor lives and its memory (``data_ptr``), shape and
    dtype are unchanged (``assign_value`` of a bitcast keeps memory and shape) and it is contiguous (that of a
    transpose keeps memory, and a square shape). The cache holds the tensor only weakly and drops the view when
    the tensor dies.
    """
    return _host_view(value) if host_memory_shared(value) else None


def shared_view_reader() -> Callable[[Any], np.ndarray | None]:
    """:func:`shared_view` for a pass over many tensors: the environment is read once, by this call.

    The returned function gives a numpy array its own self, a MindSpore
    tensor in host memory its cached view, anything else ``None`` (a layout
    pass over thousands of Parameters spares a lookup of the environment and
    two calls per tensor).
    """
    if os.environ.get(DEVICE_COPIES_ENV) == "1":
        return _array_only
    return _host_or_none


def _array_only(value: Any) -> np.ndarray | None:
    return value if isinstance(value, np.ndarray) else None


def _host_or_none(value: Any) -> np.ndarray | None:
    """:func:`shared_view` with the environment known not to force copies."""
    if isinstance(value, np.ndarray):
        return value
    device = getattr(value, "device", None)
    if isinstance(device, str) and device:
        host = _HOST_DEVICES.get(device)
        if host is None:
            host = _on_host(value)
        if not host:
            return None
    return _host_view(value)


def _host_view(value: Any, shape: tuple[int, ...] | None = None) -> np.ndarray | None:
    """:func:`shared_view` of a tensor known to be in host memory (``shape``: its shape, if just read)."""
    try:
        pointer = int(value.data_ptr())
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None
    key = id(value)
    hit = _VIEWS.get(key)
    if hit is not None and hit[0]() is value and hit[2] == pointer and hit[1].shape == (
            shape if shape is not None else tuple(value.shape)) and hit[3] is value.dtype and _contiguous(value):
        return hit[1]
    view = value.asnumpy()
    # A tensor that is not contiguous gets a row-major copy from asnumpy(), elsewhere: refused by the pointer test.
    if view.size == 0 or view.__array_interface__["data"][0] != pointer or not view.flags.writeable:
        return view if view.size == 0 else None
    try:
        ref = weakref.ref(value, lambda _, key=key: _VIEWS.pop(key, None))
    except TypeError:
        return view
    _VIEWS[key] = (ref, view, pointer, value.dtype)
    return view


def writable_view(value: Any) -> np.ndarray | None:
    """Return a numpy array that aliases ``value``'s memory, or ``None``.

    Writing into the returned array changes the tensor in place. ``None`` means
    the framework returns copies for this tensor (device memory); the caller
    must then build the new value and :func:`assign` it.
    """
    if isinstance(value, np.ndarray):
        return value if value.flags.writeable else None
    if not is_tensor(value) or not host_memory_shared(value):
        return None
    view = _host_view(value)  # shared_view() of a tensor known to be in host memory
    if view is not None:
        return view
    first = value.asnumpy()
    if first.size == 0:
        return first
    second = value.asnumpy()  # no data_ptr: a second view has the same memory if it is shared
    same = first.__array_interface__["data"][0] == second.__array_interface__["data"][0]
    return first if same and first.flags.writeable else None


def writable_views(values: list[Any], shapes: list[tuple[int, ...]] | None = None) -> list[np.ndarray | None]:
    """:func:`writable_view` of each value, the environment read once (a load's targets, in one pass).

    Args:
        values: The tensors and arrays.
        shapes: Each value's shape as the caller just read it (spares reading it again), or ``None``.
    """
    forced = os.environ.get(DEVICE_COPIES_ENV) == "1"
    ms = _mindspore()
    tensor_type = ms.Tensor if ms is not None else ()
    if not forced and shapes is not None and values and ms is not None:
        known = _cached_views(values, shapes, tensor_type)
        if known is not None:
            return known  # type: ignore[return-value]
    views: list[np.ndarray | None] = []
    cached, host_devices = _VIEWS.get, _HOST_DEVICES.get
    for position, value in enumerate(values):
        if isinstance(value, np.ndarray):
            views.append(value if value.flags.writeable else None)
            continue
        if forced or not isinstance(value, tensor_type):
            views.append(None)
            continue
        device = getattr(value, "device", None)  # _on_host(value), inlined
        if isinstance(device, str) and device and not host_devices(device, False) and not _on_host(value):
            views.append(None)
            continue
        shape = shapes[position] if shapes is not None else None
        # A view made by an earlier load (_host_view's cache hit, inlined): the same tensor, memory, shape, dtype,
        # still contiguous.
        hit = cached(id(value))
        if hit is not None and hit[0]() is value and shape is not None and hit[1].shape == shape and (
                hit[3] is value.dtype) and _contiguous(value):
            try:
                pointer = int(value.data_ptr())
            except (AttributeError, RuntimeError, TypeError, ValueError):
                pointer = None
            if pointer == hit[2]:
                views.append(hit[1])
                continue
        view = _host_view(value, shape)
        views.append(view if view is not None else writable_view(value))
    return views


def cached_views_at(values: list[Any], pointers: list[int], dtypes: list[Any], *,
                    is_contiguous: Callable[[Any], bool] | None = None) -> list[np.ndarray] | None:
    """The cached numpy view of each tensor of ``values``, if an earlier save or load made every one for the memory
    and dtype the tensor has now; else ``None``.

    ``pointers`` and ``dtypes`` are the tensors' ``data_ptr()`` and ``dtype``
    as the caller just read them: a view counts only if it was made for this
    very tensor object at that address with that dtype (a tensor in device
    memory, or one whose memory moved since, has none). The caller checks the
    views' shapes against what it expects. ``None`` too when
    ``HYPER_PARALLEL_DEVICE_COPIES=1``. The checks run column by column (no
    Python per tensor). ``is_contiguous``: reads a tensor's contiguity (default: its ``is_contiguous()``).
    """
    if not values or os.environ.get(DEVICE_COPIES_ENV) == "1":
        return None
    hits = list(map(_VIEWS.get, map(id, values)))
    if any(map(is_, hits, repeat(None))) or list(map(_HIT_POINTER, hits)) != pointers:
        return None
    if not all(map(is_, map(_DEREF, map(_HIT_REF, hits)), values)) or list(map(_HIT_DTYPE, hits)) != dtypes:
        return None
    try:
        if not all(map(is_contiguous or _IS_CONTIGUOUS, values)):  # a transpose in the same memory: stale view
            return None
    except (AttributeError, RuntimeError, TypeError, ValueError):  # pragma: no cover - the views were made for them
        return None
    return list(map(_HIT_VIEW, hits))


_HIT_REF, _HIT_VIEW, _HIT_POINTER, _HIT_DTYPE = itemgetter(0), itemgetter(1), itemgetter(2), itemgetter(3)
_SHAPE, _DTYPE, _DEVICE = attrgetter("shape"), attrgetter("dtype"), attrgetter("device")
_DATA_PTR, _DEREF = methodcaller("data_ptr"), methodcaller("__call__")
_IS_CONTIGUOUS = methodcaller("is_contiguous")  # (_contiguous without its call, for the column checks)


def _cached_views(values: list[Any], shapes: list[Any], tensor_type: type) -> list[np.ndarray] | None:
    """:func:`writable_views` of MindSpore tensors in host memory whose every view an earlier load made (the same
    tensor, memory, shape and dtype): the checks of the loop, column by column (C loops, no Python per tensor); ``None``
    when any value is something else (the loop then decides each).
    """
    kinds = set(map(type, values))
    if not all(issubclass(kind, tensor_type) for kind in kinds):
        return None
    # The tensor type's own methods, unbound, where no subclass overrides them (a bound-method lookup per tensor
    # costs as much as the call).
    data_ptr, is_contiguous = _DATA_PTR, _IS_CONTIGUOUS
    own_ptr, own_contiguous = getattr(tensor_type, "data_ptr", None), getattr(tensor_type, "is_contiguous", None)
    if own_ptr is not None and all(getattr(kind, "data_ptr", None) is own_ptr for kind in kinds):
        data_ptr = own_ptr
    if own_contiguous is not None and all(getattr(kind, "is_contiguous", None) is own_contiguous for kind in kinds):
        is_contiguous = own_contiguous
    try:
        for device in set(map(_DEVICE, values)):
            if isinstance(device, str) and device and not _HOST_DEVICES.get(device, False):
                return None  # a device tensor, or a device not seen yet: the loop (it learns the device)
        hits = list(map(_VIEWS.get, map(id, values)))
        if any(map(is_, hits, repeat(None))) or not all(map(is_, map(_DEREF, map(_HIT_REF, hits)), values)):
            return None
        views = list(map(_HIT_VIEW, hits))
        if list(map(_SHAPE, views)) != shapes:
            return None
        if list(map(int, map(data_ptr, values))) != list(map(_HIT_POINTER, hits)):
            return None
        if not all(map(is_, map(_DTYPE, values), map(_HIT_DTYPE, hits))):
            return None  # memory and shape kept, dtype changed (assign_value of a bitcast): a view of the new dtype
        if not all(map(is_contiguous, values)):
            return None  # memory, shape and dtype kept, now a transpose (assign_value(p.T)): no view reads it
    except (AttributeError, RuntimeError, TypeError, ValueError):  # the loop says what is wrong, value by value
        return None
    return views


def from_numpy(array: np.ndarray, *, copy: bool = False) -> Any:
    """Wrap a numpy array as a MindSpore Tensor (sharing memory unless ``copy``).

    An array of another byte order (``>f4``) is copied in this machine's: MindSpore wraps no other.
    """
    import mindspore as ms  # pylint: disable=import-outside-toplevel

    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if np.ndim(array) == 0:
        return ms.Tensor(np.array(array, copy=True))
    data = np.array(array, copy=True, order="C") if copy else np.ascontiguousarray(array)
    return ms.Tensor.from_numpy(data)


def assign(target: Any, array: np.ndarray) -> None:
    """Give tensor ``target`` the values of ``array`` in place (same object)."""
    if isinstance(target, np.ndarray):
        np.copyto(target, array.astype(target.dtype, copy=False))
        return
    ms = _mindspore()
    if ms is None or not isinstance(target, ms.Tensor):
        raise TypeError(f"cannot assign into {type(target).__name__}")
    new = from_numpy(np.asarray(array, dtype=to_numpy_dtype(target)), copy=True)
    if isinstance(target, ms.Parameter):
        # set_data clears MindSpore's ``sliced`` mark unless told the data is a slice (as its own load does):
        # a slice loaded here would then be refused as a whole tensor by the next save under a strategy file.
        target.set_data(new, bool(target.sliced))
    else:
        target.assign_value(new)


def assign_region(target: Any, region: tuple[slice, ...], array: np.ndarray) -> None:
    """Write ``array`` into ``target[region]`` in place (same object): copy in of one region.

    For a tensor whose memory numpy cannot alias (device memory). Uses the
    framework's region write (``target[region] = value``), or for a region
    that is the whole tensor and all of its memory (no view) its in-place
    copy (``copy_``: no index to parse, any dtype); where the framework refuses it for this dtype
    (MindSpore's CPU kernel has no bfloat16 region copy), writes the region
    through an unsigned integer view of the same memory and element size
    (``Tensor.view(dtype)``), and only where no such view aliases the tensor
    copies the whole tensor out, patches the region and assigns the whole
    tensor back. Serialised by a lock (reader threads call it concurrently).
    """
    if isinstance(target, np.ndarray):
        np.copyto(target[region], array, casting="unsafe")
        return
    value = from_numpy(np.asarray(array, dtype=to_numpy_dtype(target)), copy=True)
    shape = tuple(target.shape)
    whole = len(region) == len(shape) and all(r.start == 0 and r.stop == n for r, n in zip(region, shape)) and (
        _own_memory(target))
    with _REGION_LOCK:
        try:
            if whole:
                target.copy_(value)
            else:
                target[region] = value
        except (AttributeError, RuntimeError, TypeError, ValueError):
            if not _assign_bits(target, region, value):
                patched = np.array(to_numpy(target), copy=True)
                patched[region] = array
                assign(target, patched)


#: Unsigned integer dtype names by element size: the region write of a dtype the framework has none for.
_BITS = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


def _assign_bits(target: Any, region: tuple[slice, ...], value: Any) -> bool:
    """Write tensor ``value`` (of ``target``'s dtype) into ``target[region]`` as raw bits, through an unsigned
    integer view of ``target``'s memory: no copy of the whole tensor. ``False`` (nothing written) where the
    framework offers no such view that aliases ``target``, or refuses its region write."""
    name = _BITS.get(np.dtype(to_numpy_dtype(target)).itemsize)
    try:
        alias = target.view(ms_dtype(name))
        if alias.data_ptr() != target.data_ptr():  # a copy, not a view: writing it would change nothing
            return False
        alias[region] = value.view(ms_dtype(name))
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return False
    return True


class _MemorySpan(NamedTuple):
    """Where a MindSpore tensor lies in its memory (:func:`_memory_span`)."""

    offset: int  #: storage offset, in elements
    contiguous: bool
    storage: int  #: bytes of the memory it views
    nbytes: int  #: its own bytes

    @property
    def whole(self) -> bool:
        """Whether the tensor is all of its memory: no view of part of another tensor's."""
        return not self.offset and self.contiguous and self.storage == self.nbytes


def _memory_span(value: Any) -> _MemorySpan | None:
    """Where the tensor ``value`` lies in its memory; ``None`` when the framework does not tell."""
    try:
        return _MemorySpan(int(value.storage_offset()), bool(value.is_contiguous()),
                           int(value.untyped_storage().nbytes()), int(value.nbytes))
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def _own_memory(value: Any) -> bool:
    """Whether a tensor is all of its memory (no view of another tensor's): ``copy_`` into a view writes nothing
    or fails (MindSpore on CPU), a region write does not. ``False`` when not known."""
    span = _memory_span(value)
    return span is not None and span.whole


def view_of_other_memory(value: Any) -> str | None:
    """How a MindSpore tensor views memory of another tensor (a slice, transpose, reshape...), or ``None``.

    Such a tensor (``t[0:2]``, ``t.T``, ``t.reshape(-1)`` in PyNative mode) cannot be loaded into in place:
    ``asnumpy()`` hands back a copy, and assigning new data to it leaves the tensor it views unchanged
    (MindSpore's own in-place copy into a view fails or writes nothing on CPU). Told by its storage offset,
    contiguity and storage size; in host memory also by ``asnumpy()`` not aliasing its memory (a view of the
    whole memory). For a load's targets without a writable view only: it may copy the tensor.
    """
    span = _memory_span(value) if is_tensor(value) else None
    if span is None:
        return None
    if span.whole:
        try:
            if not host_memory_shared(value) or not span.nbytes:
                return None
            copied = value.asnumpy().__array_interface__["data"][0] != int(value.data_ptr())
        except (AttributeError, RuntimeError, TypeError, ValueError):
            return None
        return "a view of all of another tensor's memory (e.g. a reshape)" if copied else None
    return (f"{span.nbytes} bytes at element {span.offset} of another tensor's {span.storage}-byte memory"
            f"{'' if span.contiguous else ', not contiguous (e.g. a transpose)'}")
