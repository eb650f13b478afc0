"""Tests for the ZeroMQ tensor wire format in protocol/links/frames.py."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest
import torch
import zmq

from protocol.links.frames import DTYPES, FrameError, Limits, decode, encode


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Make a tensor of `dtype` with varied values."""
    if dtype is torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, shape, dtype=dtype)


def _header(**overrides: Any) -> dict[str, Any]:
    """A valid header with one float32 [2, 3] tensor, fields overridable."""
    h: dict[str, Any] = {
        "v": 1,
        "kind": "act",
        "meta": {"step": 3},
        "tensors": [{"name": "x", "dtype": "float32", "shape": [2, 3]}],
    }
    h.update(overrides)
    return h


def _frames(header: Any, *data: bytes) -> list[bytes]:
    """Pack a raw header (possibly invalid) followed by data frames."""
    return [msgpack.packb(header, use_bin_type=True), *data]


X_BYTES = bytes(24)  # float32 [2, 3]


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_round_trip_every_dtype(name: str) -> None:
    """Every allowed dtype survives encode/decode with equal values and shape."""
    dtype = DTYPES[name]
    t = _sample(dtype, (3, 4, 5))
    kind, meta, out = decode(encode("act", {"id": 7, "s": "x"}, {"h": t}))
    assert (kind, meta) == ("act", {"id": 7, "s": "x"})
    assert out["h"].dtype == dtype and out["h"].shape == t.shape
    assert torch.equal(out["h"], t)


def test_round_trip_zero_sized_scalar_noncontiguous_and_empty() -> None:
    """Zero-sized, 0-d and non-contiguous tensors round trip; so does a tensor-less message."""
    base = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    tensors = {
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "transposed": base.t(),
    }
    _, _, out = decode(encode("k", {}, tensors))
    for key, t in tensors.items():
        assert out[key].shape == t.shape and out[key].dtype == t.dtype
        assert torch.equal(out[key], t)
    assert decode(encode("ping", {"a": [1, 2]}, {})) == ("ping", {"a": [1, 2]}, {})


def test_encode_is_zero_copy_for_contiguous_cpu() -> None:
    """A contiguous CPU tensor's frame aliases its storage."""
    t = torch.arange(6, dtype=torch.float32)
    frame = encode("k", {}, {"t": t})[1]
    t[0] = 42.0
    assert torch.frombuffer(bytearray(frame), dtype=torch.float32)[0] == 42.0


