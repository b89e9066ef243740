"""What torch.save/torch.load users meet when ckptstore.save/ckptstore.load replace them (issue 21).

Each test holds one behaviour of torch's to ckptstore: streams without ``seekable()`` and unseekable
ones (real pipes and sockets), tensors' Python attributes, TorchScript archives, torch's refusal
text, unpickling failures that are not damage, MAP_SHARED mappings, and the error classes that
handlers written for torch catch. Everything runs against real files, pipes and sockets.
"""

from __future__ import annotations

import functools
import http.server
import io
import mmap
import os
import pickle
import socket
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstore
from ckptstore import errors
from ckptstore.format import container


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b


STATE = {"w": torch.randn(64, 32), "big": torch.arange(300_000, dtype=torch.int64), "step": 3, "name": "run"}


# --- 1. file objects torch.load accepts, and unseekable streams --------------------------------


class NoSeekableMethod:
    """A file object with read/readinto/seek/tell/write/flush and no seekable(): torch.load takes it."""

    def __init__(self) -> None:
        self._f = io.BytesIO()

    def read(self, n: int = -1) -> bytes:
        return self._f.read(n)

    def readinto(self, b: Any) -> int:
        return self._f.readinto(b)

    def seek(self, pos: int, whence: int = 0) -> int:
        return self._f.seek(pos, whence)

    def tell(self) -> int:
        return self._f.tell()

    def write(self, b: Any) -> int:
        return self._f.write(b)

    def flush(self) -> None:
        pass


def test_file_object_without_seekable_method_loads_and_keeps_its_position() -> None:
    f = NoSeekableMethod()
    ckptstore.save(STATE, f)
    ckptstore.save({"second": torch.ones(3)}, f)  # a second checkpoint after the first, as in one stream
    f.seek(0)
    _same(ckptstore.load(f), STATE)
    _same(ckptstore.load(f), {"second": torch.ones(3)})
    # and torch.load takes the same object, for its own files
    g = NoSeekableMethod()
    torch.save(STATE, g)
    g.seek(0)
    _same(ckptstore.load(g), STATE)


def _through_pipe(write: Any) -> tuple[int, threading.Thread]:
    r, w = os.pipe()

    def writer() -> None:
        with open(w, "wb") as f:
            write(f)

    thread = threading.Thread(target=writer)
    thread.start()
    return r, thread


@pytest.mark.parametrize("writer", ["ckptstore", "torch"])
def test_pipe_is_read_once_front_to_back(writer: str) -> None:
    save = ckptstore.save if writer == "ckptstore" else torch.save
    r, thread = _through_pipe(lambda f: save(STATE, f))
    try:
        with open(r, "rb") as f:
            assert not f.seekable()
            _same(ckptstore.load(f), STATE)
    finally:
        thread.join()


def test_socket_carries_several_checkpoints_back_to_back() -> None:
    one, two = io.BytesIO(), io.BytesIO()
    ckptstore.save(STATE, one)  # seekable: the header states the container's length
    ckptstore.save({"k": torch.zeros(2, 2), "step": 4}, two)
    a, b = socket.socketpair()
    payload = one.getvalue() + two.getvalue()
    thread = threading.Thread(target=lambda: (a.sendall(payload), a.close()))
    thread.start()
    try:
        with b, b.makefile("rb") as f:
            _same(ckptstore.load(f), STATE)
            _same(ckptstore.load(f), {"k": torch.zeros(2, 2), "step": 4})
            assert f.read() == b""
    finally:
        thread.join()


def test_truncated_stream_is_damage_not_a_hang() -> None:
    buf = io.BytesIO()
    ckptstore.save(STATE, buf)
    data = buf.getvalue()[:-100]
    r, thread = _through_pipe(lambda f: f.write(data))
    try:
        with open(r, "rb") as f, pytest.raises(ckptstore.CorruptCheckpointError, match="truncated"):
            ckptstore.load(f)
    finally:
        thread.join()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


