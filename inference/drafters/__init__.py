"""Drafters: what fills the verification trees (the protocol is drafter.py)."""
