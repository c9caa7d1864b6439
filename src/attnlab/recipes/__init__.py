"""Recipes: explicit, top-to-bottom procedures behind the CLI commands."""
