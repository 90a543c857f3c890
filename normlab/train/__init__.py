"""Training: `normlab.train.run.train` trains one run, `normlab.train.pack.train_pack` a pack of runs.

run (the run and its records), loop (the steps and evaluation), runtime (device, precision, compile, seeding),
optim (the lr schedule, AdamW's groups), state (TrainState), callbacks/, sinks/, checkpoint/, pack/, distributed,
preempt, probe. Import the module that holds a name; this package imports nothing.
"""
