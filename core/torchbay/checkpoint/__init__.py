"""Checkpoint mechanisms (see docs/checkpoint-guarantees.md)."""
