"""Split a GGUF into parts with the ``gguf`` package's own split writer, as llama.cpp's
``gguf-split`` splits one: ``PREFIX-00001-of-0000N.gguf``…, the metadata in the first part, each
part's ``split.no``, ``split.count`` and ``split.tensors.count``, the tensors spread over the parts.

The source is read with the engine's header reader (the ``gguf`` package's reader takes seconds
over a vocabulary); each tensor's bytes are copied as they are, its type kept.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np

from worker.engine.gguf_file import GGUFFile

FLOATS = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}


def split_gguf(source: str | os.PathLike, target: str | os.PathLike, tensors_per_part: int,
               empty_first: bool = True) -> list[Path]:
    """Write ``source``'s metadata and tensors as parts named after ``target`` (``target``
    without ``.gguf``, then ``-00001-of-0000N.gguf``…); ``empty_first`` leaves the first part
    metadata alone, as ``gguf-split --no-tensor-first-split`` does. The parts, in order."""
    model = GGUFFile(source)
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(os.fspath(target), model.architecture, split_max_tensors=tensors_per_part,
                             small_first_shard=empty_first)
    for key, value in model.metadata.items():
        if key != gguf.Keys.General.ARCHITECTURE:  # the writer writes it itself
            writer.add_key_value(key, value, _value_type(value))
    with open(source, "rb") as fh:
        for name in model.tensor_names:
            info = model.tensor_info(name)
            fh.seek(model.data_offset(info))
            raw = np.frombuffer(fh.read(info.n_bytes), dtype=np.uint8)
            qtype = gguf.GGMLQuantizationType(info.type_id)
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            # a float tensor as its values, a quantized one as its rows of blocks (the writer's two forms)
            array = raw.view(FLOATS[qtype]).reshape(info.shape) if qtype in FLOATS \
                else raw.reshape(*info.shape[:-1], info.shape[-1] // block * size)
            writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(Path(target))


def _value_type(value: object) -> gguf.GGUFValueType:
    """A metadata value's GGUF type, as the tiny models write them (tests/tiny_models.py)."""
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, int):
        return gguf.GGUFValueType.UINT32
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    return gguf.GGUFValueType.ARRAY  # the writer types its items by the first one
