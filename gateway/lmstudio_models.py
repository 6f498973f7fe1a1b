"""LM Studio's model listing (``GET /api/v0/models``, ``/api/v0/models/{id}``, ``/api/v1/models``),
which routers in front of a local server read for what OpenAI's ``/v1/models`` lacks: whether the
model is loaded, its trained context and the context it is served with, its quantization, and
whether it calls tools. The served model is always ``loaded``; the facts come from the worker's
MODEL_CARD."""

from __future__ import annotations

from typing import Any

from gateway.prompting import ModelView


def v0_entry(view: ModelView, model_id: str | None = None) -> dict[str, Any]:
    """One model in the v0 shape (``model_id``: the id asked for, else the served one)."""
    card, facts = view.card, view.card.facts
    return {"id": model_id or view.model_id, "object": "model", "type": "llm", "publisher": _publisher(view),
            "arch": card.architecture, "compatibility_type": facts.format, "quantization": facts.quantization,
            "state": "loaded", "max_context_length": card.capabilities.context_length,
            # what a request may hold, prompt and reply (--ctx): the limit a router checks against
            "loaded_context_length": view.context_budget,
            # this server's: what a request's unset sampling fields take (as /v1/models says)
            "sampling_defaults": card.sampling.given(),
            "capabilities": ["tool_use"] if view.tool_call_tags is not None else []}


def v0_list(view: ModelView) -> dict[str, Any]:
    return {"object": "list", "data": [v0_entry(view)]}


def v1_list(view: ModelView) -> dict[str, Any]:
    """The v1 shape: ``{"models": [...]}`` with the loaded instance and its context."""
    card, facts = view.card, view.card.facts
    model_id = view.model_id
    return {"models": [{
        "type": "llm", "publisher": _publisher(view), "key": model_id, "display_name": model_id,
        "architecture": card.architecture,
        "quantization": {"name": facts.quantization or None, "bits_per_weight": facts.bits_per_weight or None},
        "size_bytes": facts.size_bytes, "params_string": facts.size_label or None,
        "loaded_instances": [{"id": model_id, "config": {"context_length": view.context_budget}}],
        "max_context_length": card.capabilities.context_length, "format": facts.format,
        "capabilities": {"vision": card.capabilities.vision, "trained_for_tool_use": view.tool_call_tags is not None},
        "description": None}]}


def _publisher(view: ModelView) -> str:
    """Who the file says published the model, else this server (LM Studio names the repository's owner)."""
    return view.card.facts.publisher or "lmserve"
