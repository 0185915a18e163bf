"""A tensor of a dtype no checkpoint holds: save and load refuse it naming the key and the fix, before any byte."""

import re

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp

ms.set_device("CPU")

_STRUCTURED = np.dtype([("a", "f4"), ("b", "i4")])
_TARGETS = [
    (lambda: np.zeros(3, np.longdouble), np.dtype(np.longdouble).name),
    (lambda: np.zeros(3, _STRUCTURED), re.escape("void64 (structured: [('a', '<f4'), ('b', '<i4')])")),
    (lambda: np.zeros(3, "U4"), "str128"),
    (lambda: ms.Tensor(np.zeros(3, np.complex64)), "complex64"),
]


@pytest.fixture(name="ckpt")
def _ckpt(tmp_path):
    dcp.save({"w": np.arange(3, dtype=np.float64), "b": np.ones(2, np.float32)}, checkpoint_id=tmp_path / "c")
    return tmp_path / "c"


@pytest.mark.parametrize("make, dtype", _TARGETS)
def test_dcp_load_into_an_unstorable_dtype_names_the_key_and_the_dtype_to_load_into(ckpt, make, dtype):
    target = {"w": make(), "b": np.zeros(2, np.float32)}
    with pytest.raises(dcp.UnsupportedTypeError) as info:
        dcp.load(target, checkpoint_id=ckpt)
    message = str(info.value)
    expected = (rf"key 'w': the target is a (numpy array|Tensor) of dtype {dtype}, which no checkpoint can hold, so "
                r"no value can be loaded into it; the checkpoint stores it as float64 of shape \[3\]: " + re.escape(
                    "load into a target of that dtype (e.g. np.zeros((3,), dtype='float64')) and convert it "
                    "afterwards; nothing was loaded"))
    assert re.fullmatch(expected, message), message
    assert "before saving" not in message
    assert not target["b"].any()  # nothing landed


def test_dcp_load_of_a_missing_key_of_an_unstorable_dtype_names_the_kinds_held(ckpt):
    with pytest.raises(dcp.UnsupportedTypeError, match=r"key 'gone': the target is a numpy array of dtype "
                       r"complex128, .*; load into a target of a dtype a checkpoint holds \(bool, integer and float "
                       r"dtypes and bfloat16\); nothing was loaded"):
        dcp.load({"gone": np.zeros(2, np.complex128)}, checkpoint_id=ckpt)


@pytest.mark.parametrize("make, dtype", _TARGETS)
def test_load_checkpoint_into_an_unstorable_dtype_names_key_target_and_fix(ckpt, make, dtype):
    target = {"w": make(), "b": np.zeros(2, np.float32)}
    with pytest.raises(dcp.UnsupportedTypeError) as info:
        hyper_parallel.load_checkpoint(ckpt, target)
    message = str(info.value)
    assert re.match(rf"key 'w': the target is a (numpy array|Tensor) of dtype {dtype}, which no checkpoint", message)
    assert "stores it as float64 of shape [3]" in message and "np.zeros((3,), dtype='float64')" in message
    assert message != f"dtype {dtype} cannot be stored in a checkpoint"
    assert not target["b"].any()


def test_load_checkpoint_names_the_net_entry_when_it_differs_from_the_key(tmp_path):
    hyper_parallel.save_checkpoint({"model.w": np.ones(2, np.float32)}, tmp_path / "c")
    with pytest.raises(dcp.UnsupportedTypeError, match=r"key 'model.w': the target 'w' is a numpy array of dtype "
                       r"complex64, .* stores it as float32 of shape \[2\]"):
        hyper_parallel.load_checkpoint(tmp_path / "c", {"w": np.zeros(2, np.complex64)})


@pytest.mark.parametrize("value, advice", [
    (np.zeros(2, np.longdouble), re.escape("convert it with .astype(np.float64)")),
    (np.zeros(2, _STRUCTURED), re.escape("store each field as an array of its own (value['a'], ...)")),
    (np.zeros(2, "U4"), re.escape("store it as a list (value.tolist()), saved as a value")),
    (ms.Tensor(np.zeros(2, np.complex64)), re.escape("store its .real and .imag as two float arrays")),
    (ms.Parameter(ms.Tensor(np.zeros(2, np.complex128)), name="p"), re.escape("store its .real and .imag")),
])
@pytest.mark.parametrize("one_line", [False, True])
def test_save_of_an_unstorable_dtype_names_the_key_and_a_conversion_of_its_kind(tmp_path, value, advice, one_line):
    state = {"p": value, "ok": np.ones(2)}
    with pytest.raises(dcp.UnsupportedTypeError, match=rf"checkpoint item 'p': dtype \w+ cannot be stored in a "
                       rf"checkpoint; {advice}.*; a checkpoint holds bool, integer and float dtypes and bfloat16"):
        if one_line:
            hyper_parallel.save_checkpoint(state, tmp_path / "c")
        else:
            dcp.save(state, checkpoint_id=tmp_path / "c")
    assert not (tmp_path / "c" / "metadata.json").exists()


def test_a_dtype_of_no_other_kind_gets_the_list_of_dtypes_held(tmp_path, ckpt):
    with pytest.raises(dcp.UnsupportedTypeError, match=r"checkpoint item 't': dtype datetime64\[s\] cannot be "
                       r"stored in a checkpoint; convert it to bool, an integer or float dtype, or bfloat16$"):
        dcp.save({"t": np.zeros(2, "M8[s]")}, checkpoint_id=tmp_path / "t")
    with pytest.raises(dcp.UnsupportedTypeError, match=r"key 'w': the target is a numpy array of dtype "
                       r"datetime64\[s\], .* stores it as float64"):
        dcp.load({"w": np.zeros(3, "M8[s]")}, checkpoint_id=ckpt)


def test_a_load_target_refused_for_another_reason_keeps_its_message(ckpt):
    """An unapplied ShardedTensorFactory is refused as before (its dtype is not the cause)."""
    factory = dcp.mapping.ShardedTensorFactory("w", np.zeros(3), build_fn=lambda *a: {}, merge_fn=lambda x: x)
    with pytest.raises(dcp.UnsupportedTypeError, match="ShardedTensorFactory") as info:
        dcp.load({"w": factory}, checkpoint_id=ckpt)
    assert "no checkpoint can hold" not in str(info.value)
