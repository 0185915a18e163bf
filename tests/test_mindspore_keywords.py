"""mindspore.save_checkpoint / load_checkpoint keywords given to the one-liners: refused naming the call and the fix."""

import inspect
import re

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import hyper_parallel
from hyper_parallel.core.distributed_checkpoint import _ms_keywords, _one_line, api

ms.set_device("CPU")


@pytest.mark.parametrize("keyword, value, advice", [
    ("enc_key", b"0" * 16, "not encrypted"),
    ("enc_mode", "AES-CBC", "encrypted storage"),
    ("async_save", True, r"async_save\(net.parameters_dict\(\)"),
    ("integrated_save", False, "reshards them to any layout"),
    ("format", "ckpt", "hp-ckpt export-mindspore CKPT OUT --format ckpt"),
    ("crc_check", True, "checksums"),
    ("choice_func", lambda name: True, r"p.name: p for p in net.get_parameters\(\) if choice_func"),
    ("global_step_num", 3, "append_dict={'global_step_num': step}"),
    ("incremental", True, "new checkpoint_id"),
])
def test_a_mindspore_save_keyword_names_save_checkpoint_and_the_fix(tmp_path, keyword, value, advice):
    with pytest.raises(TypeError) as info:
        hyper_parallel.save_checkpoint(nn.Dense(2, 2), tmp_path / "ckpt", **{keyword: value})
    message = str(info.value)
    assert message.startswith(f"save_checkpoint(): {keyword}= (a keyword of mindspore.save_checkpoint) is not "
                              "supported by hyper_parallel.save_checkpoint: "), message
    assert "save()" not in message
    assert re.search(advice, message), message
    assert not (tmp_path / "ckpt").exists()  # refused before anything is written


@pytest.mark.parametrize("keyword, value, advice", [
    ("dec_key", b"0" * 16, r"mindspore.load_checkpoint\(FILE, dec_key=...\)"),
    ("dec_mode", "AES-GCM", "nothing to decrypt"),
    ("crc_check", True, "hp-ckpt verify CKPT"),
    ("remove_redundancy", True, "each rank reads the values of its own layout"),
    ("format", "safetensors", "hp-ckpt import FILE OUT_DIR"),
])
def test_a_mindspore_load_keyword_names_load_checkpoint_and_the_fix(tmp_path, keyword, value, advice):
    hyper_parallel.save_checkpoint({"w": np.ones(2, np.float32)}, tmp_path / "ckpt")
    with pytest.raises(TypeError) as info:
        hyper_parallel.load_checkpoint(tmp_path / "ckpt", **{keyword: value})
    message = str(info.value)
    assert message.startswith(f"load_checkpoint(): {keyword}= (a keyword of mindspore.load_checkpoint) is not "
                              "supported by hyper_parallel.load_checkpoint: "), message
    assert re.search(advice, message), message


def test_unknown_keywords_are_listed_with_the_keywords_taken(tmp_path):
    with pytest.raises(TypeError) as info:
        hyper_parallel.save_checkpoint({"w": np.ones(2)}, tmp_path / "c", enc_key=b"k", colective=False)
    message = str(info.value)
    assert "enc_key= (a keyword of mindspore.save_checkpoint)" in message
    assert "unexpected keyword argument(s) 'colective'; it takes " in message
    assert "use_collectives" in message and "append_dict" in message and "allow_pickle" in message


def test_the_keywords_taken_are_those_of_dcp_save_and_load():
    """The lists in the messages follow dcp.save / dcp.load and the one-liners' own signatures."""
    def named(function):
        return {name for name, p in inspect.signature(function).parameters.items()
                if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)}

    assert set(_one_line._SAVE_KEYWORDS) == (named(api.save) | named(_one_line.save_checkpoint) | {"allow_pickle"}) - {
        "state_dict", "checkpoint_id", "save_obj"}
    assert set(_one_line._LOAD_KEYWORDS) == (named(api.load) | named(_one_line.load_checkpoint)) - {
        "state_dict", "checkpoint_id"}
    # the MindSpore keywords refused are MindSpore's, and none is one the one-liners take
    ms_save = set(inspect.signature(ms.save_checkpoint).parameters) | {"global_step_num", "incremental"}
    ms_load = set(inspect.signature(ms.load_checkpoint).parameters)
    from hyper_parallel.core.distributed_checkpoint._ms_keywords import LOAD_INSTEAD, SAVE_INSTEAD
    assert set(SAVE_INSTEAD) <= ms_save and not set(SAVE_INSTEAD) & set(_one_line._SAVE_KEYWORDS)
    assert set(LOAD_INSTEAD) <= ms_load and not set(LOAD_INSTEAD) & set(_one_line._LOAD_KEYWORDS)
    # every keyword of MindSpore's is either taken or refused with advice
    assert ms_save - {"save_obj", "ckpt_file_name", "kwargs"} <= set(SAVE_INSTEAD) | set(_one_line._SAVE_KEYWORDS)
    assert ms_load - {"ckpt_file_name"} <= set(LOAD_INSTEAD) | set(_one_line._LOAD_KEYWORDS)


