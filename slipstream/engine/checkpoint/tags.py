"""Which tags are directory names we accept, for saving, loading and in ``latest``.

[Note: a tag is a path component] A tag becomes ``<save_dir>/<tag>`` and the content of
``latest``. An absolute path or ``..`` would read or write outside the save directory, whitespace
is lost when ``latest`` is read back, and a name over the file-system limit fails mid-save. So a
tag is checked before anything is written or read, and the message names the tag and the fix.
"""

from __future__ import annotations

from typing import Any

from slipstream.engine.checkpoint.format import LATEST
from slipstream.errors import SlipstreamError

MAX_TAG = 200  # characters; leaves room for the ".tmp-"/".trash-<ns>" prefixes within 255 bytes


class TagError(SlipstreamError, ValueError):
    """A tag that cannot name a checkpoint directory."""


def tag_problem(tag: Any) -> str | None:
    """Why ``tag`` cannot be a checkpoint directory name, or None when it can."""
    if not isinstance(tag, str):
        return f"is a {type(tag).__name__}, not a string"
    if not tag:
        return "is empty"
    if len(tag) > MAX_TAG or len(tag.encode("utf-8", "surrogatepass")) > MAX_TAG:
        return f"is {len(tag)} characters long (at most {MAX_TAG})"
    if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in tag):
        return "holds whitespace or control characters"
    if "/" in tag or "\\" in tag:
        return "holds a path separator"
    if tag.startswith("."):
        return "starts with '.' (such names are the save protocol's own, and '..' leaves the directory)"
    if tag == LATEST:
        return f"is {LATEST!r}, the name of the pointer file"
    try:
        tag.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8"
    return None


def check_tag(tag: Any, where: str) -> str:
    """``tag`` itself, or a :class:`TagError` naming it and the fix."""
    problem = tag_problem(tag)
    if problem is not None:
        shown = repr(tag) if not isinstance(tag, str) or len(tag) <= 60 else repr(tag[:60]) + "..."
        raise TagError(
            f"{where}: tag {shown} {problem}; use a plain directory name such as 'global_step100' "
            f"(letters, digits, '_', '-', '.', at most {MAX_TAG} characters, not starting with '.')"
        )
    return tag


def check_load_tag(tag: Any, where: str) -> str:
    """A tag to read: a relative path inside the load directory (``sub/global_step2`` is fine, ``../x`` or ``/x`` is not)."""
    if not isinstance(tag, str) or not tag:
        raise TagError(
            f"{where}: tag {tag!r} is not a non-empty string; pass the checkpoint's directory name, e.g. 'global_step100'"
        )
    parts = tag.replace("\\", "/").split("/")
    if (
        tag.startswith(("/", "\\"))
        or (len(tag) > 1 and tag[1] == ":")
        or any(p in ("", ".", "..") for p in parts)
        or "\0" in tag
    ):
        raise TagError(
            f"{where}: tag {tag!r} leaves the checkpoint directory (absolute, empty, '.' or '..' components); "
            "pass a checkpoint name relative to it, e.g. 'global_step100'"
        )
    return tag
