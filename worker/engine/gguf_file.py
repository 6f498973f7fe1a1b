"""Open a GGUF file: its metadata as plain Python values, its weights read in place.

Weight matrices stay in the file's block format (``weight``: a view of the memory-mapped file,
nothing copied); small tensors such as norms are read as float32 (``tensor``).

The header (metadata and tensor table) is read here with ``struct``: the ``gguf`` package's
reader builds numpy views for every string of a vocabulary, which takes over ten seconds for a
150k-token one, where a plain scan takes a fraction of a second. Tensor types, their block
sizes and every dequantization come from the ``gguf`` package.

Everything that can go wrong with a file (missing, truncated, not GGUF, a tensor type the
``gguf`` package cannot decode, a tensor of the wrong shape) surfaces here as a
``ModelLoadError`` naming the file and the culprit, never as a numpy traceback later.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import mmap
import os
import struct
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, quants

from shared.errors import ModelLoadError
from shared.gguf_names import split_part_paths
from shared.tokenizer_spec import PackedStrings, character_starts, cut_between_characters
from worker.engine import q2_0

if TYPE_CHECKING:
    from worker.engine.weights import Weight

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
HEAD_NAMES = ("token_embd.weight", "output.weight")  # the embedding and the head (tied to it or its own)
# A split model's parts (shared/gguf_names.py names them): the first holds the metadata, every
# part some tensors, and each says which part it is
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"

# Types read directly as numpy dtypes (no block quantization).
_PLAIN_TYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


def _decodable_types() -> set[GGMLQuantizationType]:
    """Block-quantized types the installed ``gguf`` package has a numpy dequantizer for."""
    return {q for q in GGMLQuantizationType
            if q not in _PLAIN_TYPES and isinstance(getattr(quants, q.name, None), type)}


DECODABLE_TYPES = _decodable_types() | set(_PLAIN_TYPES)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: outermost first, e.g. (n_out, n_in) for a weight
    type_id: int
    offset: int  # from the start of its file's data section
    q2_0_block: int = 0  # Q2_0's weights per block in this file (q2_0.py), 0 for other types
    part: int = 0  # the file of a split model that holds it (0: the first, or the only one)

    @property
    def type_name(self) -> str:
        if self.type_id == q2_0.TYPE_ID:
            return "Q2_0"
        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"type id {self.type_id}"

    @property
    def n_values(self) -> int:
        return math.prod(self.shape)  # Python ints: a crafted shape must not wrap around to a small count

    @property
    def n_bytes(self) -> int:
        if self.type_id == q2_0.TYPE_ID:
            return q2_0.n_bytes(self.n_values, self.shape[-1], self.q2_0_block or 64) or 0
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.type_id)]
        return self.n_values // block * size


class NestedArrayError(ValueError):
    """A metadata array whose items are arrays."""


def _whole_characters(blob: bytes, ends: array) -> bool:
    """Whether every string of a packed run is UTF-8 by itself: the run is, and no string
    starts inside a character."""
    try:
        blob.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return cut_between_characters(character_starts(blob), ends)


class HeaderCursor:
    """A cursor over the header bytes; every read is bounds-checked by ``struct``."""

    def __init__(self, data: mmap.mmap):
        self.data = data
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        if self.pos + length > len(self.data):
            raise struct.error("string runs past the end of the file")
        raw = self.data[self.pos:self.pos + length]
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> PackedStrings:
        """``count`` strings in a row (a vocabulary), kept packed: no string object per item.
        The loop only walks the lengths; the bytes are gathered and checked as UTF-8 at once
        (and only where that finds a string that is not UTF-8, each is read alone, its bad bytes
        as U+FFFD)."""
        data, first = self.data, self.pos
        end = len(data)
        unpack = struct.Struct("<Q").unpack_from
        starts = array("q")
        pos = first
        for _ in range(count):
            (length,) = unpack(data, pos)
            starts.append(pos + 8)
            pos += 8 + length
            if pos > end:
                raise struct.error("string runs past the end of the file")
        self.pos = pos
        region = np.frombuffer(data, dtype=np.uint8, count=pos - first, offset=first)
        keep = np.ones(len(region), dtype=bool)
        heads = np.frombuffer(starts, dtype=np.int64) - first
        keep[(heads[:, None] - np.arange(8, 0, -1)).ravel()] = False  # the 8-byte lengths
        blob = region[keep].tobytes()
        del region  # the mapping may close once no array looks at it
        lengths = np.diff(np.append(heads, len(keep) + 8)) - 8
        ends = array("I", np.cumsum(lengths).astype(np.uint32).tobytes()) if count else array("I")
        return PackedStrings(blob, ends) if _whole_characters(blob, ends) else self._strings_one_by_one(first, count)

    def _strings_one_by_one(self, first: int, count: int) -> PackedStrings:
        data, pos = self.data, first
        blob, ends = bytearray(), array("I")
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (length,) = unpack(data, pos)
            raw = data[pos + 8:pos + 8 + length]
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                raw = raw.decode("utf-8", errors="replace").encode("utf-8")
            blob += raw
            ends.append(len(blob))
            pos += 8 + length
        return PackedStrings(bytes(blob), ends)

    def value(self, type_id: int) -> Any:
        kind = GGUFValueType(type_id)
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item_kind = GGUFValueType(self.scalar("<I"))
            count = self.scalar("<Q")
            if item_kind == GGUFValueType.STRING:
                return self.strings(count)
            if item_kind == GGUFValueType.ARRAY:  # no model needs one, and llama.cpp's reader refuses them
                raise NestedArrayError("an array of arrays")
            fmt = _SCALAR_FORMATS[item_kind]
            size = struct.calcsize(fmt) * count
            if self.pos + size > len(self.data):
                raise struct.error("array runs past the end of the file")
            items = np.frombuffer(self.data, dtype=np.dtype(fmt), count=count, offset=self.pos).tolist()
            self.pos += size
            return items
        return self.scalar(_SCALAR_FORMATS[kind])


@dataclass
class GGUFPart:
    """One file of a model: the whole of it, or one part of a split model."""

    path: str
    map: mmap.mmap
    metadata: dict[str, Any]  # a split model's later parts hold only their split.* keys
    tensors: dict[str, TensorInfo]  # offsets from this file's data section
    data_start: int


class GGUFFile:
    """A GGUF model opened for reading, from one file or from the parts of a split model (its
    first part named): the metadata of the first part, the tensors of every part. Tensors are
    dequantized on request."""

    def __init__(self, path: str | os.PathLike, on_progress: Callable[[int, int], None] | None = None):
        self.path = os.fspath(path)
        # on_progress(bytes of the tensors taken so far, bytes in all tensors) lets a caller show
        # how far along a load is
        self.on_progress = on_progress
        self._read: set[str] = set()
        # weights held as float32 because no kernel serves their type: name -> type name
        self.dense_fallbacks: dict[str, str] = {}
        self.bytes_read = 0
        first = _open_part(self.path, 0)
        self.metadata = first.metadata
        self._parts = [first, *self._later_parts(first)]
        self._tensors: dict[str, TensorInfo] = {}
        self._matrix_weights: dict | None = None
        for part in self._parts:
            for name, info in part.tensors.items():
                if name in self._tensors:
                    raise ModelLoadError(f"tensor {name!r} is in two parts of {self.path}: {self._parts[0].path} "
                                         f"and {part.path}")
                self._tensors[name] = info

    def _later_parts(self, first: GGUFPart) -> list[GGUFPart]:
        """The other parts of a split model (none for a whole file), each checked to be the part
        its name says, of the same split."""
        count = int(first.metadata.get(SPLIT_COUNT, 1) or 1)
        if count == 1:
            return []
        number = int(first.metadata.get(SPLIT_NO, 0))
        if number != 0:
            raise ModelLoadError(f"{self.path} is part {number + 1} of a split model of {count}: name its first "
                                 "part, …-00001-of-…gguf, and the others are read beside it")
        later = split_part_paths(self.path, count)[1:]
        missing = [os.path.basename(path) for path in later if not os.path.isfile(path)]
        if missing:
            raise ModelLoadError(f"{self.path} is the first of {count} parts of a split model; missing beside it: "
                                 f"{', '.join(missing)}")
        parts = [_open_part(path, index) for index, path in enumerate(later, 1)]
        for index, part in enumerate(parts, 1):
            said = (part.metadata.get(SPLIT_NO), part.metadata.get(SPLIT_COUNT))
            if said != (index, count):
                raise ModelLoadError(f"{part.path} should be part {index + 1} of {count} of {self.path}, but its "
                                     f"split.no and split.count say {said}")
        expected = first.metadata.get(SPLIT_TENSORS)
        held = sum(len(part.tensors) for part in (first, *parts))
        if expected is not None and held != expected:
            raise ModelLoadError(f"the {count} parts of {self.path} hold {held} tensors; split.tensors.count "
                                 f"says {expected}")
        return parts

    @property
    def paths(self) -> list[str]:
        """The files the model is read from: its one file, or every part of a split model."""
        return [part.path for part in self._parts]

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"{self.path} has no general.architecture key")
        return arch

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_info(self, name: str) -> TensorInfo:
        info = self._tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{self.path} lacks tensor {name!r} required by {self.architecture}")
        return info

    def data_offset(self, info: TensorInfo) -> int:
        """Where a tensor's bytes start in its file (``paths[info.part]``)."""
        return self._parts[info.part].data_start + info.offset

    def _checked(self, name: str, shape: tuple[int, ...] | None) -> tuple[TensorInfo, GGMLQuantizationType, np.ndarray]:
        """The tensor's info, type and raw bytes (a view of the file), after the checks that
        name the culprit: an unknown or undecodable type, a shape other than expected."""
        info = self.tensor_info(name)
        qtype = _known_type(info.type_id)
        if info.type_id == q2_0.TYPE_ID:
            qtype = q2_0.Layout.of(info.q2_0_block)  # decoded by q2_0.py, never by the gguf package
        elif qtype is None or qtype not in DECODABLE_TYPES:
            raise ModelLoadError(
                f"tensor {name!r} in {self.path} has type {info.type_name}, which lmserve cannot "
                f"dequantize (supported: {', '.join(sorted(t.name for t in DECODABLE_TYPES))})")
        if shape is not None and info.shape != tuple(shape):
            raise ModelLoadError(f"tensor {name!r} in {self.path} has shape {info.shape}, expected {tuple(shape)}")
        raw = np.frombuffer(self._parts[info.part].map, dtype=np.uint8, count=info.n_bytes,
                            offset=self.data_offset(info))
        if name not in self._read:
            self._read.add(name)
            self.bytes_read += info.n_bytes
            if self.on_progress is not None:
                self.on_progress(self.bytes_read, self.total_bytes)
        return info, qtype, raw

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The named tensor as a C-contiguous float32 array (numpy order, outermost first)."""
        info, qtype, raw = self._checked(name, shape)
        try:
            if info.type_id == q2_0.TYPE_ID:
                array = q2_0.dequantize(raw, info.q2_0_block, info.shape)
            elif qtype in _PLAIN_TYPES:
                array = raw.view(_PLAIN_TYPES[qtype]).reshape(info.shape).astype(np.float32)
            else:
                block, type_size = GGML_QUANT_SIZES[qtype]
                rows = raw.reshape(*info.shape[:-1], info.shape[-1] // block * type_size)
                array = quants.dequantize(rows, qtype).reshape(info.shape)
            array = np.ascontiguousarray(array, dtype=np.float32)
        except Exception as exc:
            raise ModelLoadError(
                f"tensor {name!r} ({info.type_name}, shape {info.shape}) in {self.path} could not be decoded: {exc}"
            ) from exc
        if not np.all(np.isfinite(array)):
            raise ModelLoadError(f"tensor {name!r} in {self.path} holds NaN or infinite values")
        return array

    def weight(self, name: str, shape: tuple[int, ...] | None = None, dense: bool = False) -> Weight:
        """A weight matrix (or a stack of them) for ``x @ Wᵀ``: read in place from the file when
        a kernel serves its type, else (or with ``dense``) dequantized to float32 here. The
        kernels (numba) are imported here, not with the module: reading a header or a vocabulary
        does not load them (see ``worker.engine``)."""
        from worker.engine import kernels
        from worker.engine.weights import DenseWeight, QuantizedWeight, has_kernel, row_bytes

        info, qtype, raw = self._checked(name, shape)
        if dense or len(info.shape) < 2 or not kernels.available() or not has_kernel(qtype, info.shape[-1]):
            if not dense and name not in self.dense_fallbacks and len(info.shape) >= 2:
                self.dense_fallbacks[name] = info.type_name
            return DenseWeight(self.tensor(name, shape))
        rows = raw.reshape(*info.shape[:-1], row_bytes(qtype, info.shape[-1]))
        return QuantizedWeight(qtype, info.shape, rows)

    def matrix_weights(self) -> dict:
        """The weights of each block type among the 2-D tensors a model repacks in panels
        (``panels.packable``), the embedding and the head (``head_type``) left out: what the
        layers' GEMMs take."""
        if self._matrix_weights is None:
            weights: dict = {}
            for name, qtype in self._packable():
                if name not in HEAD_NAMES:
                    weights[qtype] = weights.get(qtype, 0) + math.prod(self._tensors[name].shape)
            self._matrix_weights = weights
        return self._matrix_weights

    def head_type(self):
        """The block type of the head if it is repacked in panels (else None): ``output.weight``,
        or the embedding where the head is tied to it. An embedding beside its own head is only
        looked up, never multiplied by."""
        head = "output.weight" if "output.weight" in self._tensors else "token_embd.weight"
        return next((qtype for name, qtype in self._packable() if name == head), None)

    def _packable(self):
        from worker.engine import panels

        for name, info in self._tensors.items():
            qtype = q2_0.Layout.of(info.q2_0_block) if info.type_id == q2_0.TYPE_ID else _known_type(info.type_id)
            if qtype is not None and panels.packable(qtype, info.shape):
                yield name, qtype

    def release(self, name: str) -> None:
        """Let go of the pages of a tensor that was copied (repacked): they leave this process's
        resident memory (the whole pages inside its bytes; the system may keep them cached)."""
        info = self.tensor_info(name)
        start = self.data_offset(info)
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        last = (start + info.n_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
        part = self._parts[info.part].map
        if last > first and hasattr(part, "madvise"):
            part.madvise(mmap.MADV_DONTNEED, first, last - first)

    @functools.cached_property
    def total_bytes(self) -> int:
        return sum(info.n_bytes for info in self._tensors.values()
                   if _known_type(info.type_id) is not None or info.type_id == q2_0.TYPE_ID)


def _open_part(path: str, index: int) -> GGUFPart:
    """Map one file and read its header; every tensor's bytes are checked to lie inside it."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"model file not found: {path}")
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        if fh.read(4) != GGUF_MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
        data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        metadata, tensors, data_start = _read_header(data, path, index)
    except (struct.error, ValueError, UnicodeDecodeError, OverflowError, MemoryError) as exc:
        raise ModelLoadError(f"{path} is truncated or corrupt: its header could not be read ({exc})") from exc
    part = GGUFPart(path, data, metadata, tensors, data_start)
    _settle_q2_0(part, size)
    for info in part.tensors.values():
        if _known_type(info.type_id) is None and info.type_id != q2_0.TYPE_ID:
            continue  # reported when the tensor is asked for
        if info.n_bytes > size:
            raise ModelLoadError(
                f"tensor {info.name!r} in {path} declares shape {info.shape}: {info.n_bytes} bytes, "
                f"more than the whole file ({size} bytes)")
        end = data_start + info.offset + info.n_bytes
        if end > size:
            raise ModelLoadError(
                f"{path} is truncated: tensor {info.name!r} needs bytes up to {end} but the file has {size}")
    return part


def _settle_q2_0(part: GGUFPart, size: int) -> None:
    """Give every Q2_0 tensor the file's block layout, told by the bytes the tensors occupy."""
    q2 = [info for info in part.tensors.values() if info.type_id == q2_0.TYPE_ID]
    if not q2:
        return
    starts = sorted(info.offset for info in part.tensors.values())
    data_end = size - part.data_start

    def room(info: TensorInfo) -> int:
        later = bisect.bisect_right(starts, info.offset)
        return (starts[later] if later < len(starts) else data_end) - info.offset

    alignment = int(part.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    block = q2_0.layout([(info.name, info.n_values, info.shape[-1], room(info)) for info in q2], alignment,
                        part.path)
    for info in q2:
        part.tensors[info.name] = dataclasses.replace(info, q2_0_block=block)


def _read_header(data: mmap.mmap, path: str, part: int) -> tuple[dict[str, Any], dict[str, TensorInfo], int]:
    header = HeaderCursor(data)
    header.pos = 4
    version = header.scalar("<I")
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"GGUF version {version} (supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
    n_tensors = header.scalar("<Q")
    n_kv = header.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = header.string()
        try:
            metadata[key] = header.value(header.scalar("<I"))
        except NestedArrayError as exc:
            raise ModelLoadError(f"{path}: metadata key {key!r} holds {exc}, which lmserve (like "
                                 "llama.cpp) does not read") from exc
    tensors: dict[str, TensorInfo] = {}
    for _ in range(n_tensors):
        name = header.string()
        n_dims = header.scalar("<I")
        if n_dims > 8:
            raise ValueError(f"tensor {name!r} claims {n_dims} dimensions")
        dims = [header.scalar("<Q") for _ in range(n_dims)]
        type_id = header.scalar("<I")
        offset = header.scalar("<Q")
        # GGUF lists dims innermost first; numpy wants outermost first
        tensors[name] = TensorInfo(name, tuple(reversed(dims)), type_id, offset, part=part)
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment} is not a power of two")
    data_start = -(-header.pos // alignment) * alignment
    return metadata, tensors, data_start


def _known_type(type_id: int) -> GGMLQuantizationType | None:
    try:
        return GGMLQuantizationType(type_id)
    except ValueError:
        return None
