"""Built-in verifiers behind ``--rm-type`` (one module each); ``miles.rollout.rewards`` dispatches to them.

The names and meanings follow Miles v0.1.0's reward hub: ``math``, ``deepscaler``, ``gemma_math``,
``dapo``, ``f1``, ``gpqa``, ``ifbench``, ``random``, ``deterministic_random``, ``remote_rm`` and the
``boxed_<type>`` prefix; plus this project's ``exact_match``, ``quickstart`` and ``math_lenient``.
"""
