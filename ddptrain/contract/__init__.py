"""The vocabulary every layer shares: ignored targets, output access, document boundaries, blocks.

This package imports nothing else of ddptrain, so data, models, strategies and the engine can all
import it without importing each other.
"""
