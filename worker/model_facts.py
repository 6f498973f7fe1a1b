"""What the served model is, for the MODEL_CARD (``shared.protocol.ModelFacts``): its file's
format and type, its size, who published it and how wide its hidden state is. Model listings
(LM Studio's ``/api/v0/models``) report these, and ``/v1/embeddings`` checks ``dimensions``
against the width; the gateway never opens the model to find them."""

from __future__ import annotations

import gguf

from shared.errors import InvalidRequestError
from shared.protocol import ModelFacts
from shared.sampling_params import SamplingDefaults, SamplingParams
from worker.engine import Engine

# what LlamaFileType's names carry before the type itself (MOSTLY_Q4_K_M, ALL_F32)
_FILE_TYPE_PREFIXES = ("MOSTLY_", "ALL_")


def model_facts(engine: Engine) -> ModelFacts:
    metadata, model = engine.metadata, engine.model
    parameters = model.parameter_count
    size_bytes = model.weight_bytes
    label = metadata.get("general.size_label")
    publisher = metadata.get("general.organization") or metadata.get("general.author")
    return ModelFacts(
        format=file_format(engine),
        quantization=file_type_name(metadata.get("general.file_type")),
        bits_per_weight=round(size_bytes * 8 / parameters, 2) if parameters else 0.0,
        size_bytes=size_bytes, parameters=parameters,
        size_label=label if isinstance(label, str) and label else size_label(parameters),
        publisher=publisher if isinstance(publisher, str) else "",
        embedding_length=model.hp.n_embd)


def file_format(engine: Engine) -> str:
    """``gguf``, or ``safetensors`` for a nanochat checkpoint directory (whose metadata, made up
    on loading, has no file type, as a GGUF converted from one has)."""
    if engine.architecture == "nanochat" and "general.file_type" not in engine.metadata:
        return "safetensors"
    return "gguf"


def file_type_name(file_type: object) -> str:
    """``general.file_type`` as llama.cpp names it (``Q4_K_M``, ``F16``); "" for none or one it
    does not know."""
    if not isinstance(file_type, int) or isinstance(file_type, bool):
        return ""
    try:
        name = gguf.LlamaFileType(file_type).name
    except ValueError:
        return ""
    for prefix in _FILE_TYPE_PREFIXES:
        name = name.removeprefix(prefix)
    return "" if name == "GUESSED" else name


def size_label(parameters: int) -> str:
    """A parameter count as model names write it: 135M, 1.5B, 27B."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if parameters >= scale:
            value = parameters / scale
            return f"{value:.1f}".rstrip("0").rstrip(".") + suffix if value < 10 else f"{value:.0f}{suffix}"
    return str(parameters)


# general.sampling.* keys of a GGUF (the gguf package's Keys.General.SAMPLING_*) -> SamplingDefaults fields
SAMPLING_KEYS = {gguf.Keys.General.SAMPLING_TEMP: "temperature", gguf.Keys.General.SAMPLING_TOP_P: "top_p",
                 gguf.Keys.General.SAMPLING_TOP_K: "top_k", gguf.Keys.General.SAMPLING_MIN_P: "min_p",
                 gguf.Keys.General.SAMPLING_PENALTY_REPEAT: "repetition_penalty"}


def sampling_defaults(metadata: dict) -> SamplingDefaults:
    """The sampling settings the model file recommends. A value of the wrong type, or one no
    request could ask for (a negative temperature), is no recommendation."""
    found: dict[str, float | int] = {}
    for key, name in SAMPLING_KEYS.items():
        value = metadata.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        value = int(value) if name == "top_k" else float(value)
        try:
            SamplingParams(**{name: value})
        except InvalidRequestError:
            continue
        found[name] = value
    return SamplingDefaults(**found)