def test_mindspore_s_list_of_name_data_dicts_is_named_with_the_dict_to_pass(tmp_path):
    listed = [{"name": "w", "data": ms.Tensor(np.ones(2, np.float32))}]
    with pytest.raises(hyper_parallel.core.distributed_checkpoint.CheckpointValueError) as info:
        hyper_parallel.save_checkpoint(listed, tmp_path / "c")
    assert str(info.value) == (
        "save_obj must be a mindspore.nn.Cell or a state dict, got list; for mindspore.save_checkpoint's list of "
        "{'name': ..., 'data': ...} dicts pass {item['name']: item['data'] for item in save_obj} (a dict of the "
        "same entries)")
    saved = {item["name"]: item["data"] for item in listed}  # the advice works
    hyper_parallel.save_checkpoint(saved, tmp_path / "c")
    assert np.array_equal(hyper_parallel.load_checkpoint(tmp_path / "c")["w"].asnumpy(), [1.0, 1.0])
    with pytest.raises(hyper_parallel.core.distributed_checkpoint.CheckpointValueError) as other:
        hyper_parallel.save_checkpoint([1, 2], tmp_path / "d")
    assert str(other.value) == "save_obj must be a mindspore.nn.Cell or a state dict, got list"


def test_checkpoint_callback_given_a_checkpoint_config_names_the_keywords_of_its_settings(tmp_path):
    config = ms.train.CheckpointConfig(save_checkpoint_steps=100, keep_checkpoint_max=3)
    with pytest.raises(TypeError) as info:
        hyper_parallel.CheckpointCallback(tmp_path, config=config)
    assert str(info.value) == (
        "CheckpointCallback(): config= (a keyword of mindspore.train.ModelCheckpoint / CheckpointConfig) is not "
        "supported by hyper_parallel.CheckpointCallback: pass its settings as keywords: CheckpointCallback(directory, "
        "save_checkpoint_steps=100, keep_checkpoint_max=3, async_save=False, exception_save=False) (append_info= as "
        "in CheckpointConfig)")
    made = hyper_parallel.CheckpointCallback(tmp_path, save_checkpoint_steps=100, keep_checkpoint_max=3,
                                             async_save=False, exception_save=False)  # the advice is taken
    assert made.save_checkpoint_steps == 100


@pytest.mark.parametrize("keyword, advice", [
    ("prefix", "steps are saved as directory/step_<n>"),
    ("enc_key", "not encrypted"),
    ("integrated_save", "reshards them to any layout"),
    ("saved_network", "saves the network Model.train trains"),
    ("remove_redundancy", "stores each replicated Parameter once"),
    ("sav_checkpoint_steps", "unexpected keyword argument(s) 'sav_checkpoint_steps'; it takes append_info, "
                             "async_save, directory, exception_save, keep_checkpoint_max"),
])
def test_checkpoint_callback_given_a_model_checkpoint_keyword_says_what_to_do(tmp_path, keyword, advice):
    with pytest.raises(TypeError) as info:
        hyper_parallel.CheckpointCallback(tmp_path, **{keyword: "x"})
    assert str(info.value).startswith("CheckpointCallback(): ") and advice in str(info.value), str(info.value)


@pytest.mark.parametrize("name", ["net.ckpt", "net.safetensors"])
def test_a_save_to_a_mindspore_file_name_warns_once_that_it_is_a_directory(tmp_path, caplog, name):
    path = str(tmp_path / name)
    with caplog.at_level("WARNING", logger="hyper_parallel.core.distributed_checkpoint._ms_keywords"):
        hyper_parallel.save_checkpoint({"w": np.ones(2, np.float32)}, path)
        hyper_parallel.save_checkpoint({"w": np.ones(2, np.float32)}, path)
    warned = [r.getMessage() for r in caplog.records if "named like a MindSpore checkpoint file" in r.getMessage()]
    assert warned == [
        f"save_checkpoint: {path} is named like a MindSpore checkpoint file, but a hyper_parallel checkpoint is a "
        "directory, written there now: mindspore.load_checkpoint cannot read it. Load it with "
        f"hyper_parallel.load_checkpoint, or write MindSpore files from it with `hp-ckpt export-mindspore {path} "
        "OUT` (a directory name without the suffix avoids the confusion)"]
    assert (tmp_path / name).is_dir()


