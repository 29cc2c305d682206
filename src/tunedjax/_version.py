"""The tunedjax version, kept apart so that packaging can read it without importing jax."""

__version__ = "0.1.0.dev0"
