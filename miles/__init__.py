"""miles: RL post-training of LLMs as one SPMD job, without Ray.

Planes (one-way imports; each imports ``miles.config`` and ``miles.utils`` only, except where noted
in docs/architecture.md):
  miles.spmd         world bootstrap, role plan, process groups, engine supervision
  miles.engine       the embedded inference engine speaking SGLang's HTTP protocol
  miles.rollout      engine launch commands, sglang-router, HTTP client, data, rewards, generation
  miles.trainer      FSDP2 backend, losses, advantages, checkpoints
  miles.weight_sync  trainer -> engine weight transfer (broadcast, same-device, disk-delta)
  miles.ft           engine health, torchft heartbeats, recovery
  miles.run          the RL loop that ties the planes together (used by train.py / train_async.py)
"""

__version__ = "0.1.0"