def test_the_ids_warned_about_are_bounded(caplog):
    """A loop saving to a new id named like a MindSpore file each step kept every id it warned about, one more per
    save for as long as the process ran; now the last _KEPT_WARNED are kept (each still warned about once)."""
    kept = _ms_keywords._KEPT_WARNED  # pylint: disable=protected-access
    names = [f"/nonexistent/step_{step}.ckpt" for step in range(3 * kept)]
    with caplog.at_level("WARNING", logger="hyper_parallel.core.distributed_checkpoint._ms_keywords"):
        for name in names:
            _ms_keywords.warn_file_name(name)
            _ms_keywords.warn_file_name(name)
    assert [r.args[0] for r in caplog.records] == names
    assert list(_ms_keywords._WARNED) == names[-kept:]  # pylint: disable=protected-access


def test_a_save_to_a_directory_name_does_not_warn(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        hyper_parallel.save_checkpoint({"w": np.ones(2, np.float32)}, tmp_path / "step_1")
    assert not [r for r in caplog.records if "named like a MindSpore" in r.getMessage()]


def test_mindspore_s_positional_order_is_named_argument_by_argument(tmp_path):
    """MindSpore's own positional order, by habit: Python's bare 'takes 2 positional arguments but 5 were given'
    said neither which argument nor what to do. Each is named by its MindSpore parameter, with the fix."""
    net = nn.Dense(2, 2)
    with pytest.raises(TypeError) as info:
        hyper_parallel.save_checkpoint(net, tmp_path / "c", True, False, {"epoch": 1})
    assert str(info.value).startswith(
        "save_checkpoint() takes only save_obj and checkpoint_id positionally, the rest by keyword; in "
        "mindspore.save_checkpoint's order the arguments given are: integrated_save=True: not needed: every rank "
        "saves its own shards"), info.value
    assert str(info.value).endswith("; append_dict={'epoch': 1}: pass it by keyword (append_dict=...)"), info.value
    assert "async_save=False: save in the background with" in str(info.value)
    assert not (tmp_path / "c").exists()
    hyper_parallel.save_checkpoint(net, tmp_path / "c")
    with pytest.raises(TypeError) as info:
        hyper_parallel.load_checkpoint(tmp_path / "c", net, True, None, b"key", "AES-GCM", None, None, False, False,
                                       "ckpt", 1)
    message = str(info.value)
    assert message.startswith(
        "load_checkpoint() takes only checkpoint_id and net positionally, the rest by keyword; in "
        "mindspore.load_checkpoint's order the arguments given are: strict_load=True: pass it by keyword "
        "(strict_load=...); filter_prefix=None: pass it by keyword (filter_prefix=...); dec_key=b'key': "
        "hyper_parallel checkpoints are not encrypted"), message
    assert message.endswith("; 1 more than mindspore.load_checkpoint takes"), message
    # The positions are MindSpore's own.
    from hyper_parallel.core.distributed_checkpoint._ms_keywords import CALLBACK_POSITIONS, LOAD_POSITIONS, \
        SAVE_POSITIONS
    assert ("save_obj", "ckpt_file_name", *SAVE_POSITIONS, "kwargs") == tuple(
        inspect.signature(ms.save_checkpoint).parameters)
    assert ("ckpt_file_name", "net", *LOAD_POSITIONS) == tuple(inspect.signature(ms.load_checkpoint).parameters)
    assert ("self", *CALLBACK_POSITIONS) == tuple(inspect.signature(ms.train.ModelCheckpoint.__init__).parameters)


def test_model_checkpoint_s_positional_order_names_prefix_directory_and_config(tmp_path):
    config = ms.train.CheckpointConfig(save_checkpoint_steps=10, keep_checkpoint_max=3)
    with pytest.raises(TypeError) as info:
        hyper_parallel.CheckpointCallback("net", str(tmp_path / "ckpt"), config)
    assert str(info.value) == (
        "CheckpointCallback() takes only directory positionally, the rest by keyword; in "
        "mindspore.train.ModelCheckpoint's order the arguments given are: prefix='net': steps are saved as "
        f"directory/step_<n>; drop it (give each run a directory of its own); directory='{tmp_path / 'ckpt'}': pass "
        "it as the first argument; config=<CheckpointConfig>: pass its settings as keywords: "
        "CheckpointCallback(directory, save_checkpoint_steps=10, keep_checkpoint_max=3, async_save=False, "
        "exception_save=False) (append_info= as in CheckpointConfig)")
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "net").exists()
    with pytest.raises(hyper_parallel.core.distributed_checkpoint.CheckpointValueError) as info:
        hyper_parallel.CheckpointCallback(None)
    assert str(info.value) == (
        "CheckpointCallback() got directory=None: pass the directory its steps are saved under (ModelCheckpoint's "
        "directory=None means the current directory; name it: CheckpointCallback('.'))")


