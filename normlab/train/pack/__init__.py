"""Packed arms: the runs of a sweep that differ only in lr and seed, trained together as one packed model.

`train_pack([(cfg, run_dir), ...])` trains every member in one process (normlab.nn.packed: stacked
weights, batched kernels, per-member AdamW and clipping) and writes each member's run dir as
`train.train` writes an unpacked run's: config.json, metrics.jsonl (the same rows), summary.json, the
wandb run, the telemetry and the per-layer products. A reader cannot tell a member from a run.

What a member shares with the pack and what it keeps (so that each member is its unpacked run):
- shared: the architecture and every setting but lr and seed, the held-out batches, the step clock;
- its own: the initialization (its seed, drawn exactly as an unpacked run draws it), the training
  batches (drawn from a generator seeded by its seed, as an unpacked run's: members with one seed
  see one stream, members with different seeds their own; one order for all members would make a
  member differ from its unpacked run), its lr schedule, its clipping, its AdamW moments, its
  BatchNorm statistics, its divergence: a member that diverges is recorded as diverged at its step
  and frozen (lr 0, gradient 0), and the others go on.

Packing is refused (ConfigError, one line) where it cannot be exact: members that differ in a key
other than lr and seed, fp16 (one GradScaler would skip every member's step when one overflows),
compile=true, and torchrun (a pack is one process).
"""

from normlab.train.pack.trainer import check_pack, train_pack

__all__ = ["check_pack", "train_pack"]
