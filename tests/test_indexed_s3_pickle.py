"""Indexed metadata of an S3 checkpoint pickles bound to its index objects, as a directory's does.

The metadata a save returns reaches every rank but the coordinator pickled; on S3 its copy could not read
a single index (CheckpointValueError), and neither could a pickled ``read_metadata`` result.
"""

from __future__ import annotations

import pickle

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointNotFoundError
from s3_server import new_filesystem, s3_endpoint, s3_url  # noqa: F401  (fixtures)
from sim_ranks import simulate_save

FULL = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)


def _save(url: str, ranks: int) -> dcp.Metadata:
    states = [{"w": DTensor.from_global(ms.Tensor(FULL), Layout((ranks,), (0, -1)), rank=r), "step": 9}
              for r in range(ranks)]
    committed, _ = simulate_save(states, url, writer_options={"metadata_form": "indexed"},
                                 writer_class=dcp.FsspecWriter)
    return committed


def _entries(metadata: dcp.Metadata) -> dict:
    return {(index.fqn, index.offset): (info.relative_path, info.offset, info.length)
            for index, info in metadata.storage_data.items()}


def test_s3_indexed_metadata_pickles_bound_to_its_index_objects(s3_url):  # noqa: F811
    committed = _save(s3_url, 4)
    expected = _entries(dcp.read_metadata(s3_url))
    assert sorted(expected)[:4] == [("step", ()), ("w", (0, 0)), ("w", (2, 0)), ("w", (4, 0))]
    received = pickle.loads(pickle.dumps(committed))  # what every other rank of the save receives
    assert _entries(received) == expected
    read = pickle.loads(pickle.dumps(dcp.read_metadata(s3_url)))
    info = read.storage_data[dcp.MetadataIndex("w", (6, 0))]
    assert (info.relative_path, info.offset, info.length) == expected[("w", (6, 0))]
    stale = pickle.loads(pickle.dumps(dcp.read_metadata(s3_url)))
    _save(s3_url, 2)  # another save replaces the checkpoint: its commit removes the old index objects
    with pytest.raises(CheckpointNotFoundError, match="deleted or replaced by another save while loading"):
        stale.storage_data[dcp.MetadataIndex("w", (0, 0))]
    whole = {"w": np.zeros_like(FULL), "step": 0}
    dcp.load(whole, checkpoint_id=s3_url, no_dist=True)
    assert np.array_equal(whole["w"], FULL) and whole["step"] == 9


def test_credentials_given_to_the_reader_are_not_pickled_with_its_metadata(s3_url):  # noqa: F811
    """A reader given credentials explicitly (storage options) bound the metadata's index opener to its fsspec
    filesystem, which pickles as its options: every copy of the metadata (sent to other ranks, pickled by the
    user, written to a file) carried the access key and the secret. The copy keeps the other options (the
    endpoint) and takes credentials from its own process's configuration, as a new reader would."""
    _save(s3_url, 4)
    key, secret, token = "AKIA-LEFTOVER-KEY-7", "leftover-secret-3f9c", "leftover-session-token-11"
    reader = dcp.FsspecReader(s3_url, key=key, secret=secret, token=token, default_block_size=1234567,
                              client_kwargs={"region_name": "us-east-1", "aws_secret_access_key": secret})
    metadata = reader.read_metadata()
    assert metadata.storage_data[dcp.MetadataIndex("w", (2, 0))].length == 2 * 6 * 4  # read with those credentials
    blob = pickle.dumps(metadata)
    for credential in (key, secret, token):
        assert credential.encode() not in blob, credential
    copy = pickle.loads(blob)
    info = copy.storage_data[dcp.MetadataIndex("w", (6, 0))]  # its index object, read with this process's config
    assert (info.relative_path, info.offset, info.length) == (
        lambda i: (i.relative_path, i.offset, i.length))(metadata.storage_data[dcp.MetadataIndex("w", (6, 0))])
    opener = copy.storage_data._opener  # pylint: disable=protected-access
    assert opener.fs.storage_options.get("client_kwargs") == {"region_name": "us-east-1"}
    assert opener.fs.storage_options.get("default_block_size") == 1234567 and "key" not in opener.fs.storage_options


def test_option_names_that_say_credential_are_left_out_at_any_depth_and_other_filesystems_are_not_pickled():
    from hyper_parallel.core.distributed_checkpoint._index_objects import (  # pylint: disable=import-outside-toplevel
        IndexObjects,
        without_credentials,
    )

    options = {"endpoint_url": "http://minio:9000", "password": "p", "client_kwargs": {"aws_session_token": "t",
               "region_name": "r"}, "profiles": [{"account_key": "k", "name": "a"}, ("sas_token", "x")], "anon": False}
    assert without_credentials(options) == {"endpoint_url": "http://minio:9000", "client_kwargs": {"region_name": "r"},
                                            "profiles": [{"name": "a"}, ("sas_token", "x")], "anon": False}

    class _OwnFilesystem:  # not an fsspec filesystem: no storage options to rebuild it from
        pass

    opener = IndexObjects(_OwnFilesystem(), root="b/p", url="s3://b/p", metadata_file="metadata.json", save_id="0" * 12)
    assert not opener.picklable
