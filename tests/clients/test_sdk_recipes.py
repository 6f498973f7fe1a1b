"""README.md's "Use it with…" recipe for the official OpenAI and Anthropic Python SDKs, run as it
stands against the shared stack (its URL swapped in; the stack has no API key, so any key does)."""

from __future__ import annotations

import contextlib
import io

from readme_recipes import LOCAL_URL, blocks


def test_the_python_sdk_recipe_runs_and_prints_a_reply_from_each_api(stack):
    recipe = blocks("python", "base_url")[0].replace(LOCAL_URL, stack.url)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(recipe, "README.md (Use it with…)", "exec"), {})
    # Chat Completions, Responses and Messages: three replies printed, some text among them
    assert printed.getvalue().count("\n") >= recipe.count("print(") == 3
    assert printed.getvalue().strip()
