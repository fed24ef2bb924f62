"""Environments built on the core pool: tasks, task packs, grading, policies, the runner."""
