"""Pieces shared by every attention schedule (flash, ELSA scan, NSA branches)."""
