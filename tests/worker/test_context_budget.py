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
