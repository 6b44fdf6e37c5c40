"""Miles's flag history (0.1.0 migration guide), applied to argv before parsing.

- ``--rollout-router-ip`` / ``--rollout-router-port`` were renamed to ``--sglang-router-ip`` /
  ``--sglang-router-port`` in 0.0.9: they still work in this release, with a warning.
- ``--rm-path`` was renamed to ``--custom-rm-path``: it is refused, naming the new flag.
"""

from __future__ import annotations

from miles.config.base import ConfigError
from miles.utils.logging import get_logger

logger = get_logger(__name__)

# old flag -> (new flag, still accepted in this release?)
RENAMED: dict[str, tuple[str, bool]] = {
    "--rollout-router-ip": ("--sglang-router-ip", True),
    "--rollout-router-port": ("--sglang-router-port", True),
    "--rm-path": ("--custom-rm-path", False),
}


def _flags_given(argv: list[str]) -> set[str]:
    return {a.partition("=")[0] for a in argv if a.startswith("--")}


def apply_deprecations(argv: list[str]) -> list[str]:
    given = _flags_given(argv)
    for old, (new, accepted) in RENAMED.items():
        if accepted and old in given and new in given:
            raise ConfigError(f"{old} and {new} are the same flag ({old} is its old name) and both were given: "
                              f"keep only {new}.")
    out: list[str] = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        if name in RENAMED:
            new, accepted = RENAMED[name]
            if not accepted:
                logger.warning("%s is deprecated and was renamed to %s", name, new)
                raise ConfigError(f"{name} was renamed to {new} and is no longer accepted: replace '{name}' with '{new}'.")
            logger.warning("%s is deprecated (renamed to %s in Miles 0.0.9) and will be removed; use %s", name, new, new)
            arg = new + eq + value
        out.append(arg)
    return out
