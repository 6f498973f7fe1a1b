"""Architecture registry: ``general.architecture`` -> the class that serves it."""

from __future__ import annotations

from shared.errors import ModelLoadError
from worker.engine.archs.diffusion_gemma import DiffusionGemmaModel
from worker.engine.archs.gemma3 import Gemma3Model
from worker.engine.archs.gemma4 import Gemma4Model
from worker.engine.archs.inkling import InklingModel
from worker.engine.archs.llama import LlamaModel
from worker.engine.archs.nanochat import NanochatModel
from worker.engine.archs.qwen3 import Qwen3Model
from worker.engine.archs.qwen35 import Qwen35Model
from worker.engine.archs.qwen35moe import Qwen35MoeModel
from worker.engine.archs.qwen3moe import Qwen3MoeModel
from worker.engine.gguf_file import GGUFFile
from worker.engine.model import DecoderModel

ARCHITECTURES: dict[str, type[DecoderModel]] = {
    "diffusion-gemma": DiffusionGemmaModel,
    "gemma3": Gemma3Model,
    "gemma4": Gemma4Model,
    "inkling": InklingModel,
    "llama": LlamaModel,
    "nanochat": NanochatModel,
    "qwen3": Qwen3Model,
    "qwen35": Qwen35Model,
    "qwen35moe": Qwen35MoeModel,
    "qwen3moe": Qwen3MoeModel,
}


def load_model(gguf: GGUFFile, exact: bool = False, kv_type: str = "f16") -> DecoderModel:
    arch = gguf.architecture
    model_class = ARCHITECTURES.get(arch)
    if model_class is None:
        raise ModelLoadError(
            f"{gguf.path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    try:
        return model_class(gguf, exact, kv_type)
    except (TypeError, ValueError, ArithmeticError, LookupError) as exc:
        # what a crafted file's values set off deep in a family's reading of them: one line, not a traceback
        raise ModelLoadError(f"{gguf.path} does not describe a {arch} model lmserve can build "
                             f"({type(exc).__name__}: {exc})") from exc
