"""miles: RL post-training of LLMs as one SPMD job, without Ray.

Planes (one-way imports; each imports the ground floors ``miles.config``, ``miles.utils`` and ``miles.types``,
and another plane only where docs/architecture.md's picture allows it; tests/unit/test_layout.py checks):
  miles.spmd         world bootstrap, role plan, process groups, engine supervision
  miles.engine       the embedded inference engine speaking SGLang's HTTP protocol
  miles.fleet        engine launch commands, sglang-router, HTTP client and engine control
  miles.rollout      sample generation on the fleet: data, rewards, generation, Miles's plugin modules
  miles.trainer      FSDP2 backend, losses, advantages, checkpoints
  miles.weight_sync  trainer -> engine weight transfer (broadcast, same-device, disk-delta)
  miles.ft           engine health, torchft heartbeats, recovery
  miles.run          the RL loop that ties the planes together (used by train.py / train_async.py)
  miles.dashboard    --use-miles-dashboard telemetry and its viewer
"""

__version__ = "0.1.0"
