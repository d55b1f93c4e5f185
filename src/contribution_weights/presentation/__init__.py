"""Presentation: figures and reports drawn from result objects (never from models)."""
