"""The shared toolkit every architecture file builds its forward pass from.

Small functions on float32 arrays; the heavy ones (products with the weights, attention,
norms, RoPE) call the compiled kernels of ``kernels/``. ``attend`` is a layer's attention for
every sequence of a forward pass, each over its own cache: a family's block calls it once.
Shapes in comments use: T tokens, D model width, H query heads, K key/value heads, G = H // K
query heads per KV head, d head dim, L keys.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from worker.engine import kernels
from worker.engine.kernels import attention, rowwise
from worker.engine.kv_cache import kernel_view, key_runs
from worker.engine.weights import DenseWeight, MatmulInput, Weight

if TYPE_CHECKING:
    from worker.engine.model import ForwardPass

_NO_WEIGHT = np.zeros(0, dtype=np.float32)


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """x / sqrt(mean(x²) + eps) * weight over the last axis."""
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    out = rowwise.rms_norm(rows, _NO_WEIGHT if weight is None else weight, eps, np.empty_like(rows))
    return out.reshape(x.shape)


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """tanh(x / cap) · cap: x squashed smoothly into (−cap, cap); a cap of 0 leaves x as it is."""
    if not cap:
        return x
    return np.tanh(x / np.float32(cap)) * np.float32(cap)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = x - np.max(x, axis=axis, keepdims=True)
    exps = np.exp(shifted)
    return exps / np.sum(exps, axis=axis, keepdims=True)


def log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = x - np.max(x, axis=axis, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def linear(x: np.ndarray | MatmulInput, weight: Weight, bias: np.ndarray | None = None) -> np.ndarray:
    """y = x @ Wᵀ (+ b); W is (n_out, n_in) as GGUF stores it. [T, n_in] -> [T, n_out]"""
    y = weight.times_transposed(x)
    return y + bias if bias is not None else y


def dense(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ wᵀ for a small float32 matrix w [n_out, n_in] (a router, a gate): each row of x on its
    own, as in every other product of the forward pass (numpy's BLAS would sum a row
    differently by how many rows come with it). [T, n_in] -> [T, n_out]"""
    return DenseWeight(w).times_transposed(x)


# --- rotary position embedding -------------------------------------------------------------

def rope_inverse_frequencies(n_rot: int, base: float, freq_scale: float = 1.0,
                             freq_factors: np.ndarray | None = None) -> np.ndarray:
    """Angle per position for each rotated pair: freq_scale * base^(-2i/n_rot) [/ factor_i]."""
    exponents = np.arange(0, n_rot, 2, dtype=np.float64) / n_rot
    inv = freq_scale / np.power(base, exponents)
    if freq_factors is not None:
        inv = inv / freq_factors.astype(np.float64)
    return inv  # [n_rot/2]


