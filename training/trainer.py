"""Training a cartridge by self-study (``lmserve cartridge train``); needs torch (``lmserve[train]``).

The served model is mirrored in torch (``TorchDecoder``: the plain pre-norm block of the llama
and qwen3 families, read from the engine's own weights), and a KV prefix of P positions per
layer is the only thing that learns. It starts as the KV of the document's first P tokens (the
first position stays frozen: it is where attention rests when it has nowhere better to go), and
is trained by distillation: on self-study conversations (``training/selfstudy.py``) with the
document absent, the model behind the prefix is pulled toward the teacher's top-k distribution,
which was read with the document's chunk in context. The keys live after RoPE at positions
0..P−1, exactly as the worker's caches hold them, so the trained prefix is served as it is.

A checkpoint beside the output (``OUT.ckpt``) holds the samples as they are written and the
prefix and optimiser after every few steps; running the same command again resumes from it.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

try:
    import torch
except ImportError as exc:  # serving never needs torch; training does
    raise ImportError("training a cartridge needs torch: pip install 'lmserve[train]'") from exc

from shared.errors import ModelLoadError
from shared.load_progress import ProgressBar
from worker.cartridges.cartridge import from_document, model_identity, write_arrays
from worker.engine import Engine
from worker.engine.model import DecoderModel
from training.selfstudy import Sample, SelfStudy, chunks

CHECKPOINT_FORMAT = "lmserve-cartridge-train-1"
# the forward steps a trainable family must share with the base class, unchanged
_PLAIN_STEPS = ("block", "dense_block", "attention_half", "self_attention", "project_qkv", "ffn_half",
                "embed", "logits", "layer_inputs")


def trainable(model: DecoderModel) -> str | None:
    """Why a model cannot be trained here, or None: training mirrors the plain pre-norm block
    (llama, qwen3) with full causal attention and uniform layers."""
    family = type(model)
    departs = [name for name in _PLAIN_STEPS if getattr(family, name) is not getattr(DecoderModel, name)]
    if departs:
        return f"{model.architecture} departs from the plain pre-norm block ({', '.join(departs)})"
    if model.hp.layers or model.reads_cache_tokens or not model.has_output_norm:
        return f"{model.architecture}'s layers differ from one another"
    if any(o.window or o.softcap for o in model.attention_options):
        return f"{model.architecture} has sliding or soft-capped attention"
    return None


class TorchDecoder:
    """The engine's model in torch, float32, weights frozen: logits of tokens behind a KV prefix."""

    def __init__(self, model: DecoderModel):
        reason = trainable(model)
        if reason:
            raise ModelLoadError(f"cartridge training is built for the llama and qwen3 families: {reason}")
        self.hp = hp = model.hp
        self.activation = model.activation

        def tensor(value) -> torch.Tensor:
            array = value.dequantize() if hasattr(value, "dequantize") else value
            return torch.tensor(np.asarray(array, dtype=np.float32))  # a copy: the file's map is read-only

        self.embedding = tensor(model.token_embd)
        self.output = self.embedding if model.output is model.token_embd else tensor(model.output)
        self.output_norm = tensor(model.output_norm)
        self.layers = [{key: tensor(value) for key, value in layer.items()} for layer in model.layers]
        self.scales = [o.scale for o in model.attention_options]
        self.ropes = [model.rope_tables[t] for t in model.layer_rope]  # (inverse frequencies, adjacent)
        self.group = hp.n_head // hp.n_head_kv

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.hp.rms_eps) * weight

    @staticmethod
    def rope(x: torch.Tensor, positions: np.ndarray, inv_freq: np.ndarray, adjacent: bool) -> torch.Tensor:
        """x [T, heads, d] rotated as ``ops.apply_rope`` rotates it."""
        angles = np.outer(positions.astype(np.float64), inv_freq)
        cos = torch.from_numpy(np.cos(angles).astype(np.float32))[:, None, :]
        sin = torch.from_numpy(np.sin(angles).astype(np.float32))[:, None, :]
        half = inv_freq.shape[0]
        rotated, rest = x[..., :2 * half], x[..., 2 * half:]
        if adjacent:
            a, b = rotated[..., 0::2], rotated[..., 1::2]
            turned = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
        else:
            a, b = rotated[..., :half], rotated[..., half:]
            turned = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
        return torch.cat((turned, rest), dim=-1)

    def hidden(self, keys: list[torch.Tensor], values: list[torch.Tensor], tokens: list[int]) -> torch.Tensor:
        """The final normed rows [T, D] of ``tokens`` at positions P.. behind a prefix of P
        positions (keys/values per layer [KV heads, P, d]); P may be 0."""
        hp = self.hp
        n = len(tokens)
        prefix = keys[0].shape[1] if keys else 0
        positions = np.arange(prefix, prefix + n)
        x = self.embedding[torch.as_tensor(tokens)]
        # query t sees the whole prefix and tokens 0..t
        mask = torch.ones(n, prefix + n, dtype=torch.bool)
        mask[:, prefix:] = torch.tril(torch.ones(n, n, dtype=torch.bool))
        for i, layer in enumerate(self.layers):
            h = self.rms_norm(x, layer["attn_norm"])
            q, k, v = (h @ layer[f"w{p}"].T + (layer[f"b{p}"] if f"b{p}" in layer else 0) for p in "qkv")
            q = q.view(n, hp.n_head, hp.head_dim)
            k = k.view(n, hp.n_head_kv, hp.head_dim)
            v = v.view(n, hp.n_head_kv, hp.value_dim)
            if "q_norm" in layer:
                q = self.rms_norm(q, layer["q_norm"])
            if "k_norm" in layer:
                k = self.rms_norm(k, layer["k_norm"])
            inv_freq, adjacent = self.ropes[i]
            q, k = self.rope(q, positions, inv_freq, adjacent), self.rope(k, positions, inv_freq, adjacent)
            all_k = torch.cat((keys[i], k.transpose(0, 1)), dim=1) if prefix else k.transpose(0, 1)
            all_v = torch.cat((values[i], v.transpose(0, 1)), dim=1) if prefix else v.transpose(0, 1)
            all_k = all_k.repeat_interleave(self.group, dim=0)  # query head h reads KV head h // group
            all_v = all_v.repeat_interleave(self.group, dim=0)
            scores = (q.transpose(0, 1) @ all_k.transpose(1, 2)) * self.scales[i]
            weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            attended = (weights @ all_v).transpose(0, 1).reshape(n, hp.n_head * hp.value_dim)
            x = x + attended @ layer["wo"].T
            h = self.rms_norm(x, layer["ffn_norm"])
            gate = h @ layer["gate"].T
            gate = (torch.nn.functional.silu(gate) if self.activation == "silu"
                    else torch.nn.functional.gelu(gate, approximate="tanh"))
            x = x + (gate * (h @ layer["up"].T)) @ layer["down"].T
        return self.rms_norm(x, self.output_norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.output.T


class Prefix:
    """The trained KV prefix: per layer, position 0 frozen and positions 1..P−1 learning."""

    def __init__(self, keys: list[np.ndarray], values: list[np.ndarray]):
        def split(arrays: list[np.ndarray]) -> tuple[list[torch.Tensor], list[torch.nn.Parameter]]:
            tensors = [torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)) for a in arrays]
            return [t[:, :1].clone() for t in tensors], [torch.nn.Parameter(t[:, 1:].clone()) for t in tensors]

        self.frozen_keys, self.keys = split(keys)
        self.frozen_values, self.values = split(values)

    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        return self.keys + self.values

    def whole(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return ([torch.cat(p, dim=1) for p in zip(self.frozen_keys, self.keys)],
                [torch.cat(p, dim=1) for p in zip(self.frozen_values, self.values)])

    def arrays(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        keys, values = self.whole()
        return [k.detach().numpy() for k in keys], [v.detach().numpy() for v in values]


def distillation_loss(decoder: TorchDecoder, keys: list[torch.Tensor], values: list[torch.Tensor],
                      sample: Sample) -> torch.Tensor:
    """Cross-entropy of the model behind the prefix against the teacher's top-k distribution
    (renormalised over those k) on every answer token."""
    answer = len(sample.tokens) - sample.prompt_len
    hidden = decoder.hidden(keys, values, sample.tokens[:-1] if answer else sample.tokens)
    rows = hidden[sample.prompt_len - 1:sample.prompt_len - 1 + answer]
    student = torch.log_softmax(decoder.logits(rows), dim=-1)
    teacher = torch.softmax(torch.from_numpy(sample.top_logprobs), dim=-1)
    picked = student.gather(1, torch.from_numpy(sample.top_ids))
    return -(teacher * picked).sum(-1).mean()


@dataclass(frozen=True)
class TrainSettings:
    tokens: int = 256  # P
    samples: int = 64  # self-study conversations
    steps: int = 200
    batch: int = 4  # conversations per step
    lr: float = 2e-2
    chunk_tokens: int = 512
    seed: int = 0
    message_tokens: int = 48
    answer_tokens: int = 96
    checkpoint_every: int = 10  # steps (and samples) between checkpoints


def progress(label: str) -> ProgressBar:
    return ProgressBar(sys.stderr, label, amount=lambda done, total: f"{done}/{total}", redraw=sys.stderr.isatty())


def time_left(started: float, done: int, since: int, total: int) -> str:
    """Elapsed and left, from the pace of the ``done - since`` units this run has made."""
    elapsed = time.monotonic() - started
    made = done - since
    return f"{elapsed:.0f} s elapsed, {elapsed / made * (total - done) if made else 0:.0f} s left"


def document_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Trainer:
    """Self-study then distillation for one cartridge, checkpointed to ``checkpoint``."""

    def __init__(self, engine: Engine, document: str, settings: TrainSettings, checkpoint: Path,
                 fresh: bool = False, report: Callable[[str], None] | None = None):
        self.engine, self.document, self.settings, self.checkpoint = engine, document, settings, checkpoint
        self.report = report or (lambda line: print(line, file=sys.stderr))
        self.decoder = TorchDecoder(engine.model)
        # what a checkpoint must share to be resumed: all but the step count, which may grow
        run = {k: v for k, v in asdict(settings).items() if k not in ("steps", "checkpoint_every")}
        self.identity = {"model": model_identity(engine), "document": document_digest(document), "settings": run}
        cache, tokens = from_document(engine, document, settings.tokens)
        self.tokens = tokens
        self.prefix = Prefix([cache.key_rows(i, 0, tokens) for i in range(cache.n_layer)],
                             [cache.values[i][:, :tokens] for i in range(cache.n_layer)])
        self.optimizer = torch.optim.Adam(self.prefix.parameters, lr=settings.lr)
        self.samples: list[Sample] = []
        self.step = 0
        self.losses: list[float] = []
        if checkpoint.exists() and not fresh:
            self.resume()

    def resume(self) -> None:
        state = torch.load(self.checkpoint, weights_only=False)
        if state.get("format") != CHECKPOINT_FORMAT or state.get("identity") != self.identity:
            raise ModelLoadError(f"{self.checkpoint} is a checkpoint of another training run (another model, "
                                 f"document or settings): remove it or pass --fresh")
        self.samples = [Sample.from_dict(d) for d in state["samples"]]
        self.step, self.losses = state["step"], state["losses"]
        with torch.no_grad():
            for param, saved in zip(self.prefix.parameters, state["prefix"]):
                param.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.report(f"resuming {self.checkpoint}: {len(self.samples)} samples written, step {self.step}")

    def save(self) -> None:
        state = {"format": CHECKPOINT_FORMAT, "identity": self.identity, "step": self.step, "losses": self.losses,
                 "samples": [s.to_dict() for s in self.samples],
                 "prefix": [p.detach().clone() for p in self.prefix.parameters],
                 "optimizer": self.optimizer.state_dict()}
        partial = self.checkpoint.with_name(self.checkpoint.name + f".{os.getpid()}.partial")
        torch.save(state, partial)
        os.replace(partial, self.checkpoint)

    def write_samples(self) -> None:
        s = self.settings
        if len(self.samples) >= s.samples:
            return
        study = SelfStudy(self.engine, seed=s.seed + len(self.samples), message_tokens=s.message_tokens,
                          answer_tokens=s.answer_tokens)
        pieces = chunks(self.engine, self.document, s.chunk_tokens)
        bar, started, since = progress("self-study"), time.monotonic(), len(self.samples)
        bar.update(since, s.samples)
        while len(self.samples) < s.samples:
            # the chunks in turn, from where a resumed run stopped
            self.samples.append(study.sample(pieces[len(self.samples) % len(pieces)]))
            bar.update(len(self.samples), s.samples, time_left(started, len(self.samples), since, s.samples))
            if len(self.samples) % s.checkpoint_every == 0:
                self.save()
        bar.finish()
        self.save()

    def loss(self, sample: Sample) -> torch.Tensor:
        keys, values = self.prefix.whole()
        return distillation_loss(self.decoder, keys, values, sample)

    def train(self) -> list[float]:
        """Run the remaining steps; the mean loss of every step so far."""
        s = self.settings
        bar, started, since = progress("training"), time.monotonic(), self.step
        bar.update(since, s.steps)
        while self.step < s.steps:
            picks = np.random.default_rng([s.seed, self.step]).choice(len(self.samples), size=s.batch,
                                                                      replace=len(self.samples) < s.batch)
            self.optimizer.zero_grad()
            total = 0.0
            for index in picks:
                loss = self.loss(self.samples[int(index)]) / s.batch
                loss.backward()
                total += float(loss.detach())
            self.optimizer.step()
            self.step += 1
            self.losses.append(total)
            recent = self.losses[-10:]
            bar.update(self.step, s.steps, f"loss {sum(recent) / len(recent):.4f}, "
                                           f"{time_left(started, self.step, since, s.steps)}")
            if self.step % s.checkpoint_every == 0 or self.step == s.steps:
                self.save()
        bar.finish()
        return self.losses

    def write(self, out: Path, source: str) -> None:
        keys, values = self.prefix.arrays()
        training = {"method": "self-study distillation", "samples": len(self.samples), "steps": self.step,
                    "lr": self.settings.lr, "batch": self.settings.batch,
                    "final_loss": round(float(np.mean(self.losses[-10:])), 5) if self.losses else None}
        write_arrays(out, self.engine, keys, values, self.tokens, source, training)
