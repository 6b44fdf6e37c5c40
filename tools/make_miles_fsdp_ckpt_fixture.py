"""Write the fixture ``tests/fixtures/miles_fsdp_ckpt/`` with Miles's own FSDP checkpoint code.

Miles's save (``radixark/miles@v0.1.0:miles/backends/fsdp_utils/checkpoint.py``) and LR scheduler
(``radixark/miles@v0.1.0:miles/backends/fsdp_utils/lr_scheduler.py``) are imported, unchanged, from a
directory given on the command line (they are not part of this repository)::

    d=miles/backends/fsdp_utils   # in a clone of radixark/miles
    git -C <miles clone> show "v0.1.0:$d/checkpoint.py"   > /tmp/miles_v010/checkpoint.py
    git -C <miles clone> show "v0.1.0:$d/lr_scheduler.py" > /tmp/miles_v010/lr_scheduler.py
    PYTHONPATH=. python tools/make_miles_fsdp_ckpt_fixture.py /tmp/miles_v010 tests/fixtures/miles_fsdp_ckpt

What this driver does, as Miles's FSDP actor (``radixark/miles@v0.1.0:miles/backends/fsdp_utils/actor.py``) would,
on one gloo CPU rank: ``torch.manual_seed(seed)``; the tiny Qwen3 model of ``tests/conftest.py``'s
``tiny_model_dir`` (``build_tiny_model(hidden_size=64, num_layers=2)``) loaded with ``AutoModelForCausalLM``;
FSDP2 ``fully_shard`` on every decoder layer and then the root, over a 1-rank ``"fsdp"`` mesh, with Miles's
default mixed precision (bf16 parameters, fp32 reduction); ``torch.optim.AdamW(model.parameters(), ...)``; Miles's
``get_lr_scheduler`` (cosine, 2 warm-up steps, ``train_iters`` = 4 rollouts x 2 x 3 samples / 3 = 8). Rollouts
0..N each take 2 optimizer steps (causal-LM loss on token ids drawn from torch's global RNG, so the data depends on
the RNG; grad clip 1.0; ``optimizer.step(); lr_scheduler.step()``), then Miles's ``save(actor, N)``.

Stubbed, and why: Ray, SGLang, wandb and Miles's actor class are not used (the save needs only an object with
``args``, ``model``, ``optimizer``, ``lr_scheduler``, ``global_step``, ``micro_step``; Miles v0.1.0 never
advances ``global_step``, so it is 0 here as there); ``torch.cuda.synchronize`` (called by ``save``) is a no-op,
since this torch build has no CUDA. Miles's loss (policy gradient over rollouts) is replaced by a causal-LM loss:
the checkpoint's contents do not depend on which loss made the gradients.

After the save the driver draws ``torch.rand(8)`` from the global RNG and writes it, with the LR Miles's scheduler
gives the next optimizer step, into ``<out>/driver_record.json``: a resume that restores the RNG draws the same.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

SEED = 1234
NUM_ROLLOUT, ROLLOUT_BATCH, N_SAMPLES, GLOBAL_BATCH = 4, 2, 3, 3   # 2 optimizer steps a rollout, 8 in all
STEPS_PER_ROLLOUT = ROLLOUT_BATCH * N_SAMPLES // GLOBAL_BATCH


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("miles_src", type=Path, help="directory with Miles v0.1.0's checkpoint.py and lr_scheduler.py")
    ap.add_argument("out", type=Path, help="the --save directory Miles writes (the fixture)")
    ap.add_argument("--rollout-id", type=int, default=1, help="the rollout after which Miles saves")
    a = ap.parse_args()
    miles_ckpt = _import(a.miles_src / "checkpoint.py", "miles_v010_checkpoint")
    miles_lr = _import(a.miles_src / "lr_scheduler.py", "miles_v010_lr_scheduler")

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    from miles.utils.tiny_model import build_tiny_model

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(SEED)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny", hidden_size=64, num_layers=2)
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.train()
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), "mesh": mesh}
    for module in model.modules():
        if type(module).__name__ in model._no_split_modules:
            fully_shard(module, **kw)
    fully_shard(model, **kw)

    args = SimpleNamespace(
        save=str(a.out), no_save_optim=False, seed=SEED,
        lr=3e-3, min_lr=1e-4, lr_decay_style="cosine", lr_warmup_iters=2, lr_warmup_init=0.0,
        lr_warmup_fraction=None, lr_decay_iters=None, lr_wsd_decay_iters=None, lr_wsd_decay_style=None,
        use_checkpoint_lr_scheduler=True, override_lr_scheduler=False,
        num_rollout=NUM_ROLLOUT, rollout_batch_size=ROLLOUT_BATCH, n_samples_per_prompt=N_SAMPLES,
        global_batch_size=GLOBAL_BATCH, adam_beta1=0.9, adam_beta2=0.98, adam_eps=1e-8, weight_decay=0.1,
        clip_grad=1.0,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                  eps=args.adam_eps, weight_decay=args.weight_decay)
    lr_scheduler = miles_lr.get_lr_scheduler(args, optimizer)
    vocab = model.config.vocab_size
    for _rollout in range(a.rollout_id + 1):
        for _step in range(STEPS_PER_ROLLOUT):
            ids = torch.randint(4, vocab, (GLOBAL_BATCH, 12))           # data drawn from the global RNG
            model(input_ids=ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)

    actor = SimpleNamespace(args=args, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                            global_step=0, micro_step=0)
    sync, torch.cuda.synchronize = torch.cuda.synchronize, lambda *_a, **_k: None  # no CUDA in this build
    try:
        miles_ckpt.save(actor, a.rollout_id)
    finally:
        torch.cuda.synchronize = sync
    record = {
        "rollout_id": a.rollout_id,
        "optimizer_steps": (a.rollout_id + 1) * STEPS_PER_ROLLOUT,
        "next_lr": optimizer.param_groups[0]["lr"],
        "rng_draw_after_save": torch.rand(8).tolist(),
    }
    (a.out / "driver_record.json").write_text(json.dumps(record, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
