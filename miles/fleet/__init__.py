"""Engine fleet: how engines are started (``engines``: the launch argv of the embedded engine or SGLang), the
sglang-router in front of them (``router``), and the HTTP clients that generate on and control them (``client``).
The rollout plane generates samples through it; the weight plane and fault tolerance control engines through it.
Submodules are imported explicitly; nothing heavy is imported here."""
