"""Tools for the tool-environment tests (``test_tool_env.py``), loaded by path (``env.tools``)."""

import time


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def lookup(key: str) -> str:
    """The value stored under a key."""
    return {"a": "1"}[key]


def hang(s: float) -> str:
    """Sleeps for s seconds."""
    time.sleep(s)
    return "woke"


def untyped_varargs(*args):
    """Takes anything."""
    return len(args)


TABLE_TOOLS = [lookup]
NOT_A_TOOL = [42]
