"""Self-study: the conversations a cartridge is trained on, written by the served model itself.

For each chunk of a document the engine plays two parts, both with the chunk in front of them:
one writes a message about the chunk from a seed prompt (a question, a request for a summary,
a use case, a request to restate part of it), the other answers that message. The answer's
every step records the teacher's top-k log-probabilities, read with the chunk in context. The
training sample is the conversation as a client would send it, with the chunk absent: the
message as the user turn (templated as the server templates it) and the answer, with the
teacher's distributions as targets on the answer's tokens. A cartridge trained on these learns
to stand in for the chunks it never sees at serving time.

Only numpy and the engine run here; the optimisation is in ``training/trainer.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.chat_template import ChatTemplate, chat_template_from_metadata
from shared.errors import TemplateError
from shared.sampling_params import SamplingParams
from worker.engine import Engine
from worker.engine.sampling import Sampler

TOP_K = 20  # teacher log-probabilities kept per answer token (the sampler reports at most 20)

# What the first part is asked to write about a chunk; each sample draws one kind.
SEED_PROMPTS: dict[str, str] = {
    "question": "Write one question that a reader could answer only by reading the passage above. "
                "Reply with the question alone.",
    "summary": "Ask for a short summary of one part of the passage above, naming the part. "
               "Reply with the request alone.",
    "use": "Think of someone who needs the facts in the passage above for their work. Write the "
           "message they would send to an assistant that knows the passage. Reply with the message alone.",
    "recall": "Ask for the exact names, numbers and dates that the passage above gives about one of "
              "its subjects. Reply with the request alone.",
}


@dataclass
class Sample:
    """One training conversation: ``tokens`` is the prompt (as served, no chunk) then the answer;
    answer token j sits at ``tokens[prompt_len + j]`` and its teacher's top-k are row j of
    ``top_ids`` / ``top_logprobs`` [answer tokens, TOP_K]."""

    kind: str
    message: str  # the user turn the first part wrote
    tokens: list[int]
    prompt_len: int
    top_ids: np.ndarray
    top_logprobs: np.ndarray

    def to_dict(self) -> dict:
        return {"kind": self.kind, "message": self.message, "tokens": self.tokens, "prompt_len": self.prompt_len,
                "top_ids": self.top_ids.tolist(), "top_logprobs": self.top_logprobs.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> Sample:
        return cls(d["kind"], d["message"], list(d["tokens"]), int(d["prompt_len"]), np.asarray(d["top_ids"], dtype=np.int64),
                   np.asarray(d["top_logprobs"], dtype=np.float32))


def chunks(engine: Engine, text: str, chunk_tokens: int) -> list[list[int]]:
    """The document's tokens in pieces of at most ``chunk_tokens``."""
    ids = engine.tokenizer.encode(text, add_special=False, parse_special=False)
    if not ids:
        raise ValueError("the document has no tokens")
    return [ids[i:i + chunk_tokens] for i in range(0, len(ids), chunk_tokens)]


class SelfStudy:
    """Writes samples about a document's chunks with one engine."""

    def __init__(self, engine: Engine, seed: int = 0, temperature: float = 0.7,
                 message_tokens: int = 48, answer_tokens: int = 96):
        self.engine = engine
        self.template: ChatTemplate | None = chat_template_from_metadata(engine.metadata, engine.tokenizer)
        self.rng = np.random.default_rng(seed)
        self.temperature = temperature
        self.message_tokens = message_tokens
        self.answer_tokens = answer_tokens

    # --- prompts ------------------------------------------------------------------------------

    def render(self, messages: list[dict]) -> list[int]:
        """The prompt for ``messages`` through the model's chat template; a model without one (a
        base model) gets plain "Role: text" lines."""
        if self.template is not None:
            try:
                return self.engine.tokenizer.encode_prompt(self.template.render(messages, add_generation_prompt=True))
            except TemplateError:
                if messages[0]["role"] != "system":
                    raise
                # a template without a system role: the system text opens the first user turn
                merged = [{"role": "user", "content": messages[0]["content"] + "\n\n" + messages[1]["content"]}]
                return self.render(merged + messages[2:])
        lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
        return self.engine.tokenizer.encode_prompt("\n\n".join(lines) + "\n\nAssistant:")

    def served_prompt(self, message: str) -> list[int]:
        """What a client sends behind the cartridge: the message as its only user turn."""
        return self.render([{"role": "user", "content": message}])

    def with_chunk(self, chunk: str, message: str) -> list[int]:
        return self.render([{"role": "system", "content": "Here is part of a document.\n\n" + chunk},
                            {"role": "user", "content": message}])

    # --- generation ---------------------------------------------------------------------------

    def generate(self, prompt: list[int], max_tokens: int, record: bool) -> tuple[list[int], list, list]:
        """Sampled continuation of ``prompt`` up to a turn's end; with ``record``, every step's
        top-k (ids, log-probabilities) of the untempered distribution."""
        engine = self.engine
        stops = engine.tokenizer.stop_ids
        params = SamplingParams(temperature=self.temperature, top_p=0.95, seed=int(self.rng.integers(2**31)),
                                top_logprobs=TOP_K if record else 0)
        sampler = Sampler(params)
        cache = engine.new_cache(len(prompt) + max_tokens + 1)
        logits = engine.prefill(cache, prompt)
        out, ids, logprobs = [], [], []
        for _ in range(max_tokens):
            token = sampler.sample(logits)
            if record:
                ids.append([t for t, _ in token.top_logprobs])
                logprobs.append([lp for _, lp in token.top_logprobs])
            out.append(token.token_id)
            sampler.accept(token.token_id)
            if token.token_id in stops:
                break
            logits = engine.model.forward([(cache, [token.token_id])])[0]
        return out, ids, logprobs

    def sample(self, chunk_ids: list[int], kind: str | None = None) -> Sample:
        """One conversation about a chunk."""
        tokenizer = self.engine.tokenizer
        kind = kind or str(self.rng.choice(sorted(SEED_PROMPTS)))
        chunk = tokenizer.decode(chunk_ids)
        asked, _, _ = self.generate(self.with_chunk(chunk, SEED_PROMPTS[kind]), self.message_tokens, record=False)
        message = tokenizer.decode(asked, skip_special=True).strip() or SEED_PROMPTS[kind]
        answer, top_ids, top_logprobs = self.generate(self.with_chunk(chunk, message), self.answer_tokens,
                                                      record=True)
        prompt = self.served_prompt(message)
        return Sample(kind, message, prompt + answer, len(prompt), np.asarray(top_ids, dtype=np.int64),
                      np.asarray(top_logprobs, dtype=np.float32))
