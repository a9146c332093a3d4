"""Train a small LLaMA with dynajax.train_step, fully sharded (FSDP) over 8 JAX CPU
devices: the whole AdamW step as one XLA program, parameters and AdamW's moments split
over the devices; save a checkpoint, restore it onto 4 devices into a fresh model, and
go on. The losses are checked against the same training in eager PyTorch.

    python examples/train_step.py
"""

from __future__ import annotations

import os

# 8 CPU devices for the mesh (before JAX starts); on a machine with accelerators, build
# the mesh from jax.devices() instead.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pathlib  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import dynajax  # noqa: E402

STEPS, RESUME_AT = 16, 10


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
    return model, optimizer, scheduler


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, labels=ids).loss


def main() -> int:
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (4, 32), generator=gen) for _ in range(STEPS)]

    model, optimizer, scheduler = build()  # eager PyTorch, for comparison
    expected = []
    for ids in batches:
        optimizer.zero_grad()
        loss = lm_loss(model, ids)
        loss.backward()
        optimizer.step()
        scheduler.step()
        expected.append(loss.item())

    fsdp = dynajax.ShardingRules.fsdp()  # every tensor split along dim 0 over "data"
    model, optimizer, scheduler = build()
    mesh = jax.make_mesh((8,), ("data",))
    step = dynajax.train_step(model, optimizer, lm_loss, mesh=mesh, sharding=fsdp)
    losses = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = pathlib.Path(tmp) / "ckpt"
        for ids in batches[:RESUME_AT]:
            losses.append(float(step(ids)))  # float(): waits for this step's loss
            scheduler.step()
        print(step.report())  # bytes per device: 1/8 of parameters and moments
        step.save(ckpt)  # the training state; the scheduler's is the user's to keep
        schedule = scheduler.state_dict()

        # A new run on half the devices: a fresh model, optimizer and scheduler, the
        # checkpoint restored (orbax lays each array out on the new mesh).
        model, optimizer, scheduler = build()
        mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
        step = dynajax.train_step(model, optimizer, lm_loss, mesh=mesh, sharding=fsdp)
        step.restore(ckpt)  # parameters, AdamW's moments and lr, step count, RNG state
        print(step.report())
        scheduler.load_state_dict(schedule)
        for ids in batches[RESUME_AT:]:
            losses.append(float(step(ids)))
            scheduler.step()
    step.sync()  # the module now holds the trained weights (save_pretrained, eval, ...)

    worst = max(abs(a - b) for a, b in zip(losses, expected, strict=True))
    print(f"losses, dynajax.train_step: {[round(v, 4) for v in losses]}")
    print(f"losses, eager PyTorch:      {[round(v, 4) for v in expected]}")
    print(f"largest difference: {worst:.2e}; programs compiled: {step.traces}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
