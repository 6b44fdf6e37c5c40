"""The weight plane: trained weights from the trainer to the engines.

``build_weight_sender(cfg, ...)`` (base.py) picks the transport by ``--update-weight-transfer-mode``:
``broadcast`` (the default: a process group with the engines outside the torch world, NCCL/gloo; with
``--colocate`` it means the ``tensor`` hand-off), ``p2p`` (every trainer rank sends its own shard over that
group, no gather), ``tensor`` (same-device hand-off: CUDA IPC / shared memory) or ``disk-delta``
(checksummed per-tensor deltas on a shared filesystem). buckets.py holds the flattened-bucket layout and disk_delta.py the on-disk format;
the engine imports both, and nothing else from this package.
"""
