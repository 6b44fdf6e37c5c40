"""Miles's ``miles.utils.file_arg_utils``: a flag value that is a file path or an inline ``base64:`` payload.

Miles's plugins import it (its eval_delegate_rollout reads ``--eval-config`` with it).
"""

from __future__ import annotations

import base64
from pathlib import Path

PSEUDO_FILE_PREFIX = "base64:"


def resolve_file_arg(value: str) -> str:
    """The text of ``value``: the decoded payload of ``base64:<payload>``, else the file it names."""
    if value.startswith(PSEUDO_FILE_PREFIX):
        return base64.b64decode(value[len(PSEUDO_FILE_PREFIX):], validate=True).decode()
    return Path(value).expanduser().read_text(encoding="utf-8")
