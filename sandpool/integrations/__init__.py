"""Thin adapters to gymnasium, NeMo Gym and OpenHands; each imports its library lazily."""
