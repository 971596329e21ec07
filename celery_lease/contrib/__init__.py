"""Integrations with other tools (Flower)."""
