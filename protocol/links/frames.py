"""Wire format for tensors between stage workers over ZeroMQ multipart messages.

A message is one msgpack header frame followed by one raw frame per tensor:

    [header, data_0, data_1, ...]
    header = {"v": 1, "kind": str, "meta": dict,
              "tensors": [{"name": str, "dtype": str, "shape": [int, ...]}, ...]}

Tensor frames are the contiguous CPU buffers themselves, so encoding and decoding copy
nothing beyond what `.contiguous()` / `.cpu()` need. Decoding treats every frame as
untrusted: it validates the whole message before building any tensor and raises only
`FrameError`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from protocol.errors import TreepipeError

VERSION = 1

# Wire name -> torch dtype. The set is closed on purpose: anything else (complex,
# quantised, uint16...) would need a receiver-side contract we do not have.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

_HEADER_KEYS = frozenset({"v", "kind", "meta", "tensors"})
_TENSOR_KEYS = frozenset({"name", "dtype", "shape"})


class FrameError(TreepipeError, ValueError):
    """A message that cannot be encoded or decoded; the text names the problem and the fix."""


@dataclass
class Message:
    """A decoded transport message: its kind, msgpack header fields and tensors."""

    kind: str
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Limits:
    """Upper bounds a receiver enforces before trusting a message."""

    max_header_bytes: int = 64 * 1024
    max_tensor_bytes: int = 256 * 1024 * 1024
    max_tensors: int = 16
    max_dims: int = 4


def _tensor_buffer(t: torch.Tensor) -> memoryview:
    """Expose a tensor's bytes without copying (beyond making it contiguous on CPU)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    # Viewing as uint8 gives raw bytes for every dtype, including bfloat16 and bool,
    # which numpy cannot represent directly. The memoryview keeps the tensor alive.
    return memoryview(flat.view(torch.uint8).numpy())