def test_http_response_body_loads(tmp_path: Path) -> None:
    ckptstore.save(STATE, tmp_path / "a.ckpt")
    torch.save(STATE, tmp_path / "a.pt")
    handler = functools.partial(_Quiet, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        for name in ("a.ckpt", "a.pt"):
            with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/{name}") as body:
                assert not body.seekable()
                _same(ckptstore.load(body), STATE)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class ReadOnly:
    """A stream with read() alone (no readinto, seek or tell) that hands out a few bytes at a time."""

    def __init__(self, data: bytes) -> None:
        self._f = io.BytesIO(data)

    def read(self, n: int = -1) -> bytes:
        return self._f.read(min(n, 1000) if n >= 0 else 1000)


def test_stream_with_read_alone_and_short_reads() -> None:
    buf = io.BytesIO()
    ckptstore.save(STATE, buf)
    _same(ckptstore.load(ReadOnly(buf.getvalue())), STATE)


def test_stream_header_claiming_a_huge_length_sizes_no_buffer() -> None:
    buf = io.BytesIO()
    ckptstore.save({"x": torch.ones(2)}, buf)
    data = bytearray(buf.getvalue())
    data[16:24] = (1 << 60).to_bytes(8, "little")  # the header's container length
    with pytest.raises(ckptstore.CorruptCheckpointError, match="truncated"):
        ckptstore.load(ReadOnly(bytes(data)))


# --- 2. Python attributes on tensors and Parameters ---------------------------------------------


def test_tensor_attributes_come_back(tmp_path: Path) -> None:
    t = torch.arange(4.0)
    t.foo = "foo"
    t.me = t
    p = torch.nn.Parameter(torch.ones(2))
    p.bar = {"a": 1, "w": torch.zeros(1)}
    shared = torch.arange(6.0)
    view = shared[2:]
    view.tag = (1, 2.5)
    ckptstore.save({"t": t, "p": p, "again": t, "shared": shared, "view": view}, tmp_path / "a.ckpt")
    got = ckptstore.load(tmp_path / "a.ckpt")
    assert got["t"].foo == "foo" and got["t"].me is got["t"] and got["again"] is got["t"]
    assert type(got["p"]) is torch.nn.Parameter and got["p"].bar["a"] == 1 and torch.equal(got["p"].bar["w"], torch.zeros(1))
    assert got["view"].tag == (1, 2.5) and got["view"].untyped_storage().data_ptr() == got["shared"].untyped_storage().data_ptr()
    assert vars(got["shared"]) == {}
    plain, param = torch.ones(1), torch.nn.Parameter(torch.ones(1))
    plain.foo, param.bar = "foo", {"a": 1}
    torch.save({"t": plain, "p": param}, tmp_path / "a.pt")  # torch gives them back too
    ref = torch.load(tmp_path / "a.pt")
    assert (ref["t"].foo, ref["p"].bar) == (got["t"].foo, {"a": 1})


class Opaque:
    pass


def test_attribute_ckptstore_cannot_store_is_refused_by_name(tmp_path: Path) -> None:
    t = torch.ones(2)
    t.helper = Opaque()
    with pytest.raises(ckptstore.UnsupportedObjectError, match=r"obj\['w'\]\.helper"):
        ckptstore.save({"w": t}, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()
    ckptstore.save({"w": t}, tmp_path / "b.ckpt", allow_pickle=True)
    assert isinstance(ckptstore.load(tmp_path / "b.ckpt", weights_only=False)["w"].helper, Opaque)


def test_attributes_need_format_1_2_and_only_then(tmp_path: Path) -> None:
    plain, attributed = io.BytesIO(), io.BytesIO()
    t = torch.ones(1)
    ckptstore.save(t, plain)
    t.x = 1
    ckptstore.save(t, attributed)
    assert container.HEADER.unpack_from(plain.getvalue())[1:3] == (1, 1)
    assert container.HEADER.unpack_from(attributed.getvalue())[1:3] == (1, 2)
    assert b'"format_version":"1.2"' in attributed.getvalue() and b'"$attrs"' in attributed.getvalue()


# --- 3. TorchScript archives ------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")
def test_torchscript_archive_is_named_not_called_damaged(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.jit.script(torch.nn.Linear(2, 2)).save(str(path))
    with pytest.raises(ckptstore.PickleNotAllowedError, match="TorchScript archive") as info:
        ckptstore.load(path)
    assert isinstance(info.value, RuntimeError)  # what torch.load raises for it
    assert "torch.jit.load" in str(info.value) and "weights_only=False" in str(info.value)
    with pytest.warns(UserWarning, match="TorchScript"):
        module = ckptstore.load(path, weights_only=False)
    assert isinstance(module, torch.jit.ScriptModule)


# --- 4. torch's whole reason for refusing a pickle ---------------------------------------------


class NotAllowed:
    pass


def test_torch_refusal_keeps_the_blocked_global_and_the_hint(tmp_path: Path) -> None:
    torch.save({"x": NotAllowed()}, tmp_path / "c.pt")
    with pytest.raises(ckptstore.PickleNotAllowedError) as info:
        ckptstore.load(tmp_path / "c.pt")
    text = str(info.value)
    assert f"{__name__}.NotAllowed" in text and "add_safe_globals" in text
    assert isinstance(info.value.__cause__, pickle.UnpicklingError)


def test_weights_only_none_means_true_as_in_torch(tmp_path: Path) -> None:
    ckptstore.save({"x": NotAllowed()}, tmp_path / "p.ckpt", allow_pickle=True)
    torch.save({"x": NotAllowed()}, tmp_path / "p.pt")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "p.pt", weights_only=None)
    for name in ("p.ckpt", "p.pt"):
        with pytest.raises(ckptstore.PickleNotAllowedError):
            ckptstore.load(tmp_path / name, weights_only=None)


# --- 5. what torch itself cannot unpickle -----------------------------------------------------


def test_bare_storage_is_refused_at_save_even_with_allow_pickle(tmp_path: Path) -> None:
    storage = torch.ones(2).untyped_storage()
    for allow in (False, True):
        with pytest.raises(ckptstore.UnsupportedObjectError, match="bare torch.storage.UntypedStorage"):
            ckptstore.save({"s": storage}, tmp_path / "s.ckpt", allow_pickle=allow)
    # the way out the message gives works
    ckptstore.save({"s": torch.empty(0, dtype=torch.uint8).set_(storage)}, tmp_path / "s.ckpt")
    assert ckptstore.load(tmp_path / "s.ckpt")["s"].untyped_storage().nbytes() == storage.nbytes()


class PickledStorage:
    """Unpickles through torch's own pickle.loads of a storage, which fails in torch itself: what
    a file saved with allow_pickle=True holding a bare UntypedStorage (before it was refused) holds."""

    def __reduce__(self) -> Any:
        return (pickle.loads, (pickle.dumps(torch.ones(2).untyped_storage()),))


def test_unpickling_failure_in_a_sound_file_is_not_damage(tmp_path: Path) -> None:
    ckptstore.save({"s": PickledStorage()}, tmp_path / "s.ckpt", allow_pickle=True)
    with pytest.raises(ckptstore.CheckpointError, match="intact") as info:
        ckptstore.load(tmp_path / "s.ckpt", weights_only=False)
    assert not isinstance(info.value, ckptstore.CorruptCheckpointError)
    assert isinstance(info.value, AttributeError)  # torch's own failure, as torch.load would raise it
    assert isinstance(info.value.__cause__, AttributeError)


def test_zero_tensor_is_refused_clearly(tmp_path: Path) -> None:
    z = torch._efficientzerotensor(3)
    for allow in (False, True):
        with pytest.raises(ckptstore.UnsupportedObjectError, match=r"obj\['z'\] is a ZeroTensor") as info:
            ckptstore.save({"z": z}, tmp_path / "z.ckpt", allow_pickle=allow)
        assert isinstance(info.value, RuntimeError)  # torch.save raises RuntimeError for it


# --- 6. set_default_mmap_options(MAP_SHARED) ---------------------------------------------------


@pytest.fixture
def map_shared():
    torch.serialization.set_default_mmap_options(mmap.MAP_SHARED)
    try:
        yield
    finally:
        torch.serialization.set_default_mmap_options(mmap.MAP_PRIVATE)


def test_map_shared_writes_reach_the_file(tmp_path: Path, map_shared: None) -> None:
    path = tmp_path / "m.ckpt"
    ckptstore.save({"x": torch.zeros(4), "small": torch.zeros(3, dtype=torch.int32)}, path)
    got = ckptstore.load(path, mmap=True)
    got["x"] += 1
    got["small"][1] = 7
    del got
    torch.serialization.set_default_mmap_options(mmap.MAP_PRIVATE)
    again = ckptstore.load(path, verify=False)
    assert torch.equal(again["x"], torch.ones(4)) and again["small"].tolist() == [0, 7, 0]


def test_private_mapping_stays_private(tmp_path: Path) -> None:
    path = tmp_path / "m.ckpt"
    ckptstore.save({"x": torch.zeros(4)}, path)
    got = ckptstore.load(path, mmap=True)
    got["x"] += 1
    del got
    assert torch.equal(ckptstore.load(path)["x"], torch.zeros(4))


def test_map_shared_refuses_what_it_cannot_map(tmp_path: Path, map_shared: None) -> None:
    path = tmp_path / "z.ckpt"
    ckptstore.save({"x": torch.zeros(1000)}, path, compression="zstd")
    with pytest.raises(ckptstore.InvalidArgumentError, match="MAP_SHARED.*'x'"):
        ckptstore.load(path, mmap=True)


# --- 7. error classes handlers written for torch catch ----------------------------------------


def _raised(fn: Any) -> BaseException:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the class is what the test compares
        return exc
    raise AssertionError("nothing was raised")


def _with_open(path: Path, mode: str, fn: Any) -> Any:
    with open(path, mode) as f:
        return fn(f)


def _misuses(tmp: Path) -> dict[str, tuple[Any, Any]]:
    """misuse -> (torch's call, ckptstore's call): the same mistake made with each."""
    torch.save({"a": torch.ones(1)}, tmp / "t.pt")
    ckptstore.save({"a": torch.ones(1)}, tmp / "c.ckpt")
    (tmp / "empty").write_bytes(b"")
    (tmp / "dir").mkdir()
    lam = lambda: 1  # noqa: E731 - a local object pickle cannot store
    return {
        "save to a tensor": (lambda: torch.save({}, torch.ones(1)), lambda: ckptstore.save({}, torch.ones(1))),
        "load from an int": (lambda: torch.load(3), lambda: ckptstore.load(3)),
        "load from None": (lambda: torch.load(None), lambda: ckptstore.load(None)),
        "load a directory": (lambda: torch.load(tmp / "dir"), lambda: ckptstore.load(tmp / "dir")),
        "load an empty file": (lambda: torch.load(tmp / "empty"), lambda: ckptstore.load(tmp / "empty")),
        "map_location of a wrong kind (torch file)": (
            lambda: torch.load(tmp / "t.pt", map_location=3), lambda: ckptstore.load(tmp / "t.pt", map_location=3)),
        "map_location of a wrong kind (ckptstore file)": (
            lambda: torch.load(tmp / "t.pt", map_location=3), lambda: ckptstore.load(tmp / "c.ckpt", map_location=3)),
        "load from a write-only file": (
            lambda: _with_open(tmp / "w1", "wb", torch.load), lambda: _with_open(tmp / "w2", "wb", ckptstore.load)),
        "save to a read-only file": (
            lambda: _with_open(tmp / "t.pt", "rb", lambda f: torch.save({}, f)),
            lambda: _with_open(tmp / "c.ckpt", "rb", lambda f: ckptstore.save({}, f))),
        "save to a directory": (lambda: torch.save({}, tmp / "dir"), lambda: ckptstore.save({}, tmp / "dir")),
        "save into a missing directory": (
            lambda: torch.save({}, tmp / "no" / "x"), lambda: ckptstore.save({}, tmp / "no" / "x")),
        "save an unpicklable object with pickle allowed": (
            lambda: torch.save({"f": lam}, tmp / "l.pt"), lambda: ckptstore.save({"f": lam}, tmp / "l.ckpt", allow_pickle=True)),
    }


MISUSE_IDS = [
    "save to a tensor", "load from an int", "load from None", "load a directory", "load an empty file",
    "map_location of a wrong kind (torch file)", "map_location of a wrong kind (ckptstore file)",
    "load from a write-only file", "save to a read-only file", "save to a directory",
    "save into a missing directory", "save an unpicklable object with pickle allowed",
]


@pytest.mark.parametrize("misuse", MISUSE_IDS)
def test_error_is_also_of_torchs_class(tmp_path: Path, misuse: str) -> None:
    torch_call, ours = _misuses(tmp_path)[misuse]
    theirs = _raised(torch_call)
    mine = _raised(ours)
    assert isinstance(mine, ckptstore.CheckpointError), mine
    assert isinstance(mine, type(theirs)), (type(theirs), type(mine).__mro__, mine)
    assert type(mine).__name__.endswith("Error") and type(mine).__module__ == "ckptstore.errors"
    again = pickle.loads(pickle.dumps(mine))  # errors cross process boundaries (workers, ranks)
    assert type(again) is type(mine) and str(again) == str(mine)
    assert getattr(again, "errno", None) == getattr(mine, "errno", None)


class Exacting(Exception):
    """An exception whose constructor wants two arguments, raised by an object's own unpickling."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(a, b)


def _fail(*_: Any) -> None:
    raise Exacting("moved", "away")


class FailsToUnpickle:
    def __reduce__(self) -> Any:
        return (_fail, ())


def test_unpickling_failure_of_any_class_still_reports(tmp_path: Path) -> None:
    ckptstore.save({"x": FailsToUnpickle()}, tmp_path / "x.ckpt", allow_pickle=True)
    with pytest.raises(ckptstore.CheckpointError, match="intact") as info:
        ckptstore.load(tmp_path / "x.ckpt", weights_only=False)
    assert isinstance(info.value.__cause__, Exacting)
    for kind in (UnicodeDecodeError, ckptstore.InvalidArgumentError, KeyError):
        err = errors.also(ckptstore.CheckpointError, kind)("a message")
        assert isinstance(err, ckptstore.CheckpointError) and str(err) in ("a message", "'a message'")
