"""Reading and writing the safetensors format without the ``safetensors`` package.

Why not the package: the plugin reads Hugging Face weights in every training run that
fine-tunes from them, and the format is small enough to own (8-byte little-endian header
length, a JSON header ``{name: {dtype, shape, data_offsets}}`` plus optional ``__metadata__``,
then the raw little-endian bytes; read and written as they are, so on little-endian hosts,
x86-64 and ARM). Reading memory-maps the file: a tensor is a view of its
pages, read from disk only when copied (the plugin broadcasts one tensor at a time), so a
multi-GB checkpoint costs no memory up front. The tests check both directions against the
real ``safetensors`` package and ``transformers`` (test-only requirements).
"""
from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import struct
import tempfile
from typing import Iterable, Optional

import torch

from ..errors import CheckpointError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the format's own limit (100 MB)


class SafetensorsFile:
    """One ``.safetensors`` file, memory-mapped copy-on-write (never written back)."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                prefix = f.read(8)
                length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
                if not 0 < length <= min(_MAX_HEADER, size - 8):
                    raise ValueError("no safetensors header")
                header = json.loads(f.read(length))
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"cannot read {path}: not a safetensors file ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._start = 8 + length
        self._entries = header
        for name, info in header.items():
            begin, end = info.get("data_offsets", (0, -1))
            if info.get("dtype") not in DTYPES or not 0 <= begin <= end <= size - self._start:
                raise CheckpointError(f"cannot read {path}: tensor {name} has a bad dtype or "
                                      f"lies outside the file (truncated?)")
            numel = 1
            for dim in info["shape"]:
                numel *= dim
            if numel * DTYPES[info["dtype"]].itemsize != end - begin:
                raise CheckpointError(f"cannot read {path}: tensor {name} has "
                                      f"{end - begin} bytes for shape {info['shape']}")

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def tensor(self, name: str) -> torch.Tensor:
        """A view of the tensor's bytes in the mapped file (no copy)."""
        info = self._entries[name]
        dtype, shape = DTYPES[info["dtype"]], tuple(info["shape"])
        begin, end = info["data_offsets"]
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(self._map, dtype=torch.uint8, count=end - begin,
                                offset=self._start + begin)
        if (self._start + begin) % dtype.itemsize:  # the format does not promise alignment
            flat = flat.clone()
        return flat.view(dtype).view(shape)


def write(path: str, tensors: Iterable[tuple[str, torch.Tensor]],
          metadata: Optional[dict[str, str]] = None) -> None:
    """Write (name, tensor) pairs to ``path`` (through ``path.tmp`` and a rename). The tensors
    are listed twice: once for the header (shapes only), once to write their bytes."""
    tensors = list(tensors)
    header, offset = {}, 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as the reference writer does
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, t in tensors:
            f.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
    os.replace(tmp, path)


@contextlib.contextmanager
def new_directory(out: str):
    """A model directory written whole or not at all: the body writes into a temporary
    directory beside ``out`` (yielded), renamed to ``out`` (absent or empty) at its end;
    removed if the body fails."""
    parent = os.path.dirname(os.path.abspath(out))
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    try:
        yield tmp
        if os.path.isdir(out):
            os.rmdir(out)
        os.replace(tmp, out)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
