"""hp-ckpt import DIR on a directory of MindSpore .ckpt files: one is imported, several are named with the fix."""

import os

import mindspore
import numpy as np
import pytest
from safetensors.numpy import save_file

import hyper_parallel
from hyper_parallel.cli.main import main

mindspore.set_device("CPU")


def _run(capsys, *args) -> tuple[int, str, str]:
    code = main([str(arg) for arg in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _save(net: mindspore.nn.Cell, path, seconds: int, fmt: str = "ckpt") -> None:
    mindspore.save_checkpoint(net, str(path), format=fmt)
    os.utime(path, (seconds, seconds))  # ModelCheckpoint's order: the later step written later


def test_a_directory_holding_one_ckpt_file_imports_it(tmp_path, capsys):
    net = mindspore.nn.Dense(3, 2)
    (tmp_path / "run").mkdir()
    _save(net, tmp_path / "run" / "net-1_10.ckpt", 1_000)
    (tmp_path / "run" / "net-graph.meta").write_bytes(b"graph")  # ModelCheckpoint writes it beside the steps
    code, out, err = _run(capsys, "import", tmp_path / "run", tmp_path / "out")
    assert code == 0, err
    assert "imported 2 tensor(s)" in out
    loaded = hyper_parallel.load_checkpoint(tmp_path / "out")
    for name, param in net.parameters_dict().items():
        assert np.array_equal(loaded[name].asnumpy(), param.asnumpy()), name


def test_a_directory_of_several_ckpt_files_names_them_and_the_newest(tmp_path, capsys):
    net = mindspore.nn.Dense(3, 2)
    run = tmp_path / "run"
    run.mkdir()
    _save(net, run / "net-2_20.ckpt", 2_000)
    _save(net, run / "net-1_10.ckpt", 1_000)
    _save(net, run / "net-3_5.ckpt", 3_000)
    code, _, err = _run(capsys, "import", run, tmp_path / "out")
    assert code == 2
    assert f"{run} holds 3 MindSpore .ckpt files (net-1_10.ckpt, net-2_20.ckpt, net-3_5.ckpt) and no .safetensors" \
        in err, err
    assert f"hp-ckpt import {run / 'net-3_5.ckpt'} OUT (the newest)" in err, err
    assert "holds no .safetensors file to import" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("held, shown", [((), "it is empty"), (("notes.txt", "sub/"), "it holds notes.txt, sub/")])
def test_a_directory_without_checkpoint_files_says_what_it_holds_and_what_import_reads(tmp_path, capsys, held,
                                                                                       shown):
    src = tmp_path / "src"
    src.mkdir()
    for name in held:
        (src / name).mkdir() if name.endswith("/") else (src / name).write_text("x")
    code, _, err = _run(capsys, "import", src, tmp_path / "out")
    assert code == 2
    assert f"{src} holds no checkpoint file to import ({shown}): hp-ckpt import reads a MindSpore .ckpt or " \
        ".safetensors file" in err, err
    assert "rank_<i>/" in err and "--strategy FILE" in err


def test_two_saves_of_one_network_as_safetensors_are_named_not_taken_for_shards(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    net = mindspore.nn.Dense(3, 2)
    _save(net, run / "net-1_10.safetensors", 1_000, fmt="safetensors")
    _save(net, run / "net-2_20.safetensors", 2_000, fmt="safetensors")
    code, _, err = _run(capsys, "import", run, tmp_path / "out")
    assert code == 2
    assert "they are not shards of one model" in err and f"hp-ckpt import {run / 'net-2_20.safetensors'} OUT" in err
    save_file({"a": np.ones(2, np.float32)}, str(run / "extra.safetensors"))  # (still refused: 'bias' twice)
    assert _run(capsys, "import", run, tmp_path / "out")[0] == 2


def test_load_of_a_directory_of_ckpt_files_names_the_newest_file_to_import(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    old, new = mindspore.nn.Dense(3, 2), mindspore.nn.Dense(3, 2)
    _save(new, run / "net-10_100.ckpt", 2_000)  # sorts before net-2_20 by name, written after it
    _save(old, run / "net-2_20.ckpt", 1_000)
    with pytest.raises(hyper_parallel.core.distributed_checkpoint.IncompleteCheckpointError) as info:
        hyper_parallel.load_checkpoint(run)
    command = f"hp-ckpt import {run / 'net-10_100.ckpt'} OUT_DIR"
    assert f"`{command}` (the newest; each .ckpt file is a checkpoint of its own)" in str(info.value), info.value
    assert _run(capsys, *command.replace("OUT_DIR", str(tmp_path / "out")).split()[1:])[0] == 0  # the advice works
    loaded = hyper_parallel.load_checkpoint(tmp_path / "out")
    assert np.array_equal(loaded["weight"].asnumpy(), new.weight.asnumpy())


def test_load_of_a_directory_of_safetensors_shards_names_the_directory_to_import(tmp_path):
    model = tmp_path / "hf"
    model.mkdir()
    save_file({"a": np.ones(2, np.float32)}, str(model / "model-00001-of-00002.safetensors"))
    save_file({"b": np.ones(3, np.float32)}, str(model / "model-00002-of-00002.safetensors"))
    with pytest.raises(hyper_parallel.core.distributed_checkpoint.IncompleteCheckpointError) as info:
        hyper_parallel.load_checkpoint(model)
    assert f"`hp-ckpt import {model} OUT_DIR`" in str(info.value), info.value  # all shards, not the first one


@pytest.mark.parametrize("model_files, model_command", [
    (("model.safetensors",), "hp-ckpt import {run}/model.safetensors OUT"),
    (("a.safetensors", "b.safetensors"), "move the .ckpt files out of {run} and import it again"),
    (("model-1.safetensors", "model.safetensors.index.json"), "hp-ckpt import {run}/model.safetensors.index.json OUT"),
])
def test_a_directory_holding_safetensors_and_ckpt_files_names_both_and_imports_neither(tmp_path, capsys, model_files,
                                                                                       model_command):
    # The .ckpt files were skipped quietly: their tensors were left out of the import.
    run = tmp_path / "run"
    run.mkdir()
    for name in model_files:
        if name.endswith(".json"):
            (run / name).write_text('{"weight_map": {"a": "model-1.safetensors"}}')
        else:
            save_file({name[:-12].replace("-", "_"): np.ones(2, np.float32)}, str(run / name))
    net = mindspore.nn.Dense(3, 2)
    _save(net, run / "net-2_20.ckpt", 2_000)
    _save(net, run / "net-1_10.ckpt", 1_000)
    code, out, err = _run(capsys, "import", run, tmp_path / "out")
    assert code == 2, out
    assert (f"{run} holds both .safetensors files ({', '.join(n for n in model_files if n.endswith('.safetensors'))}) "
            "and MindSpore .ckpt files (net-1_10.ckpt, net-2_20.ckpt); importing the directory would leave the .ckpt "
            f"files' tensors out. Name what to import: for the safetensors model, {model_command.format(run=run)}; "
            f"for a .ckpt file, hp-ckpt import {run / 'net-2_20.ckpt'} OUT (the newest; each .ckpt file is a "
            "checkpoint of its own)") in err, err
    assert not (tmp_path / "out").exists()
    if len(model_files) == 1:  # the advice works, each way
        command = model_command.format(run=run).replace("OUT", str(tmp_path / "model"))
        assert _run(capsys, *command.split()[1:])[0] == 0
        assert sorted(hyper_parallel.load_checkpoint(tmp_path / "model")) == ["model"]
        assert _run(capsys, "import", run / "net-2_20.ckpt", tmp_path / "net")[0] == 0
        assert sorted(hyper_parallel.load_checkpoint(tmp_path / "net")) == ["bias", "weight"]
