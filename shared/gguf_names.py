"""What a GGUF file's name says: the parts of a split model, and the quantization tag.

A split model (llama.cpp's ``gguf-split``, the ``gguf`` package's split writer) is files named
``PREFIX-00001-of-00003.gguf``, ``PREFIX-00002-of-00003.gguf``…; the engine opens the first and
finds the others beside it. A quant tag is the part of a name such as ``Q4_K_M``, ``IQ4_XS``,
``Q8_0`` or ``BF16`` that a model repository names its files by (``Qwen3-0.6B-Q8_0.gguf``).
"""

from __future__ import annotations

import os
import re

from shared.errors import ModelLoadError

SPLIT_FILE_NAME = re.compile(r"^(?P<prefix>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.gguf$")
# a name's pieces between '-', '.' and '/' that are quantization types (UD-Q4_K_XL gives Q4_K_XL)
_QUANT_PIECE = re.compile(r"^(?:[it]?q\d+(?:_[a-z0-9]+)*|b?f16|f32|f64|mxfp4(?:_moe)?)$", re.IGNORECASE)


def split_part(name: str) -> tuple[str, int, int] | None:
    """(the path before ``-00001-of-00003.gguf``, the part's number from 1, the count of parts)
    for a part of a split model; None for any other name."""
    match = SPLIT_FILE_NAME.match(os.path.basename(name))
    if match is None:
        return None
    return os.path.join(os.path.dirname(name), match["prefix"]), int(match["number"]), int(match["count"])


def split_part_paths(first: str, count: int) -> list[str]:
    """Every part of a split model of ``count`` parts, its first part named, in order."""
    split = split_part(first)
    if split is None:
        raise ModelLoadError(f"{first} is the first of {count} parts of a split model, but its name is not "
                             "PREFIX-00001-of-NNNNN.gguf, by which its other parts are found")
    prefix = split[0]
    return [f"{prefix}-{number:05d}-of-{count:05d}.gguf" for number in range(1, count + 1)]


def model_name(path: str) -> str:
    """A model's name from its file: without ``.gguf`` and, for a split model, without the
    part's ``-00001-of-00003``."""
    split = split_part(path)
    return os.path.basename(split[0]) if split else os.path.splitext(os.path.basename(path))[0]


def quant_tag(name: str) -> str | None:
    """The quantization a file's name states (the last piece that is one), in capitals."""
    split = split_part(name)
    stem = split[0] if split else re.sub(r"\.gguf$", "", name, flags=re.IGNORECASE)
    pieces = [piece for piece in re.split(r"[-./]", stem) if _QUANT_PIECE.match(piece)]
    return pieces[-1].upper() if pieces else None


def tag_matches(tag: str, name: str) -> bool:
    """Whether ``tag`` stands in the file's path, in any case, between separators ('-', '.', '/',
    the start and the end): ``Q4_K_M`` is in ``model-Q4_K_M.gguf`` and ``q8_0`` in
    ``model.Q8_0.gguf``, while ``Q4_K`` is not in ``model-Q4_K_M.gguf`` nor ``F16`` in ``model-BF16.gguf``."""
    return re.search(rf"(?:^|[-./]){re.escape(tag.lower())}(?:[-./]|$)", name.lower()) is not None
