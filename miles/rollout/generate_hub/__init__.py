"""Miles's generate hub (``--custom-generate-function-path miles.rollout.generate_hub.<module>.<function>``).

``single_turn.generate`` and ``benchmarkers.generate_with_random_osl`` run here; ``multi_turn.generate``
and ``agentic_tool_call.generate`` are refused by name at start-up (see each module).
"""
