"""A checkpoint file passed as a strategy file is named as such, with the file to pass instead."""

import json

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint.errors import StrategyFileError

ms.set_device("CPU")

_FIX = "not a strategy file: pass the file MindSpore wrote through " \
       "set_auto_parallel_context(strategy_ckpt_config={'save_file': ...})"


def test_a_mindspore_checkpoint_file_given_as_strategy_file_is_named(tmp_path):
    net = ms.nn.Dense(2, 2)
    ms.save_checkpoint(net, str(tmp_path / "net.ckpt"))
    hyper_parallel.save_checkpoint(net, tmp_path / "ckpt")
    path = str(tmp_path / "net.ckpt")
    expected = (f"strategy file(s) [{path!r}] hold no parameter layout; {path!r} is a MindSpore checkpoint file "
                f"(2 parameter(s), e.g. 'weight'), {_FIX}")
    with pytest.raises(StrategyFileError) as info:
        hyper_parallel.layouts_from_strategy(path)
    assert str(info.value) == expected
    with pytest.raises(StrategyFileError) as again:
        hyper_parallel.load_checkpoint(tmp_path / "ckpt", net, strategy_file=path)
    assert expected in str(again.value)


def test_a_safetensors_file_given_as_strategy_file_is_named(tmp_path):
    ms.save_checkpoint(ms.nn.Dense(2, 2), str(tmp_path / "net.safetensors"), format="safetensors")
    path = str(tmp_path / "net.safetensors")
    with pytest.raises(StrategyFileError) as info:
        hyper_parallel.layouts_from_strategy(path)
    assert str(info.value).startswith(f"strategy file {path!r} is not a ParallelStrategyMap protobuf (")
    assert str(info.value).endswith(f"); {path!r} is a safetensors file (a checkpoint's tensors), {_FIX}")


def test_a_checkpoint_s_metadata_json_given_as_strategy_file_is_named(tmp_path):
    dcp.save({"w": np.ones(2)}, checkpoint_id=tmp_path / "c")
    path = str(tmp_path / "c" / "metadata.json")
    with pytest.raises(StrategyFileError) as info:
        hyper_parallel.layouts_from_strategy(path)
    assert str(info.value) == (f"strategy file(s) [{path!r}] hold no parameter layout; {path!r} is a "
                               f"hyper_parallel checkpoint's metadata, {_FIX}")


def test_other_unreadable_files_get_the_file_to_pass(tmp_path):
    (tmp_path / "s.ckpt").write_bytes(b"garbage")
    with pytest.raises(StrategyFileError) as info:
        hyper_parallel.layouts_from_strategy(tmp_path / "s.ckpt")
    assert str(info.value).endswith("; pass the file MindSpore wrote through "
                                    "set_auto_parallel_context(strategy_ckpt_config={'save_file': ...})")
    (tmp_path / "empty.json").write_text(json.dumps({"parallel_layout_item": {}}))
    with pytest.raises(StrategyFileError) as empty:
        hyper_parallel.layouts_from_strategy(tmp_path / "empty.json")
    assert str(empty.value).endswith("hold no parameter layout")  # nothing else to say about it