def encode(
    kind: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> list[bytes | memoryview]:
    """Encode a message as [msgpack header, tensor buffer...] for `send_multipart`."""
    if not isinstance(kind, str):
        raise FrameError(f"kind must be a str, got {type(kind).__name__}; pass a string kind")
    if not isinstance(meta, dict):
        raise FrameError(f"meta must be a dict, got {type(meta).__name__}; pass a dict")
    specs: list[dict[str, Any]] = []
    buffers: list[bytes | memoryview] = []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise FrameError(f"tensor name {name!r} is not a str; use string names")
        if not isinstance(t, torch.Tensor):
            raise FrameError(f"tensor {name!r} is a {type(t).__name__}; pass a torch.Tensor")
        dtype_name = _DTYPE_NAMES.get(t.dtype)
        if dtype_name is None:
            raise FrameError(
                f"tensor {name!r} has unsupported dtype {t.dtype}; "
                f"cast it to one of {sorted(DTYPES)}"
            )
        specs.append({"name": name, "dtype": dtype_name, "shape": list(t.shape)})
        buffers.append(_tensor_buffer(t))
    header = {"v": VERSION, "kind": kind, "meta": meta, "tensors": specs}
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except Exception as e:  # msgpack raises TypeError/ValueError/OverflowError
        raise FrameError(
            f"meta is not msgpack-serialisable ({e}); use only dict/list/str/int/float/bool/None"
        ) from e
    return [packed, *buffers]


def _as_buffer(frame: Any, index: int) -> memoryview:
    """Return a flat byte memoryview over a frame without copying."""
    # zmq.Frame (recv with copy=False) exposes its data through `.buffer`.
    obj = frame.buffer if hasattr(frame, "buffer") else frame
    if not isinstance(obj, bytes | bytearray | memoryview):
        raise FrameError(
            f"frame {index} is a {type(frame).__name__}; pass bytes, memoryview or zmq.Frame"
        )
    try:
        mv = memoryview(obj)
        return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
    except (TypeError, ValueError) as e:
        raise FrameError(
            f"frame {index} is not a contiguous byte buffer ({e}); send raw bytes"
        ) from e


def _frombuffer(buf: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """View a non-empty byte buffer as a 1-D tensor without copying."""
    with warnings.catch_warnings():
        # Received frames are often read-only; the tensor shares that memory and callers
        # must not write into it, which is what torch warns about on every call.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buf, dtype=dtype)


def _no_ext(code: int, data: bytes) -> Any:
    """Reject msgpack extension types: nothing in the format uses them."""
    raise FrameError(f"header uses msgpack ext type {code}; send plain msgpack values only")


def _parse_header(buf: memoryview, limits: Limits) -> dict[str, Any]:
    """Unpack the header frame, turning every msgpack failure into FrameError."""
    if buf.nbytes > limits.max_header_bytes:
        raise FrameError(
            f"header is {buf.nbytes} bytes, over the {limits.max_header_bytes}-byte limit; "
            "shrink meta or raise Limits.max_header_bytes"
        )
    try:
        # Size was bounded above, so unpackb cannot be asked to build a huge object.
        header = msgpack.unpackb(buf, raw=False, strict_map_key=True, ext_hook=_no_ext)
    except FrameError:
        raise
    except Exception as e:  # ExtraData, FormatError, StackError, UnicodeDecodeError, ...
        raise FrameError(
            f"header is not valid msgpack ({type(e).__name__}: {e}); "
            "send the header produced by encode()"
        ) from e
    if not isinstance(header, dict):
        raise FrameError(
            f"header is a {type(header).__name__}, not a map; send the header from encode()"
        )
    keys = set(header)
    if keys != _HEADER_KEYS:
        raise FrameError(
            f"header keys {sorted(map(str, keys))} differ from {sorted(_HEADER_KEYS)}; "
            "send the header produced by encode()"
        )
    return header


def _check_spec(i: int, spec: Any, seen: set[str], limits: Limits) -> tuple[str, str, list[int]]:
    """Validate one tensor entry of the header and return (name, dtype, shape)."""
    if not isinstance(spec, dict) or set(spec) != _TENSOR_KEYS:
        raise FrameError(
            f"tensor entry {i} must be a map with keys {sorted(_TENSOR_KEYS)}; "
            "send the header produced by encode()"
        )
    name, dtype, shape = spec["name"], spec["dtype"], spec["shape"]
    if not isinstance(name, str):
        raise FrameError(f"tensor entry {i} name is not a str; use string tensor names")
    if name in seen:
        raise FrameError(f"tensor name {name!r} appears twice; give each tensor a unique name")
    seen.add(name)
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise FrameError(
            f"tensor {name!r} has unsupported dtype {dtype!r}; use one of {sorted(DTYPES)}"
        )
    if not isinstance(shape, list):
        raise FrameError(f"tensor {name!r} shape is not a list; send a list of ints")
    if len(shape) > limits.max_dims:
        raise FrameError(
            f"tensor {name!r} has {len(shape)} dims, over the limit of {limits.max_dims}; "
            "reshape it or raise Limits.max_dims"
        )
    # bool is an int subclass in Python; reject it so True cannot pose as a dimension.
    if not all(type(d) is int and d >= 0 for d in shape):
        raise FrameError(
            f"tensor {name!r} shape {shape!r} must hold non-negative ints; fix the shape"
        )
    return name, dtype, shape


def decode(
    frames: Sequence[Any],
    limits: Limits = Limits(),  # noqa: B008 - frozen dataclass, safe as a default
    expect_kind: str | None = None,
) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    """Validate and decode [header, tensor buffer...] into (kind, meta, tensors) zero-copy."""
    if isinstance(frames, str | bytes | bytearray | memoryview) or not isinstance(
        frames, Sequence
    ):
        raise FrameError(
            f"frames must be a list of frames, got {type(frames).__name__}; "
            "pass the list from recv_multipart()"
        )
    if len(frames) == 0:
        raise FrameError("message has no frames; send at least the header frame")
    header = _parse_header(_as_buffer(frames[0], 0), limits)

    version, kind, meta, specs = header["v"], header["kind"], header["meta"], header["tensors"]
    if type(version) is not int or version != VERSION:
        raise FrameError(
            f"header version {version!r} is not supported; this decoder speaks v{VERSION}"
        )
    if not isinstance(kind, str):
        raise FrameError(f"header kind {kind!r} is not a str; send a string kind")
    if expect_kind is not None and kind != expect_kind:
        raise FrameError(
            f"message kind {kind!r} where {expect_kind!r} was expected; check the sender's route"
        )
    if not isinstance(meta, dict):
        raise FrameError(f"header meta is a {type(meta).__name__}, not a map; send a dict")
    if not isinstance(specs, list):
        raise FrameError("header tensors is not a list; send the header produced by encode()")
    if len(specs) > limits.max_tensors:
        raise FrameError(
            f"message has {len(specs)} tensors, over the limit of {limits.max_tensors}; "
            "split it or raise Limits.max_tensors"
        )
    n_data = len(frames) - 1
    if len(specs) != n_data:
        raise FrameError(
            f"header lists {len(specs)} tensors but {n_data} data frames follow; "
            "send exactly one frame per tensor"
        )

    # First pass validates everything; tensors are only built once the whole message is sound.
    seen: set[str] = set()
    checked: list[tuple[str, torch.dtype, list[int], memoryview]] = []
    for i, spec in enumerate(specs):
        name, dtype_name, shape = _check_spec(i, spec, seen, limits)
        dtype = DTYPES[dtype_name]
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > limits.max_tensor_bytes:
            raise FrameError(
                f"tensor {name!r} is {nbytes} bytes, over the {limits.max_tensor_bytes}-byte "
                "limit; split it or raise Limits.max_tensor_bytes"
            )
        buf = _as_buffer(frames[i + 1], i + 1)
        if buf.nbytes != nbytes:
            raise FrameError(
                f"tensor {name!r} shape {shape} {dtype_name} needs {nbytes} bytes but its frame "
                f"has {buf.nbytes}; send the buffer matching the declared shape and dtype"
            )
        if dtype is torch.bool and nbytes and bool((_frombuffer(buf, torch.uint8) > 1).any()):
            # Bytes other than 0/1 in a bool tensor give undefined results in torch ops.
            raise FrameError(f"bool tensor {name!r} holds bytes other than 0/1; send 0/1 bytes")
        checked.append((name, dtype, shape, buf))

    tensors: dict[str, torch.Tensor] = {}
    for name, dtype, shape, buf in checked:
        if buf.nbytes == 0:
            # torch.frombuffer rejects empty buffers; an empty tensor owns no data anyway.
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        tensors[name] = _frombuffer(buf, dtype).reshape(shape)
    return kind, meta, tensors
