"""One tool, get_weather, as each dialect declares it: the tool the convention tests call."""

from __future__ import annotations

from typing import Any

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
THINKING = {"type": "enabled", "budget_tokens": 1024}  # Anthropic's way of asking for reasoning


def weather_tools(schema: dict[str, Any] = WEATHER) -> tuple[list, list, list]:
    """get_weather with these parameters, for Chat Completions, Responses and Messages."""
    description = "Weather for a city"
    return ([{"type": "function", "function": {"name": "get_weather", "description": description, "parameters": schema}}],
            [{"type": "function", "name": "get_weather", "description": description, "parameters": schema}],
            [{"name": "get_weather", "description": description, "input_schema": schema}])
