"""Tuning for the machine at hand: the tree budget (`--tree auto`) and the draft vocabulary."""