def test_a_missing_or_swapped_checkpoint_id_names_the_function_called(tmp_path):
    """load_checkpoint(None) said 'load needs a checkpoint_id', naming dcp.load; a Cell where the id goes printed
    the whole network's repr as a path."""
    net = nn.Dense(2, 2)
    errors = hyper_parallel.core.distributed_checkpoint
    cases = [
        (lambda: hyper_parallel.load_checkpoint(None, net), "load_checkpoint() got checkpoint_id=None: pass the "
         "checkpoint directory (a path, or an s3:// URL), or a storage_reader"),
        (lambda: hyper_parallel.save_checkpoint(net, None), "save_checkpoint() got checkpoint_id=None: pass the "
         "checkpoint directory (a path, or an s3:// URL), or a storage_writer"),
        (lambda: hyper_parallel.load_checkpoint(net, tmp_path / "c"), "load_checkpoint() got a Dense (a Cell) as "
         "checkpoint_id: the arguments go in the order load_checkpoint(checkpoint_id, net), as in "
         "mindspore.load_checkpoint"),
        (lambda: hyper_parallel.save_checkpoint(tmp_path / "c", net), "save_checkpoint() got a Dense (a Cell) as "
         "checkpoint_id: the arguments go in the order save_checkpoint(save_obj, checkpoint_id), as in "
         "mindspore.save_checkpoint"),
    ]
    for call, message in cases:
        with pytest.raises(errors.CheckpointValueError) as info:
            call()
        assert str(info.value) == message
    assert not (tmp_path / "c").exists()
    # A storage given instead of the id is taken.
    hyper_parallel.save_checkpoint(net, None, storage_writer=errors.FileSystemWriter(tmp_path / "c"))
    loaded = hyper_parallel.load_checkpoint(None, storage_reader=errors.FileSystemReader(tmp_path / "c"))
    assert np.array_equal(loaded["weight"].asnumpy(), net.weight.asnumpy())


def test_the_crc_check_advice_says_what_the_checksums_cover():
    """The advice said every file carries checksums; the format makes them optional (docs/format.md, section 6)."""
    with pytest.raises(TypeError) as info:
        hyper_parallel.load_checkpoint("unused", crc_check=True)
    assert str(info.value) == (
        "load_checkpoint(): crc_check= (a keyword of mindspore.load_checkpoint) is not supported by "
        "hyper_parallel.load_checkpoint: not needed: a save stores a checksum of every block it writes, and a load "
        "verifies the checksums stored (unless its storage_reader was made with verify_checksums=False; an item "
        "stored without one, which the format allows, is read unverified: `hp-ckpt verify CKPT` checks a whole "
        "checkpoint and counts such items); drop it")


def test_a_model_is_answered_with_its_train_network(tmp_path):
    net = nn.Dense(2, 2)
    model = ms.train.Model(net, nn.MSELoss(), nn.Momentum(net.trainable_params(), 0.1, 0.9))
    advice = ("must be a mindspore.nn.Cell or a state dict, got Model; for a mindspore.train.Model pass "
              "model.train_network (its network and optimizer, each Parameter once), or the network alone")
    with pytest.raises(hyper_parallel.core.distributed_checkpoint.CheckpointValueError) as info:
        hyper_parallel.save_checkpoint(model, tmp_path / "c")
    assert str(info.value) == "save_obj " + advice
    hyper_parallel.save_checkpoint(model.train_network, tmp_path / "c")  # the advice works: the keys MindSpore saves
    ms.save_checkpoint(model.train_network, str(tmp_path / "ms.ckpt"))
    theirs = ms.load_checkpoint(str(tmp_path / "ms.ckpt"))
    assert sorted(hyper_parallel.load_checkpoint(tmp_path / "c")) == sorted(theirs)
    with pytest.raises(hyper_parallel.core.distributed_checkpoint.CheckpointValueError) as info:
        hyper_parallel.load_checkpoint(tmp_path / "c", model)
    assert str(info.value) == "net " + advice
