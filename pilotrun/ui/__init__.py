"""Presentation only: the terminal table, number formats."""
