"""Campaigns: a control and variants of one key over seeds, every run kept, an honest conclusion."""
