"""The public surface: exported names, the exception tree, and the save/load signatures."""

from __future__ import annotations

import inspect

import pytest

import ckptstore

EXPECTED_ALL = [
    "__version__",
    "save",
    "load",
    "save_sharded",
    "load_sharded",
    "PerRank",
    "CheckpointStore",
    "SaveHandle",
    "TrainState",
    "ResumableSampler",
    "ResumableLoader",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "InvalidArgumentError",
    "NotACheckpointError",
    "PickleNotAllowedError",
    "StorageError",
    "UnknownProtocolError",
    "UnsupportedFormatVersionError",
    "UnsupportedObjectError",
    "CollectiveError",
]

EXCEPTIONS = [n for n in EXPECTED_ALL if n.endswith("Error")]

# Builtin bases that existing torch.save/torch.load error handlers catch.
BUILTIN_BASES = {
    "CheckpointNotFoundError": FileNotFoundError,
    "NotACheckpointError": ValueError,
    "UnsupportedObjectError": TypeError,
    "UnknownProtocolError": ValueError,
    "StorageError": OSError,
    "CheckpointExistsError": FileExistsError,
    "InvalidArgumentError": ValueError,
}

P = inspect.Parameter


def test_all_is_exactly_the_documented_list():
    assert list(ckptstore.__all__) == EXPECTED_ALL
    assert len(set(ckptstore.__all__)) == len(ckptstore.__all__)


def test_every_exported_name_resolves():
    namespace: dict = {}
    exec("from ckptstore import *", namespace)  # noqa: S102 - exercising star-import on purpose
    for name in EXPECTED_ALL:
        assert hasattr(ckptstore, name), name
        if name != "__version__":
            assert name in namespace, f"'from ckptstore import *' does not provide {name}"
    assert callable(ckptstore.save) and callable(ckptstore.load)


def test_version_is_a_release_string():
    from ckptstore._version import __version__

    assert isinstance(ckptstore.__version__, str)
    assert ckptstore.__version__ == __version__
    parts = ckptstore.__version__.split(".")
    assert len(parts) >= 2 and all(p.isdigit() for p in parts[:2])


@pytest.mark.parametrize("name", EXCEPTIONS)
def test_every_exception_derives_from_checkpoint_error(name):
    cls = getattr(ckptstore, name)
    assert isinstance(cls, type) and issubclass(cls, Exception)
    assert issubclass(cls, ckptstore.CheckpointError)
    assert cls is getattr(ckptstore.errors, name)


@pytest.mark.parametrize("name, base", sorted(BUILTIN_BASES.items()))
def test_builtin_bases(name, base):
    assert issubclass(getattr(ckptstore, name), base)


def test_error_attributes_and_messages():
    err = ckptstore.CorruptCheckpointError("bad chunk", location="/x/y.ckpt", key="model/w")
    assert (err.location, err.key, str(err)) == ("/x/y.ckpt", "model/w", "bad chunk")
    plain = ckptstore.CorruptCheckpointError("bad")
    assert plain.location is None and plain.key is None

    storage = ckptstore.StorageError("cannot write /x: disk full", errno=28)
    assert storage.errno == 28 and str(storage) == "cannot write /x: disk full"
    assert ckptstore.StorageError("no errno").errno is None

    missing = ckptstore.CheckpointNotFoundError("no checkpoint at /x")
    assert str(missing) == "no checkpoint at /x"
    assert missing.errno == 2


def _shape(func):
    return [(p.name, p.kind, p.default) for p in inspect.signature(func).parameters.values()]


