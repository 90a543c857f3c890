"""The telemetry Probe as it was at commit 9034483a19e1d273422b5896e68008abef312981, frozen: the reference of tests/test_telemetry_golden.py.

probe.py, probe_stats.py, probe_norms.py and pack_telemetry.py are verbatim copies of normlab/train/probe.py,
probe_stats.py, probe_norms.py and pack/telemetry.py at that commit, with only their imports of one another
pointed here (those modules are normlab/telemetry/ today). Do not edit them.
"""
