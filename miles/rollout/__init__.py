"""Rollout plane: engine launch commands (``engines``), sglang-router (``router``), the HTTP client
(``client``), and the generation loop built on them. Submodules are imported explicitly; nothing heavy
is imported here."""
