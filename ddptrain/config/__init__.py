"""Typed config: the schema (every choice declared once), its validation, and composition for every command."""
