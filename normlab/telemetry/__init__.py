"""Telemetry: per-layer statistics of a training run, measured on the device and read back as one record.

The model shows its tensors at named sites to a tap (the protocol is the model's own, normlab.nn.tap, so the
model imports nothing of telemetry). On a telemetry step the Probe (probe.py) runs the model with its tap,
which keeps every site of every block and reduces each to its statistics at once (sites.py, stats.py); it
adds the parameters' figures: gradient norms and update ratios by group (params.py), the norms' gains,
shifts and eps (norms.py). packed.py does the same per member of a pack. Keys come from normlab.keys; the
training loop calls the Probe through its telemetry callback (normlab.train.callbacks.telemetry).
"""
