"""A first start on a CPU: the leaf kernels compiled by helper processes, marked, and not again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from worker.engine import kernels
from worker.engine.compile_ahead import (HELPER, QUANTIZERS_COST, describe, job_cost, leaf_jobs, pending, shares,
                                         steps_job)
from worker.engine.kernels.attention import TILED

Q = GGMLQuantizationType
TASKS = ["attention-loops:f16", "attention-tiles:f16"]  # the attention's tasks, beside their callers' job


def attention_jobs(kv_type: str) -> list[str]:
    """What a first start compiles of the attention on this CPU: the tile task only where it has the unit."""
    return [f"attention-loops:{kv_type}"] + [f"attention-tiles:{kv_type}"] * TILED + [f"attention:{kv_type}"]


pytestmark = pytest.mark.skipif(not kernels.available(), reason="the kernels need AVX2, FMA and F16C")


def test_the_jobs_say_what_a_file_needs():
    jobs = ["attention:f16", "gemm:Q4_K", "gemm:Q6_K"]
    assert describe(jobs) == "attention over an f16 cache, Q4_K and Q6_K matrices"
    assert describe(["gemm:Q8_0"]) == "Q8_0 matrices"
    assert describe(["attention:f32", "gemm:Q5_0", "gemm:Q8_0", "gemm:Q4_K"]) == \
        "attention over an f32 cache, Q5_0, Q8_0 and Q4_K matrices"
    assert describe(["gemm:Q8_0", "steps:qwen3-037fd4a7c95a"]) == \
        "Q8_0 matrices, the qwen3 block steps for these weight types"
    assert describe(["attention:f16", "gemm:Q4_1", "rows:Q8_0"]) == \
        "attention over an f16 cache, Q4_1 matrices, Q8_0 matrices without the tile loop"
    assert describe([*TASKS, "attention:f16", "gemm:Q8_0"]) == "attention over an f16 cache, Q8_0 matrices"


def test_the_block_steps_are_one_job_per_architecture_weight_types_and_cache_type(default_model):
    from worker.engine import Engine

    held = Engine.load(default_model).model.held_weights()
    job = steps_job("llama", held, "f16")
    assert job.startswith("steps:llama-") and job == steps_job("llama", list(reversed(held)), "f16")
    assert steps_job("llama", held, "f32") != job  # the attention steps take the cache's arrays
    assert steps_job("qwen3", held, "f16").partition("-")[2] == job.partition("-")[2]
    without_q8 = [w for w in held if getattr(w, "qtype", None) != Q.Q8_0]
    assert 0 < len(without_q8) < len(held)
    assert steps_job("llama", without_q8, "f16") != job  # a file without one of these weight types


@pytest.mark.parametrize("jobs", [
    [*TASKS, "attention:f16", "gemm:Q5_0", "rows:Q8_0", "gemm:Q4_K", "gemm:Q6_K"],  # gemma-3-270m Q4_K_M
    [*TASKS, "attention:f16", "gemm:Q4_1", "rows:Q8_0"],  # SmolLM2 Q4_1: a Q8_0 head over Q4_1 layers
    [*TASKS, "attention:f16", "gemm:Q8_0"],  # a Qwen3-0.6B-shaped Q8_0 file
    ["attention-loops:f32", "attention:f32", "gemm:Q4_0", "gemm:Q4_1", "gemm:Q5_0", "gemm:Q5_1", "gemm:Q8_0",
     "gemm:Q4_K", "gemm:Q6_K"],  # a CPU without the tile unit: no tile task
    ["gemm:Q5_0", "gemm:Q8_0"],  # attention compiled already
    ["attention-loops:f32", "attention:f32"],
])
@pytest.mark.parametrize("cores", [1, 2, 3, 8])
def test_the_helpers_share_the_jobs_by_what_they_cost_matrices_first(jobs, cores):
    helpers = shares(jobs, cores)
    assert sorted(job for share in helpers for job in share) == sorted(jobs)  # each job once
    assert len(helpers) == min(cores, len(jobs)) and all(helpers)  # never an idle helper
    for share in helpers:  # a helper's GEMMs before its attention: the steps around them start sooner
        attention = [job.startswith("attention") for job in share]
        assert attention == sorted(attention)
    loads = [sum(map(job_cost, share)) for share in helpers]
    assert max(loads) - min(loads) <= max(map(job_cost, jobs)) + QUANTIZERS_COST  # balanced, as well as jobs allow


def test_the_attention_tasks_cost_the_most_and_their_callers_little():
    """The float32 task is the costliest job; the callers, which call the tasks where they are
    compiled rather than link them in, cost less than a GEMM."""
    assert job_cost("attention-loops:f16") > job_cost("attention-tiles:f16") > job_cost("attention:f16") > 0
    assert job_cost("attention-loops:f16") > job_cost("gemm:Q4_K") == job_cost("rows:Q8_0") > job_cost("attention:f16")
    assert shares([*TASKS, "attention:f16", "gemm:Q4_K"], 2) == [["attention-loops:f16", "attention:f16"],
                                                                 ["gemm:Q4_K", "attention-tiles:f16"]]
    assert shares([*TASKS, "attention:f16", "gemm:Q4_1", "rows:Q8_0"], 1) == \
        [["gemm:Q4_1", "rows:Q8_0", *TASKS, "attention:f16"]]


def test_a_helper_compiles_and_marks_so_a_later_start_asks_for_nothing(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    probe = ("from gguf import GGMLQuantizationType as Q; from worker.engine.compile_ahead import leaf_jobs; "
             "print(' '.join(leaf_jobs({Q.Q4_0: 4096}, None, 'f32')))")

    def missing() -> list[str]:
        return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                              check=True).stdout.split()

    attention = attention_jobs("f32")
    assert missing() == attention + ["gemm:Q4_0"]
    subprocess.run([sys.executable, "-c", HELPER, "gemm:Q4_0"], env=env, check=True, timeout=600)
    assert missing() == attention  # marked: a later start spawns nothing for it
    marks = [name for _, _, names in os.walk(tmp_path) for name in names if name.startswith("compiled-")]
    assert len(marks) == 1 and marks[0].endswith("gemm-Q4_0")


def test_a_warm_cache_spawns_no_helper(default_model):
    from worker.engine import Engine

    first = Engine.load(default_model)
    first.warm_up()
    assert not pending(steps_job(first.architecture, first.model.held_weights(), first.model.kv_type))
    again = Engine.load(default_model)
    assert again.compiling is not None and again.compiling.jobs == [] and not again.compiling.processes
    assert leaf_jobs({Q.Q4_1: 4096}, Q.Q8_0, "f16") == []
    heard = []
    again.warm_up(on_compile=heard.append)
    assert heard == []  # neither a leaf kernel nor the block steps of these types compile again


def test_the_compiler_gives_back_its_pages_and_the_kernels_still_run(default_model):
    from worker.engine import Engine

    engine = Engine.load(default_model)
    engine.warm_up()
    assert kernels.page_out_compiler() > 0  # LLVM's read-only pages, advised away
    cache = engine.new_cache(8)
    assert engine.model.forward([(cache, [1, 2, 3])])[0].shape == (engine.model.hp.n_vocab,)


def test_the_tile_loop_compiles_only_for_a_type_that_holds_most_of_the_layers():
    """A type's GEMM takes the tile loop only where the type holds at least half of the layers'
    weights: not for a head (left out of the layers), nor for a few matrices among other types."""
    from worker.engine.weights import kernel_kind

    gemma = {Q.Q5_0: 81, Q.Q4_K: 27, Q.Q8_0: 9, Q.Q6_K: 9}  # gemma-3-270m Q4_K_M's matrices, by count
    assert kernel_kind(Q.Q8_0, gemma) == "rows"
    assert kernel_kind(Q.Q8_0, {Q.Q8_0: 196}) == "gemm" and kernel_kind(Q.Q8_0, {Q.Q8_0: 5, Q.Q4_K: 5}) == "gemm"
    assert kernel_kind(Q.Q8_0, {Q.Q4_1: 210}) == "rows"  # SmolLM2's Q8_0 head over Q4_1 layers
    assert kernel_kind(Q.Q8_0, {}) == "rows"  # a head over float layers
    assert all(kernel_kind(t, gemma) == "gemm" for t in (Q.Q5_0, Q.Q4_K, Q.Q6_K))  # no other kernel for them


def test_a_head_whose_type_no_layer_shares_takes_the_gemm_without_tiles(default_model, tmp_path):
    """SmolLM2's head (its embedding, tied) is Q8_0 over Q4_1 layers: it meets a few rows at a
    time and takes the Q8_0 GEMM without the tile loop, which alone compiles for it, named by
    its panels' record type."""
    from worker.engine import Engine
    from worker.engine.gguf_file import GGUFFile
    from worker.engine.weights import FEW_ROWS_KERNELS, GEMM_KERNELS

    gguf = GGUFFile(default_model)
    assert set(gguf.matrix_weights()) == {Q.Q4_1} and gguf.head_type() == Q.Q8_0
    model = Engine.load(default_model).model
    assert model.output.kernel is FEW_ROWS_KERNELS[Q.Q8_0] and model.output.panels.dtype.names == ("q8_0_rows",)
    assert all(w.kernel is GEMM_KERNELS[w.qtype] for w in model.held_weights() if w is not model.output
               and hasattr(w, "kernel"))

    probe = ("import sys; from worker.engine.gguf_file import GGUFFile; from worker.engine.compile_ahead import leaf_jobs; "
             "g = GGUFFile(sys.argv[1]); print(' '.join(leaf_jobs(g.matrix_weights(), g.head_type(), 'f16')))")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    jobs = subprocess.run([sys.executable, "-c", probe, str(default_model)], env=env, capture_output=True, text=True,
                          check=True).stdout.split()
    assert jobs == attention_jobs("f16") + ["gemm:Q4_1", "rows:Q8_0"]