def test_decode_over_zmq_push_pull() -> None:
    """Frames received with copy=False over a real PUSH/PULL pair decode to equal tensors."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    try:
        for s in (pull, push):
            s.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.RCVTIMEO, 5000)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        tensors = {n: _sample(d, (4, 33)) for n, d in DTYPES.items()}
        push.send_multipart(encode("act", {"seq": 1}, tensors), copy=False)
        received = pull.recv_multipart(copy=False)
        kind, meta, out = decode(received, expect_kind="act")
        assert (kind, meta) == ("act", {"seq": 1})
        assert out.keys() == tensors.keys()
        for n, t in tensors.items():
            assert out[n].dtype == t.dtype and torch.equal(out[n], t)
    finally:
        push.close()
        pull.close()
        ctx.term()


@pytest.mark.parametrize(
    ("frames", "limits", "expect_kind", "match"),
    [
        pytest.param([b"\xc1\xff\x00"], Limits(), None, "not valid msgpack", id="garbage"),
        pytest.param(_frames([1, 2]), Limits(), None, "not a map", id="not-map"),
        pytest.param(_frames({**_header(), "x": 1}, X_BYTES), Limits(), None, "keys",
                     id="unknown-key"),
        pytest.param(_frames(_header(v=2), X_BYTES), Limits(), None, "version", id="version"),
        pytest.param(_frames(_header(v=True), X_BYTES), Limits(), None, "version",
                     id="version-bool"),
        pytest.param(_frames(_header(), X_BYTES), Limits(), "logits", "expected", id="kind"),
        pytest.param(_frames(_header(kind=5), X_BYTES), Limits(), None, "kind", id="kind-type"),
        pytest.param(_frames(_header(meta=[1]), X_BYTES), Limits(), None, "meta", id="meta"),
        pytest.param(
            _frames(_header(tensors=[{"name": "x", "dtype": "complex64", "shape": [2, 3]}]),
                    X_BYTES),
            Limits(), None, "dtype", id="bad-dtype"),
        pytest.param(
            _frames(_header(tensors=[{"name": "x", "dtype": "float32", "shape": [-2, -3]}]),
                    X_BYTES),
            Limits(), None, "non-negative", id="negative-dim"),
        pytest.param(
            _frames(_header(tensors=[{"name": "x", "dtype": "float32", "shape": [1] * 5}]),
                    bytes(4)),
            Limits(), None, "dims", id="too-many-dims"),
        pytest.param(_frames(_header(), bytes(20)), Limits(), None, "needs 24 bytes",
                     id="length-mismatch"),
        pytest.param(_frames(_header()), Limits(), None, "data frames", id="missing-frame"),
        pytest.param(_frames(_header(), X_BYTES, b"x"), Limits(), None, "data frames",
                     id="extra-frame"),
        pytest.param(_frames(_header(meta={"pad": "a" * 200}), X_BYTES),
                     Limits(max_header_bytes=128), None, "header is", id="oversized-header"),
        pytest.param(_frames(_header(), X_BYTES), Limits(max_tensor_bytes=16), None,
                     "over the 16-byte", id="oversized-tensor"),
        pytest.param(
            _frames(_header(tensors=[{"name": "x", "dtype": "float32", "shape": [2, 3]}] * 2),
                    X_BYTES, X_BYTES),
            Limits(), None, "twice", id="duplicate-names"),
        pytest.param(_frames(_header(tensors=[])), Limits(max_tensors=0), "nope",
                     "expected", id="kind-no-tensors"),
        pytest.param(
            _frames(_header(tensors=[{"name": "b", "dtype": "bool", "shape": [2]}]), b"\x01\x07"),
            Limits(), None, "0/1", id="bool-bytes"),
        pytest.param([], Limits(), None, "no frames", id="no-frames"),
        pytest.param([_frames(_header())[0], 3], Limits(), None, "frame 1", id="frame-type"),
    ],
)
def test_malformed_raises_frame_error(
    frames: list[Any], limits: Limits, expect_kind: str | None, match: str
) -> None:
    """Each malformed message raises FrameError naming the problem and a fix."""
    with pytest.raises(FrameError, match=match) as info:
        decode(frames, limits, expect_kind)
    msg = str(info.value)
    assert "\n" not in msg and ";" in msg  # one line: problem; fix


def test_encode_rejects_unsupported_dtype_and_meta() -> None:
    """encode reports unsupported dtypes and unserialisable meta as FrameError."""
    with pytest.raises(FrameError, match="dtype"):
        encode("k", {}, {"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(FrameError, match="msgpack"):
        encode("k", {"o": object()}, {})


def test_random_header_mutations_only_raise_frame_error() -> None:
    """Random byte mutations of a valid header either decode or raise FrameError, nothing else."""
    rng = random.Random(1234)
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    header, data = encode("act", {"step": 3, "ids": [1, 2, 3], "name": "s0"}, {"x": t})
    header = bytes(header)
    outcomes = {"ok": 0, "error": 0}
    for _ in range(200):
        buf = bytearray(header)
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            pos = rng.randrange(len(buf) + 1)
            if op < 0.6 and buf:
                buf[min(pos, len(buf) - 1)] = rng.randrange(256)
            elif op < 0.8:
                buf.insert(pos, rng.randrange(256))
            elif buf:
                del buf[min(pos, len(buf) - 1)]
        try:
            decode([bytes(buf), data])
            outcomes["ok"] += 1
        except FrameError:
            outcomes["error"] += 1
    assert outcomes["error"] > 0
