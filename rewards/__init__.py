"""Reward components (plain functions) and their weighting."""
