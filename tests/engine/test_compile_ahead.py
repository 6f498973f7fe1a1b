"""A first start on a CPU: the leaf kernels compiled by helper processes, marked, and not again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType

from worker.engine import kernels
from worker.engine.compile_ahead import HELPER, describe, leaf_jobs, pending, shares, steps_job

Q = GGMLQuantizationType
pytestmark = pytest.mark.skipif(not kernels.available(), reason="the kernels need AVX2, FMA and F16C")


def test_the_jobs_say_what_a_file_needs():
    jobs = ["attention:f16", "gemm:Q4_K", "gemm:Q6_K"]
    assert describe(jobs) == "attention over an f16 cache, Q4_K and Q6_K matrices"
    assert describe(["gemm:Q8_0"]) == "Q8_0 matrices"
    assert describe(["attention:f32", "gemm:Q5_0", "gemm:Q8_0", "gemm:Q4_K"]) == \
        "attention over an f32 cache, Q5_0, Q8_0 and Q4_K matrices"
    assert describe(["gemm:Q8_0", "steps:qwen3-037fd4a7c95a"]) == \
        "Q8_0 matrices, the qwen3 block steps for these weight types"


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


def test_the_attention_kernel_has_a_helper_to_itself_and_the_gemms_share_the_rest():
    jobs = ["attention:f16", "gemm:Q5_0", "gemm:Q8_0", "gemm:Q4_K", "gemm:Q6_K"]
    assert shares(jobs, 2) == [["attention:f16"], ["gemm:Q5_0", "gemm:Q8_0", "gemm:Q4_K", "gemm:Q6_K"]]
    assert shares(jobs, 3) == [["attention:f16"], ["gemm:Q5_0", "gemm:Q4_K"], ["gemm:Q8_0", "gemm:Q6_K"]]
    assert shares(jobs, 1) == [jobs]  # one core: one helper for all
    # attention compiled already: the GEMMs spread over every core; never more helpers than jobs
    assert shares(jobs[1:3], 4) == [["gemm:Q5_0"], ["gemm:Q8_0"]]
    assert shares(["attention:f32"], 2) == [["attention:f32"]]
    assert sorted(job for share in shares(jobs, 8) for job in share) == sorted(jobs)


def test_a_helper_compiles_and_marks_so_a_later_start_asks_for_nothing(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    probe = ("from gguf import GGMLQuantizationType as Q; from worker.engine.compile_ahead import leaf_jobs; "
             "print(' '.join(leaf_jobs({Q.Q4_0}, 'f32')))")

    def missing() -> list[str]:
        return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                              check=True).stdout.split()

    assert missing() == ["attention:f32", "gemm:Q4_0"]
    subprocess.run([sys.executable, "-c", HELPER, "gemm:Q4_0"], env=env, check=True, timeout=600)
    assert missing() == ["attention:f32"]  # marked: a later start spawns nothing for it
    marks = [name for _, _, names in os.walk(tmp_path) for name in names if name.startswith("compiled-")]
    assert len(marks) == 1 and marks[0].endswith("gemm-Q4_0")


def test_a_warm_cache_spawns_no_helper(default_model):
    from worker.engine import Engine

    first = Engine.load(default_model)
    first.warm_up()
    assert not pending(steps_job(first.architecture, first.model.held_weights(), first.model.kv_type))
    again = Engine.load(default_model)
    assert again.compiling is not None and again.compiling.jobs == [] and not again.compiling.processes
    assert leaf_jobs({Q.Q4_1, Q.Q8_0}, "f16") == []
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
