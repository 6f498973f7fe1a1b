"""The delta rule of linear attention (Gated DeltaNet), compiled: one sequence's new tokens
through every value head's state, heads in parallel.

Per head and token, with S the head's state [key size, value size]:
    S ← decay · S;  read = Sᵀk;  S ← S + k ⊗ β(v − read);  out = Sᵀq
done as two passes over S (the read, then the update fused with the output), each with the
value axis innermost so the state's rows are read contiguously.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def gated_delta_rule(state, q, k, v, decay, beta, out):
    """state [H, K, V] updated in place; q, k [T, H, K]; v, out [T, H, V]; decay, beta [T, H]."""
    steps, heads, key_size = k.shape
    value_size = v.shape[2]
    for h in prange(heads):
        s = state[h]
        read = np.empty(value_size, dtype=np.float32)
        for t in range(steps):
            d = decay[t, h]
            read[:] = 0.0
            for i in range(key_size):
                ki = k[t, h, i] * d
                for j in range(value_size):
                    read[j] += s[i, j] * ki
            b = beta[t, h]
            for j in range(value_size):
                read[j] = b * (v[t, h, j] - read[j])  # now the change each column takes
                out[t, h, j] = 0.0
            for i in range(key_size):
                ki, qi = k[t, h, i], q[t, h, i]
                for j in range(value_size):
                    updated = s[i, j] * d + ki * read[j]
                    s[i, j] = updated
                    out[t, h, j] += updated * qi
    return out