def test_save_signature():
    assert _shape(ckptstore.save) == [
        ("obj", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("f", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("compression", P.KEYWORD_ONLY, None),
        ("allow_pickle", P.KEYWORD_ONLY, False),
        ("storage_options", P.KEYWORD_ONLY, None),
    ]


def test_load_signature():
    assert _shape(ckptstore.load) == [
        ("f", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("map_location", P.POSITIONAL_OR_KEYWORD, None),
        ("weights_only", P.KEYWORD_ONLY, True),
        ("mmap", P.KEYWORD_ONLY, False),
        ("storage_options", P.KEYWORD_ONLY, None),
        ("verify", P.KEYWORD_ONLY, None),
    ]


def test_save_sharded_signature():
    assert _shape(ckptstore.save_sharded) == [
        ("state_dict", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("url", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("process_group", P.KEYWORD_ONLY, None),
        ("storage_options", P.KEYWORD_ONLY, None),
        ("overwrite", P.KEYWORD_ONLY, False),
    ]


def test_load_sharded_signature():
    assert _shape(ckptstore.load_sharded) == [
        ("state_dict", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("url", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("process_group", P.KEYWORD_ONLY, None),
        ("storage_options", P.KEYWORD_ONLY, None),
        ("strict", P.KEYWORD_ONLY, True),
        ("per_rank", P.KEYWORD_ONLY, "error"),
        ("buffer_bytes", P.KEYWORD_ONLY, 256 << 20),
    ]


def test_keyword_only_options_cannot_be_passed_positionally(tmp_path):
    path = tmp_path / "x.ckpt"
    with pytest.raises(TypeError):
        ckptstore.save({}, path, "zstd")  # type: ignore[misc]
    assert not path.exists()
    ckptstore.save({}, path)
    with pytest.raises(TypeError):
        ckptstore.load(path, None, False)  # type: ignore[misc]


def test_checkpoint_store_signature():
    assert _shape(ckptstore.CheckpointStore) == [
        ("job", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("local", P.KEYWORD_ONLY, None),
        ("durable", P.KEYWORD_ONLY, None),
        ("durable_every", P.KEYWORD_ONLY, 10),
        ("keep_local", P.KEYWORD_ONLY, 3),
        ("keep_durable", P.KEYWORD_ONLY, None),
        ("ram_budget_bytes", P.KEYWORD_ONLY, None),
        ("ram_dir", P.KEYWORD_ONLY, "/dev/shm"),
        ("ram_fallback", P.KEYWORD_ONLY, None),
        ("storage_options", P.KEYWORD_ONLY, None),
        ("process_group", P.KEYWORD_ONLY, None),
        ("policy", P.KEYWORD_ONLY, "block"),
        ("durable_compression", P.KEYWORD_ONLY, None),
        ("frozen", P.KEYWORD_ONLY, None),
        ("refresh_every", P.KEYWORD_ONLY, 10),
        ("timeout_s", P.KEYWORD_ONLY, 600.0),
        ("peer_replicas", P.KEYWORD_ONLY, 0),
        ("peer_every", P.KEYWORD_ONLY, 1),
        ("node", P.KEYWORD_ONLY, None),
        ("peer_timeout_s", P.KEYWORD_ONLY, 60.0),
        ("peer_to_local", P.KEYWORD_ONLY, False),
        ("interval", P.KEYWORD_ONLY, None),
        ("mtbf", P.KEYWORD_ONLY, None),
        ("events", P.KEYWORD_ONLY, False),
        ("sdc", P.KEYWORD_ONLY, "off"),
        ("durable_timeout_s", P.KEYWORD_ONLY, None),
        ("tuning", P.KEYWORD_ONLY, None),
        ("agent", P.KEYWORD_ONLY, False),
        ("background_nice", P.KEYWORD_ONLY, 0),
        ("local_every", P.KEYWORD_ONLY, 1),
    ]
    assert [n for n in dir(ckptstore.CheckpointStore) if not n.startswith("_")] == [
        "all_gather", "close", "last_step", "latest_step", "plan", "restore", "save", "should_save", "skipped"]
    assert _shape(ckptstore.CheckpointStore.restore) == [
        ("self", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("state", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("step", P.KEYWORD_ONLY, None),
        ("per_rank", P.KEYWORD_ONLY, "error"),
        ("resume", P.KEYWORD_ONLY, True),
    ]
    assert [n for n in dir(ckptstore.SaveHandle) if not n.startswith("_")] == ["done", "wait"]
