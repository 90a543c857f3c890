"""Plumbing every layer shares: atomic files and locks (files), one-line errors (errors). Imports nothing of normlab."""
