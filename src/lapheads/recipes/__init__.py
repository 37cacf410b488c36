"""Recipes: one module per experiment, all running on the shared engine (lapheads.engine)."""
