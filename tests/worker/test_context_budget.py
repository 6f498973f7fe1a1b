"""The default context: the model's trained one, cut down when the KV of every slot would not fit."""

from __future__ import annotations

import logging

import pytest

from worker.engine import Engine
from worker.main import KV_MEMORY_SHARE, context_budget


@pytest.fixture(scope="module")
def engine(default_model):
    return Engine.load(default_model)


def test_the_trained_context_when_it_fits(engine, caplog):
    per_slot = engine.new_cache(1).bytes_per_token * engine.model.hp.context_length
    with caplog.at_level(logging.WARNING):
        ctx = context_budget(engine, 4, int(4 * per_slot / KV_MEMORY_SHARE) + 1, logging.getLogger("t"))
    assert ctx == engine.model.hp.context_length == 8192
    assert not caplog.records


def test_a_smaller_context_and_a_log_line_when_it_does_not(engine, caplog):
    per_token = engine.new_cache(1).bytes_per_token
    memory = int(2 * 3000 * per_token / KV_MEMORY_SHARE)  # two slots of 3,000 tokens
    with caplog.at_level(logging.WARNING):
        ctx = context_budget(engine, 2, memory, logging.getLogger("t"))
    assert ctx == 3000
    assert "--ctx 3000 instead of the trained 8192" in caplog.text


def test_kv_slots_by_default_are_what_the_memory_share_holds(engine, caplog):
    from worker.main import AUTO_SLOTS, slots_and_context

    full = engine.new_cache(1).full_bytes(2048)
    log = logging.getLogger("t")
    with caplog.at_level(logging.INFO):
        slots, ctx = slots_and_context(engine, 0, 1, 2048, int(10 * full / KV_MEMORY_SHARE), log)
    assert (slots, ctx) == (10, 2048)
    assert "--kv-slots 10: resident caches of up to 2048 tokens" in caplog.text
    # never fewer than four (nor than --batch), never more than sixteen
    assert slots_and_context(engine, 0, 1, 2048, int(2 * full / KV_MEMORY_SHARE), log)[0] == AUTO_SLOTS[0] == 4
    assert slots_and_context(engine, 0, 6, 2048, int(2 * full / KV_MEMORY_SHARE), log)[0] == 6
    assert slots_and_context(engine, 0, 1, 2048, int(100 * full / KV_MEMORY_SHARE), log)[0] == AUTO_SLOTS[1] == 16
    # asked for: as asked (raised to --batch)
    assert slots_and_context(engine, 1, 1, 2048, 1 << 40, log) == (1, 2048)
    assert slots_and_context(engine, 1, 3, 2048, 1 << 40, log) == (3, 2048)


def test_a_container_s_memory_limit_bounds_what_is_available(tmp_path):
    """The memory budget is the control group's where its limit leaves less than the machine
    has (a pod's limit; /proc/meminfo shows the whole machine), in cgroup v2 and v1."""
    from worker.main import available_memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       25165824 kB\nMemAvailable:   20971520 kB\n")  # 20 GiB available
    v2, v1, none = tmp_path / "v2", tmp_path / "v1" / "memory", tmp_path / "none"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{8 << 30}\n")
    (v2 / "memory.current").write_text(f"{1 << 30}\n")
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{4 << 30}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{3 << 30}\n")
    assert available_memory(str(meminfo), str(v2)) == 7 << 30
    assert available_memory(str(meminfo), str(tmp_path / "v1")) == 1 << 30
    assert available_memory(str(meminfo), str(none)) == 20 << 30
    (v2 / "memory.max").write_text("max\n")  # no limit
    assert available_memory(str(meminfo), str(v2)) == 20 << 30
    (v2 / "memory.max").write_text(f"{64 << 30}\n")  # a limit above what the machine has
    assert available_memory(str(meminfo), str(v2)) == 20 << 30