def rope_cos_sin(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    angles = np.outer(positions.astype(np.float64), inv_freq)  # [T, n_rot/2]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, adjacent: bool = False) -> np.ndarray:
    """Rotate pairs (i, i + n_rot/2) of each head, or (2i, 2i + 1) with ``adjacent`` (llama's
    GGUF Q/K rows are ordered for that form); dims past n_rot pass through.

    x [T, heads, d]; cos/sin [T, n_rot/2]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return rowwise.rope(x, cos, sin, adjacent, np.empty_like(x))


# --- attention -------------------------------------------------------------------------------

SCORES_BUDGET = 32 << 20  # bytes of attention scores computed at once (a block of queries)
_scratch = threading.local()


def _scores_buffer(size: int) -> np.ndarray:
    """A reused float32 buffer of at least ``size`` elements: a fresh array this large every
    layer would spend more time in page faults than in the matmul that fills it."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.size < size:
        buffer = _scratch.buffer = np.empty(size, dtype=np.float32)
    return buffer[:size]


def attend(q: np.ndarray, k: np.ndarray | None, v: np.ndarray | None, fp: ForwardPass, layer: int,
           scale: float, window: int = 0, softcap: float = 0.0, bias: np.ndarray | None = None,
           compiled: bool = False) -> np.ndarray:
    """A layer's attention for every sequence of a forward pass, each over its own cache.

    q [T, H, d] holds the pass's stacked rows (sequence s at rows ``fp.spans[s]``); k [T, K, d]
    and v [T, K, dv] are their keys and values, written into each cache's ``layer`` after
    what it holds before they are read. With k and v None the layer reads what an earlier
    layer of the pass wrote there (a layer sharing another's KV). The scores are scaled by
    ``scale``; ``window`` > 0 hides keys that many positions back or more; ``softcap`` > 0 takes
    each score s to tanh(s / softcap) · softcap. Returns [T, H*dv].

    - ``bias`` [T, H, E]: a learned bias per backward distance 0 … E − 1 on each row's
      scores (``masked_attention``);
    - ``compiled``: the store and the attention of each sequence in one compiled call (rows
      float32, C-ordered, of head sizes the compiled kernel takes);
    - a canvas pass (``fp.canvas``): the rows see each other both ways and the cache's keys
      before them (the last window − 1 of them with a window); nothing is written.
    """
    if softcap and (bias is not None or fp.canvas):
        raise ValueError("a soft cap is for causal attention without a bias")
    if fp.canvas and k is None:
        raise ValueError("a canvas attends over its own keys and values: it needs k and v")
    value_dim = (v if v is not None else fp.caches[0].values[layer]).shape[-1]
    out = np.empty((q.shape[0], q.shape[1] * value_dim), dtype=np.float32)
    for cache, (start, end) in zip(fp.caches, fp.spans):
        rows, first = slice(start, end), cache.length
        if fp.canvas:
            oldest = max(0, first - (window - 1)) if window else 0  # the first cached position it sees
            keys = np.concatenate([cache.key_rows(layer, oldest, first).astype(np.float32, copy=False),
                                   k[rows].transpose(1, 0, 2)], axis=1)
            values = np.concatenate([cache.values[layer][:, oldest:first].astype(np.float32, copy=False),
                                     v[rows].transpose(1, 0, 2)], axis=1)
            out[rows] = masked_attention(q[rows], keys, values, 0, scale, causal=False)
        elif compiled:
            cache.store_and_attend(layer, q[rows], k[rows], v[rows], scale, window, out[rows], softcap)
        else:
            if k is not None:
                cache.write(layer, k[rows], v[rows])
            seen = first + end - start
            values = cache.values[layer][:, :seen]
            if bias is not None:
                out[rows] = masked_attention(q[rows], cache.key_rows(layer, 0, seen), values, first, scale, window,
                                             bias[rows])
            elif _compiled_attention(q.shape[-1], values.shape[-1]):  # the cache's runs as they are
                values = kernel_view(values)
                out[rows] = attention.causal_attention(np.ascontiguousarray(q[rows], dtype=np.float32),
                                                       kernel_view(cache.keys[layer]), values, first,
                                                       np.float32(scale), window, np.float32(softcap),
                                                       np.empty((end - start, q.shape[1] * values.shape[-1]),
                                                                dtype=np.float32), cache.prompt_rows(end - start),
                                                       attention.task_addresses(values.dtype))
            else:
                out[rows] = causal_attention(q[rows], cache.key_rows(layer, 0, seen), values, first, scale,
                                             window or None, softcap or None)
    return out


def _compiled_attention(head_dim: int, value_dim: int) -> bool:
    """Whether the compiled attention takes heads of these sizes on this CPU."""
    return head_dim % 8 == 0 and value_dim % 16 == 0 and kernels.available()


def causal_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, first_pos: int,
                     scale: float, window: int | None = None,
                     softcap: float | None = None) -> np.ndarray:
    """Attention of T new queries over L cached keys (the new ones included, last).

    q [T, H, d]; keys [K, L, d], values [K, L, dv] (float32 or float16) with L = first_pos + T. Query i (at position
    first_pos + i) sees key j iff j <= first_pos + i and, with a sliding window, iff
    first_pos + i - j < window. Query head h reads KV head h // G. Returns [T, H*dv].

    Head sizes that are multiples of 8 (values: 16), on a CPU with AVX2, take the compiled
    online-softmax kernel (``kernels/attention.py``), whose result for a query does not depend
    on the other queries of the call, so a prompt's KV is the same computed in one chunk or
    several. Other sizes take numpy's batched products: queries go in blocks whose scores fit
    SCORES_BUDGET, computed in place in one reused buffer; without a window only the block's
    last keys can be hidden, so only those are masked. The softmax's division is applied to
    the block's output rows (dv wide) instead of its scores.
    """
    n_tokens, n_head, head_dim = q.shape
    n_kv, n_keys, _ = keys.shape
    value_dim = values.shape[-1]
    if _compiled_attention(head_dim, value_dim):
        out, values = np.empty((n_tokens, n_head * value_dim), dtype=np.float32), kernel_view(values)
        return attention.causal_attention(np.ascontiguousarray(q, dtype=np.float32), kernel_view(key_runs(keys)),
                                          values, first_pos, np.float32(scale), window or 0,
                                          np.float32(softcap or 0.0), out, False,
                                          attention.task_addresses(values.dtype))
    keys, values = keys.astype(np.float32, copy=False), values.astype(np.float32, copy=False)
    group = n_head // n_kv
    keys_t = keys.transpose(0, 2, 1)
    # the scale (and a softcap's division) go on the queries, far fewer than the scores
    q = q * np.float32(scale if softcap is None else scale / softcap)
    # rows ordered (query, head in group) per KV head, so a block of queries is a row range
    rows = np.ascontiguousarray(q.reshape(n_tokens, n_kv, group, head_dim).transpose(1, 0, 2, 3))
    rows = rows.reshape(n_kv, n_tokens * group, head_dim)
    out = np.empty((n_kv, n_tokens * group, value_dim), dtype=np.float32)
    block = max(1, min(n_tokens, SCORES_BUDGET // (4 * n_kv * group * n_keys)))
    buffer = _scores_buffer(n_kv * block * group * n_keys)
    for t0 in range(0, n_tokens, block):
        t1 = min(n_tokens, t0 + block)
        span = slice(t0 * group, t1 * group)
        scores = buffer[:n_kv * (t1 - t0) * group * n_keys].reshape(n_kv, (t1 - t0) * group, n_keys)
        np.matmul(rows[:, span], keys_t, out=scores)
        if softcap is not None:  # capped before the mask: a hidden key's score stays −inf (tanh would make it −1)
            np.tanh(scores, out=scores)
            np.multiply(scores, np.float32(softcap), out=scores)
        query_pos = first_pos + np.arange(t0, t1)[:, None]
        # keys before the block's first query are visible to all of it unless a window hides them
        lo = 0 if window is not None else min(n_keys, first_pos + t0 + 1)
        key_pos = np.arange(lo, n_keys)[None, :]
        hidden = key_pos > query_pos
        if window is not None:
            hidden |= (query_pos - key_pos) >= window
        if hidden.any():
            tail = scores.reshape(n_kv, t1 - t0, group, n_keys)[..., lo:]
            tail[np.broadcast_to(hidden[None, :, None, :], tail.shape)] = -np.inf
        totals = _exp_in_place(scores)
        np.matmul(scores, values, out=out[:, span])
        np.divide(out[:, span], totals, out=out[:, span])
    return out.reshape(n_kv, n_tokens, group, value_dim).transpose(1, 0, 2, 3).reshape(n_tokens, n_head * value_dim)


def masked_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, first_pos: int, scale: float,
                     window: int = 0, bias: np.ndarray | None = None, causal: bool = True) -> np.ndarray:
    """Attention of T queries over L keys in plain numpy, for what the compiled kernel does not
    take: a bias per backward distance, or queries that see every key.

    q [T, H, d]; keys, values [K, L, d] (float32 or float16; query head h reads KV head
    h // (H / K)). Causal: query t, at position first_pos + t, sees key j iff j ≤ its position
    and, with a window, iff position − j < window; otherwise every query sees every key. With
    ``bias`` [T, H, E], query t's score of a key at distance 0 ≤ p − j < E gains bias[t, h, p − j].
    Queries go in blocks whose scores fit SCORES_BUDGET, over the keys the block can see.
    Returns [T, H*d]."""
    n_tokens, n_head, head_dim = q.shape
    n_kv, n_keys, value_dim = values.shape
    group = n_head // n_kv
    q = q * np.float32(scale)
    out = np.empty((n_tokens, n_head, value_dim), dtype=np.float32)
    t0 = 0
    while t0 < n_tokens:
        lo = max(0, first_pos + t0 - window + 1) if causal and window else 0
        seen = (first_pos + n_tokens if causal else n_keys) - lo
        block = max(1, min(n_tokens - t0, SCORES_BUDGET // (4 * n_head * max(1, seen))))
        t1 = t0 + block
        hi = first_pos + t1 if causal else n_keys
        k_b = keys[:, lo:hi].astype(np.float32, copy=False)
        v_b = values[:, lo:hi].astype(np.float32, copy=False)
        q_b = q[t0:t1].reshape(t1 - t0, n_kv, group, head_dim)
        scores = np.einsum("tkgd,kld->tkgl", q_b, k_b).reshape(t1 - t0, n_head, hi - lo)
        distance = (first_pos + np.arange(t0, t1))[:, None] - np.arange(lo, hi)[None, :]  # [Tb, Lb]
        if bias is not None:
            extent = bias.shape[-1]
            near = (distance >= 0) & (distance < extent)
            index = np.broadcast_to(np.clip(distance, 0, extent - 1)[:, None, :], scores.shape)
            scores += np.where(near[:, None, :], np.take_along_axis(bias[t0:t1], index, axis=-1), 0.0)
        if causal:
            hidden = distance < 0
            if window:
                hidden |= distance >= window
            scores[np.broadcast_to(hidden[:, None, :], scores.shape)] = -np.inf
        weights = softmax(scores, axis=-1).reshape(t1 - t0, n_kv, group, hi - lo)
        out[t0:t1] = np.einsum("tkgl,kld->tkgd", weights, v_b).reshape(t1 - t0, n_head, value_dim)
        t0 = t1
    return out.reshape(n_tokens, n_head * value_dim)


def _exp_in_place(scores: np.ndarray) -> np.ndarray:
    """Scaled (and capped) scores -> the softmax's numerators, in place; returns their sums over
    the keys, by which the caller divides the attention output."""
    np.subtract(scores, scores.max(axis=-1, keepdims=True), out=scores)
    np.exp(scores, out=scores)
    return scores.sum(axis=-1, keepdims=True)


def causal_conv(state: np.ndarray, rows: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A causal depthwise convolution of new rows [T, C] with weight [C, K], continuing from the
    last K − 1 inputs ``state`` [K − 1, C]; returns the output [T, C] and the new state."""
    t, k_size = rows.shape[0], weight.shape[1]
    window = np.concatenate([state, rows])  # the last K − 1 inputs, then the new ones
    return sum(window[j:j + t] * weight[:, j] for j in range(k_size)), window[t:].copy()


# --- feed-forward ----------------------------------------------------------------------------

def gated_ffn(x: np.ndarray, gate: Weight, up: Weight, down: Weight, activation: str = "silu") -> np.ndarray:
    """down(act(gate x) * up x) with act SiLU or tanh-approximated GELU. [T, D] -> [T, D]"""
    h = MatmulInput(x)  # quantized once for both projections
    g = linear(h, gate)
    u = linear(h, up)
    if activation == "silu":
        t = silu(g)
        t *= u
    elif kernels.available() and g.dtype == u.dtype == np.float32 and g.flags.c_contiguous and u.flags.c_contiguous:
        t = rowwise.gelu_tanh_times(g, u, g)  # one pass, not numpy's nine
    else:
        t = gelu_tanh(g)
        t *= u
    return linear(t, down)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x), without overflow for large x."""
    return np.logaddexp(np.float32(0.0), x).astype(np.float32)


def silu(g: np.ndarray) -> np.ndarray:
    """g / (1 + e^-g) in a new array: numpy's exp is vectorized, a compiled loop's would call
    libm per value."""
    t = np.negative(g)
    with np.errstate(over="ignore"):  # exp(-g) = inf for g << 0 gives silu = -0, as it should
        np.exp(t, out=t)
    t += 1.0
    np.divide(g, t, out=t)
    return t


def gelu_tanh(g: np.ndarray) -> np.ndarray:
    """0.5 g (1 + tanh(√(2/π) (g + 0.044715 g³))) in a new array."""
    t = g * g
    t *= np.float32(0.044715)
    t += 1.0
    t *= g
    t *= np.float32(np.sqrt(2.0 / np.pi))
    np.tanh(t, out=t)
    t += 1.0
    t *= g
    t *= np.float32(0.5)
    return t


def moe_route_softmax_topk(router_logits: np.ndarray, n_used: int,
                           renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over experts, keep the top n_used; weights optionally renormalized to sum 1.

    router_logits [T, E] -> (expert ids [T, k], weights [T, k]).
    """
    probs = softmax(router_logits, axis=-1)
    top = np.argpartition(-probs, n_used - 1, axis=-1)[:, :n_used]
    weights = np.take_along_axis(probs, top, axis=-1)
    if renormalize:
        weights = weights / np.maximum(weights.sum(axis=-1, keepdims=True), 6.1e-5)
    return top, weights


def moe_gated_ffn(x: np.ndarray, experts: np.ndarray, weights: np.ndarray,
                  expert_weights: Callable[[int], tuple[Weight, Weight, Weight]],
                  activation: str = "silu") -> np.ndarray:
    """Weighted sum of the chosen experts' gated FFN outputs.

    x [T, D]; experts/weights [T, k]; ``expert_weights(e)`` gives expert e's gate, up [F, D] and
    down [D, F]. Loops over the experts in use (not over tokens): each runs once on its rows,
    and only their blocks of the stacks are read.
    """
    out = np.zeros_like(x)
    for expert in np.unique(experts):
        rows, slot = np.nonzero(experts == expert)
        y = gated_ffn(x[rows], *expert_weights(int(expert)), activation)
        np.add.at(out, rows, y * weights[rows, slot][:, None])
    return out
