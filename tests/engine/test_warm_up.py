"""A worker runs each kernel once before it serves (``Engine.warm_up``), so that no request waits
for numba to compile one: on a first start on a CPU that takes a minute or more, and a request
that triggered it held the engine, and every stream behind it, that long.

Checked in a fresh interpreter per family (a test process has compiled kernels already): after
``warm_up``, the forwards the scheduler makes (a prompt in chunks, decode batches of several
sequences, one sequence alone, over the KV type served) add no signature to any compiled
kernel. The interpreter never calls ``kernels.set_threads``, as a library user of the engine
might not: loading the model must start numba's threads itself, or a parallel kernel read from
the disk cache through a compiled caller crashes the process (see ``kernels.start_threads``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import ARCHS, write_tiny_gguf

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
import numba.core.registry
from worker.engine.loaded import Engine

def signatures():
    import sys as _sys
    found = {}
    for name, module in list(_sys.modules.items()):
        if not name.startswith("worker.engine.kernels"):
            continue
        for attr, value in vars(module).items():
            if isinstance(value, numba.core.registry.CPUDispatcher):
                found[f"{name}.{attr}"] = sorted(str(s) for s in value.signatures)
    return found

engine = Engine.load(sys.argv[1], kv_type=sys.argv[2])
engine.warm_up()
before = signatures()
caches = [engine.new_cache(64) for _ in range(3)]
engine.prefill(caches[0], list(range(20)), chunk=7)
engine.model.forward([(caches[1], [1, 2, 3, 4, 5])])
for step in range(3):
    engine.model.forward([(c, [step + 6]) for c in caches])
engine.model.forward([(caches[2], [9])])
after = signatures()
print(json.dumps({"before": before, "after": after}))
"""


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("arch", ARCHS)
def test_serving_compiles_nothing_after_the_warm_up(tmp_path, arch, kv_type):
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, arch, tensor_type="Q8_0")
    out = subprocess.run([sys.executable, "-c", PROBE, str(path), kv_type], cwd=REPO, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert any(seen["before"].values()), "the warm-up ran no compiled kernel"
    added = {name: sorted(set(sigs) - set(seen["before"].get(name, [])))
             for name, sigs in seen["after"].items() if set(sigs) - set(seen["before"].get(name, []))}
    assert added == {}, f"compiled after the warm-up: {added}"


def test_the_warm_up_leaves_no_kernel_team_on_the_calling_thread(tmp_path):
    """OpenMP keeps a team of threads per thread that ran a parallel kernel. The warm-up runs on
    the worker's main thread, the kernels later on its engine thread: a team left on the main
    thread put the engine's threads to sleep between kernels (a served step took three times as
    long). So its passes run on a thread that has ended when it returns."""
    import threading

    from worker.engine.loaded import Engine

    path = tmp_path / "llama.gguf"
    write_tiny_gguf(path, "llama", tensor_type="Q8_0")
    engine = Engine.load(path)
    ran_on: list[threading.Thread] = []
    forward = engine.model.forward

    def recording_forward(batch):
        ran_on.append(threading.current_thread())
        return forward(batch)

    engine.model.forward = recording_forward
    engine.warm_up()
    assert ran_on, "the warm-up ran no forward pass"
    assert all(thread is not threading.main_thread() and not thread.is_alive() for thread in ran_on)


PRODUCTS_PROBE = PROBE.split("engine = Engine.load")[0] + """
engine = Engine.load(sys.argv[1], kv_type=sys.argv[2])
engine.model.one_call_signatures()  # as a first start's warm-up reads them, before its forwards
engine.model.warm_products()
before = signatures()
engine.warm_up()
print(json.dumps({"before": before, "after": signatures()}))
"""


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_steps_compiled_while_attention_compiles_have_the_types_of_a_forward(tmp_path, arch):
    """On a first start the block steps that do not attend compile while the attention kernel
    compiles in its helper (``DecoderModel.warm_products``): worth it only if the forward passes
    then find them compiled, with no other signature of the same kernels. Nothing of the
    attention compiles here meanwhile: not its callers, nor its tasks, which reading the types
    of the one-call blocks' arguments once compiled here, twice over with the helpers'."""
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, arch, tensor_type="Q8_0")
    out = subprocess.run([sys.executable, "-c", PRODUCTS_PROBE, str(path), "f16"], cwd=REPO, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    warmed = {name: sigs for name, sigs in seen["before"].items() if sigs}
    assert {"worker.engine.kernels.fused.attention_inputs",
            "worker.engine.kernels.fused.attention_output", "worker.engine.kernels.fused.swiglu"} <= set(warmed)
    attention = {name for name in warmed if name.startswith("worker.engine.kernels.attention.")}
    assert attention == set(), attention  # the attention waits for its helpers
    grown = {name: sorted(set(seen["after"][name]) - set(sigs)) for name, sigs in warmed.items()
             if set(seen["after"][name]) - set(sigs)}
    assert grown == {}, f"the forward passes compiled other signatures of: {grown}"


LATER_PROBE = """
import json, sys
import numpy as np
from worker.engine.compile_ahead import forget, pending, steps_job
from worker.engine.kernels import fused
from worker.engine.loaded import Engine

engine = Engine.load(sys.argv[1])
model = engine.model
job = steps_job(engine.architecture, model.held_weights(), model.kv_type)
if sys.argv[2] == "first":
    forget(job)  # this combination's steps as on a first start (the leaf kernels may be cached)
heard = []
engine.warm_up(later=heard.append)
seen = {"one call at once": model.one_call_blocks, "thread": engine.compiling_later is not None}

def run():
    cache = engine.new_cache(64)
    return [engine.prefill(cache, list(range(1, 30)), chunk=16), model.forward([(cache, [5])])[0]]

meanwhile = run()
if engine.compiling_later is not None:
    engine.compiling_later.join(600)
after = run()
seen.update({"one call after": model.one_call_blocks, "marked": not pending(job), "heard": len(heard),
             "same": all(np.array_equal(a, b) for a, b in zip(meanwhile, after)),
             "finite": all(np.isfinite(a).all() for a in after), "one-call signatures": len(fused.dense_block.signatures)})
print(json.dumps(seen))
"""


def test_a_first_start_serves_before_the_one_call_blocks_compile_with_the_same_numbers(tmp_path):
    """A first start of a dense model's block steps leaves the one call that takes a sequence's
    whole block to a thread after the warm-up; the four calls serve meanwhile. The logits of a
    chunked prefill and a decode step are the same, to the bit, before and after it switches, and
    the steps are marked only then. A later start compiles nothing after its warm-up."""
    path = tmp_path / "llama.gguf"
    write_tiny_gguf(path, "llama", tensor_type="Q8_0")

    def start(kind: str) -> dict:
        out = subprocess.run([sys.executable, "-c", LATER_PROBE, str(path), kind], cwd=REPO, capture_output=True,
                             text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = start("first")
    assert first == {"one call at once": False, "thread": True, "one call after": True, "marked": True, "heard": 1,
                     "same": True, "finite": True, "one-call signatures": 1}
    again = start("again")
    assert again["thread"] is False and again["one call at once"] is True and again["heard"] == 0
    assert again["same"] and again["marked"] and again["one-call signatures"] == 1
