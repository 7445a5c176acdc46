"""Text that is not Unicode: strings holding a lone surrogate, refused where user text enters core.

JSON's `\\ud800` escape (and Python's `"\\ud800"`) makes a str holding half of a UTF-16 pair. It
cannot be encoded as UTF-8, so the tokenizer, the content hashes and the stores would each fail on
it deep inside a request; `require_unicode` refuses it up front, naming where it is. A correctly
paired escape (`\\ud83d\\ude00`) is decoded into one character and is never seen here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from fusionrag_core.errors import InvalidRequestError

_SURROGATE = re.compile("[\ud800-\udfff]")


def not_unicode_at(value: Any, where: str) -> str | None:
    """Where in `value` (strings, and lists and mappings of them, however deep) the first string
    holding a lone surrogate is, as a path under `where` (e.g. `messages[1].content`); None if
    every string is Unicode. Iterative, so a deeply nested value costs no recursion."""
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item):
                return path
        elif isinstance(item, Mapping):
            # NOTE: reversed, so the first bad string in reading order is the one named
            stack += [(v, f"{path}.{k}" if path else str(k)) for k, v in reversed(list(item.items()))]
            stack += [(k, f"{path} (a key)") for k in item if isinstance(k, str)]
        elif isinstance(item, Sequence) and not isinstance(item, bytes | bytearray):
            stack += [(v, f"{path}[{i}]") for i, v in reversed(list(enumerate(item)))]
    return None


def require_unicode(value: Any, where: str) -> None:
    """Refuse `value` if any string in it holds a lone surrogate (see `not_unicode_at`).

    Raises:
        InvalidRequestError: naming the field, e.g. `messages[1].content`.
    """
    path = not_unicode_at(value, where)
    if path is not None:
        raise InvalidRequestError(
            f"{path or 'the text'} is not valid Unicode: it holds a lone surrogate (half of a UTF-16 pair, "
            "e.g. the JSON escape \\ud800 without its partner); send whole characters")


__all__ = ["not_unicode_at", "require_unicode"]
