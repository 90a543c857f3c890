"""normlab's Hydra launcher: a sweep's jobs run several at once on each visible GPU (normlab_launcher.py)."""