@pytest.mark.parametrize("tied", [True, False])
def test_the_head_of_a_file_is_its_own_weight_or_the_embedding_it_is_tied_to(tmp_path, tied):
    """The layers' types leave out the embedding and the head: a head of its own is
    ``output.weight`` (the embedding beside it is only looked up); a tied head the embedding."""
    import gguf as gguf_lib

    from worker.engine.gguf_file import GGUFFile

    rng = np.random.default_rng(3)
    types = {"token_embd.weight": Q.Q6_K, "blk.0.attn_q.weight": Q.Q4_K, "blk.0.ffn_down.weight": Q.Q5_0}
    if not tied:
        types["output.weight"] = Q.Q8_0
    path = tmp_path / "heads.gguf"
    writer = gguf_lib.GGUFWriter(str(path), "llama")
    for name, qtype in types.items():
        block, size = gguf_lib.GGML_QUANT_SIZES[qtype]
        writer.add_tensor(name, rng.integers(0, 256, (64, 256 // block * size), dtype=np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile(path)
    assert file.matrix_weights() == {Q.Q4_K: 64 * 256, Q.Q5_0: 64 * 256}
    assert file.head_type() == (Q.Q6_K if tied else Q.Q8_0)


ATTEND_PROBE = """
import json
import numpy as np
from worker.engine import kernels
from worker.engine.kernels import attention
from worker.engine.kv_cache import KVCache

kernels.start_threads()
cache = KVCache(1, 2, 32, 64, 32, "f16")
rng = np.random.default_rng(0)
for tokens, prompt in ((20, True), (1, False)):  # a prompt's rows (the tile task here), a decode step's
    cache.prompt_end = cache.length + tokens if prompt else 0
    q = rng.standard_normal((tokens, 4, 32), dtype=np.float32)
    k, v = (rng.standard_normal((tokens, 2, 32), dtype=np.float32) for _ in range(2))
    out = np.empty((tokens, 4 * 32), dtype=np.float32)
    cache.reserve(tokens)
    cache.store_and_attend(0, q, k, v, 0.125, 0, out)
    assert np.isfinite(out).all()
    cache.commit(list(range(tokens)))
kernels_ = [attention._attend_task, attention.store_and_attend]  # causal_attention comes linked into its caller
kernels_ += [attention._attend_task_tiles] if attention.TILED else []
print(json.dumps({k.__name__: [sum(k.stats.cache_hits.values()), sum(k.stats.cache_misses.values())]
                  for k in kernels_}))
"""


def test_the_attention_jobs_compile_what_the_cache_calls_each_on_its_own(tmp_path):
    """The attention's callers compile without their tasks (they call them where those are
    compiled), so each job compiles in any helper in any order, the callers' first here; a
    process that then attends over an f16 cache, a prompt's rows and a decode step, loads
    every one of them from numba's cache and compiles none."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    jobs = ["attention:f16", "attention-loops:f16"] + ["attention-tiles:f16"] * TILED
    for job in jobs:
        subprocess.run([sys.executable, "-c", HELPER, job], env=env, check=True, timeout=600)
    out = subprocess.run([sys.executable, "-c", ATTEND_PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert {name: misses for name, (_, misses) in loaded.items() if misses} == {}  # nothing compiled afresh
    assert all(hits >= 1 for hits, _ in loaded.values()), loaded
