"""gemma4 (Gemma 4: 26B-A4B, 31B, E2B, E4B).

- layers of two kinds, from the per-layer pattern (``attention.sliding_window_pattern``, true
  for a sliding layer): sliding layers with their own KV heads, head size
  (``key_length_swa``) and RoPE (``freq_base_swa`` over ``dimension_count_swa`` dims), global
  layers with theirs and ``rope_freqs.weight`` per-pair factors (a factor of 1e30 leaves a pair
  unrotated: the "proportional" partial rotation); KV heads may differ per layer
- Q and K get per-head RMSNorm with a weight, V one without, before NEOX RoPE; a layer without
  ``attn_v`` uses its K projection as V; the scores are not scaled (scale 1)
- norms after attention and after the FFN as well as before each (stored weights used as they
  are), a GELU-tanh gated FFN, the embedding scaled by √n_embd, tied output, a final soft cap (30 unless the file says otherwise)
- MoE layers (those with ``ffn_gate_inp``) add to the dense FFN (normed by ``post_ffw_norm_1``)
  a routed mixture (normed by ``post_ffw_norm_2``) fed by ``pre_ffw_norm_2``; the router reads
  the raw residual, RMS-normed without weight, scaled by 1/√n_embd and ``ffn_gate_inp.scale``;
  softmax, top k, renormalized, each weight times its expert's ``ffn_down_exps.scale``; gate
  and up of the experts fused (``ffn_gate_up_exps``) or apart
- an optional ``layer_output_scale`` multiplies each layer's output
- E2B/E4B: per-layer token embeddings (``per_layer_token_embd``, mixed with a projection of the
  embedding) gate a small residual branch after each layer, and the last
  ``attention.shared_kv_layers`` layers read the KV of the last sliding or global layer before
  them instead of keeping their own
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from shared.errors import ModelLoadError
from worker.engine import ops
from worker.engine.gguf_file import GGUFFile
from worker.engine.model import (
    DENSE,
    FACTORS,
    NORM,
    TABLE,
    AttentionOptions,
    DecoderModel,
    ForwardPass,
    HParams,
    LayerShape,
    LayerTensor,
    Rope,
    read_hparams,
)
from worker.engine.weights import MatmulInput, Weight

PER_LAYER_KEYS = frozenset({"attention.head_count_kv", "feed_forward_length"})


class Gemma4Model(DecoderModel):
    architecture = "gemma4"
    activation = "gelu_tanh"

    def read_hparams(self, gguf: GGUFFile) -> HParams:
        meta, arch = gguf.metadata, self.architecture
        hp = read_hparams(gguf, arch, PER_LAYER_KEYS)
        n = hp.n_layer

        def per_layer(key: str, default: Any) -> list:
            value = meta.get(f"{arch}.{key}", default)
            values = list(value) if isinstance(value, list) else [value] * n
            if len(values) != n:
                raise ModelLoadError(f"{gguf.path}: {arch}.{key} has {len(values)} values for {n} layers")
            return values

        pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
        if isinstance(pattern, list):
            local = [bool(v) for v in per_layer("attention.sliding_window_pattern", None)]
        else:  # a period, as gemma3 writes it: every period-th layer is global
            period = int(pattern or 6)
            local = [i % period < period - 1 for i in range(n)]
        self.sliding_window = int(meta.get(f"{arch}.attention.sliding_window", 0) or 0)
        if not self.sliding_window:
            local = [False] * n
        head_swa = int(meta.get(f"{arch}.attention.key_length_swa", hp.head_dim))
        if int(meta.get(f"{arch}.attention.value_length_swa", head_swa)) != head_swa or hp.value_dim != hp.head_dim:
            raise ModelLoadError(f"{gguf.path}: gemma4 needs value lengths equal to key lengths")
        kv_heads = [int(v) for v in per_layer("attention.head_count_kv", hp.n_head)]
        for i, heads in enumerate(kv_heads):
            if heads <= 0 or hp.n_head % heads:
                raise ModelLoadError(f"{gguf.path}: layer {i}'s {heads} KV heads do not divide {hp.n_head} query heads")
        ff_widths = [int(v) for v in per_layer("feed_forward_length", hp.n_ff)]
        shared = int(meta.get(f"{arch}.attention.shared_kv_layers", 0) or 0)
        first_shared = n - shared
        if shared and (first_shared < 2 or local[first_shared - 2] == local[first_shared - 1]):
            raise ModelLoadError(f"{gguf.path}: {shared} KV-sharing layers need a sliding and a global layer "
                                 f"to share from just before them")
        layers = []
        for i in range(n):
            source = None
            if i >= first_shared:  # the last own layer of the same kind
                source = first_shared - 2 if local[i] == local[first_shared - 2] else first_shared - 1
            layers.append(LayerShape(kv_heads[i], head_swa if local[i] else hp.head_dim, local[i], source,
                                     ff_widths[i]))
        self.swa_base = float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0))
        self.swa_rope_dims = int(meta.get(f"{arch}.rope.dimension_count_swa", head_swa))
        # absent, the soft cap is 30 (llama.cpp's default, and the family's configuration's)
        self.softcap = float(meta.get(f"{arch}.final_logit_softcapping", 30.0) or 0.0)
        return replace(hp, layers=tuple(layers),
                       n_embd_per_layer=int(meta.get(f"{arch}.embedding_length_per_layer_input", 0) or 0))

    @classmethod
    def layer_tensors(cls, hp: HParams, i: int) -> list[LayerTensor]:
        d, shape = hp.n_embd, hp.layer(i)
        head, q_rows, kv_rows = shape.head_dim, hp.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
        tensors = [LayerTensor("attn_norm", "attn_norm.weight", (d,), NORM),
                   LayerTensor("wq", "attn_q.weight", (q_rows, d)),
                   LayerTensor("q_norm", "attn_q_norm.weight", (head,), NORM)]
        if shape.kv_from is None:
            # global layers may have no V projection: K's serves (K = V)
            tensors += [LayerTensor("wk", "attn_k.weight", (kv_rows, d)),
                        LayerTensor("wv", "attn_v.weight", (kv_rows, d), optional=not shape.local),
                        LayerTensor("k_norm", "attn_k_norm.weight", (head,), NORM)]
        f = shape.n_ff or hp.n_ff
        tensors += [LayerTensor("wo", "attn_output.weight", (d, q_rows)),
                    LayerTensor("post_attention_norm", "post_attention_norm.weight", (d,), NORM),
                    LayerTensor("ffn_norm", "ffn_norm.weight", (d,), NORM),
                    LayerTensor("gate", "ffn_gate.weight", (f, d)),
                    LayerTensor("up", "ffn_up.weight", (f, d)),
                    LayerTensor("down", "ffn_down.weight", (d, f)),
                    LayerTensor("post_ffw_norm", "post_ffw_norm.weight", (d,), NORM),
                    LayerTensor("output_scale", "layer_output_scale.weight", (1,), NORM, optional=True)]
        if hp.n_expert:
            n, fe = hp.n_expert, hp.n_ff_expert
            tensors += [LayerTensor("router", "ffn_gate_inp.weight", (n, d), DENSE),
                        LayerTensor("router_scale", "ffn_gate_inp.scale", (d,), NORM),
                        LayerTensor("pre_ffw_norm_2", "pre_ffw_norm_2.weight", (d,), NORM),
                        LayerTensor("post_ffw_norm_1", "post_ffw_norm_1.weight", (d,), NORM),
                        LayerTensor("post_ffw_norm_2", "post_ffw_norm_2.weight", (d,), NORM),
                        # gate and up of each expert in one stack (gate rows first), or two
                        LayerTensor("gate_up_exps", "ffn_gate_up_exps.weight", (n, 2 * fe, d), optional=True),
                        LayerTensor("gate_exps", "ffn_gate_exps.weight", (n, fe, d), optional=True),
                        LayerTensor("up_exps", "ffn_up_exps.weight", (n, fe, d), optional=True),
                        LayerTensor("down_exps", "ffn_down_exps.weight", (n, d, fe)),
                        LayerTensor("expert_scale", "ffn_down_exps.scale", (n,), NORM, optional=True)]
        if hp.n_embd_per_layer:
            p = hp.n_embd_per_layer
            tensors += [LayerTensor("ple_gate", "inp_gate.weight", (p, d)),
                        LayerTensor("ple_proj", "proj.weight", (d, p)),
                        LayerTensor("ple_norm", "post_norm.weight", (d,), NORM)]
        return tensors

    @classmethod
    def global_tensors(cls, hp: HParams) -> list[LayerTensor]:
        tensors = [LayerTensor("rope_freqs", "rope_freqs.weight", (hp.rope_dims // 2,), FACTORS)]
        if hp.n_embd_per_layer:
            width = hp.n_embd_per_layer * hp.n_layer
            tensors += [LayerTensor("ple_embd", "per_layer_token_embd.weight", (hp.n_vocab, width), TABLE),
                        LayerTensor("ple_model_proj", "per_layer_model_proj.weight", (width, hp.n_embd)),
                        LayerTensor("ple_proj_norm", "per_layer_proj_norm.weight", (hp.n_embd_per_layer,), NORM)]
        return tensors

    def load_layer(self, gguf: GGUFFile, i: int) -> dict[str, Any]:
        layer = super().load_layer(gguf, i)
        if self.hp.n_expert and "gate_up_exps" not in layer and not {"gate_exps", "up_exps"} <= set(layer):
            raise ModelLoadError(f"{gguf.path}: layer {i} has experts but neither ffn_gate_up_exps nor "
                                 f"ffn_gate_exps and ffn_up_exps")
        return layer

    def fused_layer(self, layer: dict[str, Any]) -> None:
        return None  # per-layer shapes and the unweighted V norm: the step-by-step path

    def rope(self, i: int) -> Rope:
        if self.hp.layer(i).local:
            return Rope(self.swa_base, self.swa_rope_dims)
        return super().rope(i)

    def attention(self, i: int) -> AttentionOptions:
        return AttentionOptions(scale=1.0, window=self.sliding_window if self.hp.layer(i).local else 0)

    def layer_inputs(self, token_ids: np.ndarray, x: np.ndarray) -> np.ndarray | None:
        """Per-layer inputs [T, L, P] (E2B/E4B): each token's own per-layer embedding mixed
        with a projection of its (scaled) embedding x."""
        hp = self.hp
        if not hp.n_embd_per_layer:
            return None
        p, n = hp.n_embd_per_layer, hp.n_layer
        own = self.ple_embd.rows(token_ids).reshape(-1, n, p) * np.float32(np.sqrt(p))
        projected = ops.linear(x, self.ple_model_proj) * np.float32(1.0 / np.sqrt(hp.n_embd))
        projected = ops.rms_norm(projected.reshape(-1, n, p), self.ple_proj_norm, hp.rms_eps)
        return (projected + own) * np.float32(1.0 / np.sqrt(2.0))

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        x = super().embed(token_ids)
        x *= np.float32(np.sqrt(self.hp.n_embd))
        return x

    def project(self, i: int, h: np.ndarray, fp: ForwardPass) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Layer i's Q, K and V of normed rows h: per-head norms, RoPE on Q and K; K and V are
        None on a layer that reads another's KV."""
        layer, shape, hp, eps = self.layers[i], self.hp.layer(i), self.hp, self.hp.rms_eps
        n, head = h.shape[0], shape.head_dim
        inp = MatmulInput(h)
        cos, sin, _ = fp.rope[i]
        q = ops.rms_norm(ops.linear(inp, layer["wq"]).reshape(n, hp.n_head, head), layer["q_norm"], eps)
        q = ops.apply_rope(q, cos, sin)
        if shape.kv_from is not None:
            return q, None, None
        k = ops.linear(inp, layer["wk"]).reshape(n, shape.n_head_kv, head)
        v = ops.linear(inp, layer["wv"]).reshape(k.shape) if "wv" in layer else k
        v = ops.rms_norm(v, None, eps)
        k = ops.apply_rope(ops.rms_norm(k, layer["k_norm"], eps), cos, sin)
        return q, k, v

    def self_attention(self, i: int, h: np.ndarray, fp: ForwardPass) -> np.ndarray:
        shape, options = self.hp.layer(i), self.attention_options[i]
        q, k, v = self.project(i, h, fp)
        # a layer sharing KV reads what its source layer wrote earlier in this pass
        kv_layer = i if shape.kv_from is None else shape.kv_from
        return ops.linear(ops.attend(q, k, v, fp, kv_layer, options.scale, options.window), self.layers[i]["wo"])

    def experts(self, layer: dict[str, Any], h: np.ndarray, x: np.ndarray) -> np.ndarray:
        """The routed mixture of a MoE layer on normed input x, routed from the residual h."""
        hp, eps = self.hp, self.hp.rms_eps
        routed = ops.rms_norm(h, None, eps) * (np.float32(1.0 / np.sqrt(hp.n_embd)) * layer["router_scale"])
        chosen, weights = ops.moe_route_softmax_topk(ops.dense(routed, layer["router"]), hp.n_expert_used, True)
        if "expert_scale" in layer:
            weights = weights * layer["expert_scale"][chosen]
        down = layer["down_exps"]
        fe = down.shape[-1]

        def expert_weights(e: int) -> tuple[Weight, Weight, Weight]:
            if "gate_up_exps" in layer:
                both = layer["gate_up_exps"].expert(e)
                return both.row_range(0, fe), both.row_range(fe, 2 * fe), down.expert(e)
            return layer["gate_exps"].expert(e), layer["up_exps"].expert(e), down.expert(e)

        return ops.moe_gated_ffn(x, chosen, weights, expert_weights, self.activation)

    def block(self, i: int, x: np.ndarray, fp: ForwardPass) -> np.ndarray:
        layer, eps = self.layers[i], self.hp.rms_eps
        attn = self.self_attention(i, ops.rms_norm(x, layer["attn_norm"], eps), fp)
        h = x + ops.rms_norm(attn, layer["post_attention_norm"], eps)
        ffn = ops.gated_ffn(ops.rms_norm(h, layer["ffn_norm"], eps), layer["gate"], layer["up"], layer["down"],
                            self.activation)
        if "router" in layer:
            mixture = self.experts(layer, h, ops.rms_norm(h, layer["pre_ffw_norm_2"], eps))
            ffn = (ops.rms_norm(ffn, layer["post_ffw_norm_1"], eps)
                   + ops.rms_norm(mixture, layer["post_ffw_norm_2"], eps))
        out = h + ops.rms_norm(ffn, layer["post_ffw_norm"], eps)
        if fp.layer_inputs is not None:
            gated = ops.gelu_tanh(ops.linear(out, layer["ple_gate"])) * fp.layer_inputs[:, i]
            out = out + ops.rms_norm(ops.linear(gated, layer["ple_proj"]), layer["ple_norm"], eps)
        scale = self.output_scale(layer, fp)
        if scale is not None:
            out *= scale
        return out

    def output_scale(self, layer: dict[str, Any], fp: ForwardPass) -> np.ndarray | None:
        """What multiplies a layer's output (``layer_output_scale``; None: nothing)."""
        return layer.get("output_scale")

    def head_output(self, products: np.ndarray, start: int) -> np.ndarray:
        return ops.softcap(products, self.softcap)
