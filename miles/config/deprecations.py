"""Miles's flag history (0.1.0 migration guide), applied to argv before parsing.

- ``--rollout-router-ip`` / ``--rollout-router-port`` were renamed to ``--sglang-router-ip`` /
  ``--sglang-router-port`` in 0.0.9: they still work in this release, with a warning.
- ``--rm-path`` was renamed to ``--custom-rm-path``: it is refused, naming the new flag.
- ``--chat-template-path autofix`` is Miles's deprecated alias for "no template file" (Miles then lets
  ``--tito-model`` pick one; with its default it keeps the tokenizer's own): the flag is dropped with a warning, so
  the run sees None, as under Miles. A ``chat_template_path: autofix`` key of ``--custom-config-path`` is read the
  same way (``deprecated_value``).
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


# flag -> (value, why): a value Miles accepts only as a deprecated alias of "not given"
DEPRECATED_VALUES: dict[str, tuple[str, str]] = {
    "--chat-template-path": ("autofix", "Miles's alias for no template file: with its default --tito-model the "
                                        "tokenizer's own template is used; remove the flag"),
}


def deprecated_value(flag: str, value: object) -> bool:
    """True (with a warning) when ``value`` of ``flag`` is a deprecated alias of "not given"."""
    old = DEPRECATED_VALUES.get(flag)
    if old is None or value != old[0]:
        return False
    logger.warning("%s %s is deprecated and read as not given (%s)", flag, value, old[1])
    return True


def _drop_deprecated_values(argv: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in DEPRECATED_VALUES:
            value, step = (value, 1) if eq else (argv[i + 1] if i + 1 < len(argv) else None, 2)
            if deprecated_value(name, value):
                i += step
                continue
        out.append(argv[i])
        i += 1
    return out


def _flags_given(argv: list[str]) -> set[str]:
    return {a.partition("=")[0] for a in argv if a.startswith("--")}


def apply_deprecations(argv: list[str]) -> list[str]:
    given = _flags_given(argv)
    for old, (new, accepted) in RENAMED.items():
        if accepted and old in given and new in given:
            raise ConfigError(f"{old} and {new} are the same flag ({old} is its old name) and both were given: "
                              f"keep only {new}.")
    out: list[str] = []
    for arg in _drop_deprecated_values(argv):
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
