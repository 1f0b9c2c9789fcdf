"""Reading the launcher's small text files (hostfile, ``.slipstream_env``) without surprises.

Both are a few lines of UTF-8 text written by hand. A read is bounded (``--hostfile /dev/zero``
or a multi-gigabyte file given by mistake must end, not fill memory), a leading byte-order mark
from a Windows editor is accepted, and anything else that is wrong is one line naming the file,
the line and the fix, raised as the caller's own error type.
"""

from __future__ import annotations

MAX_FILE_BYTES = 1 << 20  # a few lines of text; a file larger than this is the wrong file


def read_small_text(path: str, what: str, error: type[ValueError]) -> str:
    """The text of ``path``; ``what`` names it in errors (``--hostfile``, ``.slipstream_env``)."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise error(f"{what}: cannot read {path}: {err.strerror}; check the path and its permissions") from None
    if len(data) > MAX_FILE_BYTES:
        raise error(
            f"{what}: {path} is larger than {MAX_FILE_BYTES >> 10} KiB; it should hold a few lines of "
            "text, check that the path names the right file"
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise error(
            f"{what}: {path} line {line} is not UTF-8 text (byte 0x{data[err.start]:02x}); save the file as UTF-8"
        ) from None
