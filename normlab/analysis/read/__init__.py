"""Reading run dirs back: a run's config, summary and metric rows (runs.py, records.py). Nothing here computes
across runs."""
