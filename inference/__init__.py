"""Lossless tree speculative decoding with a draft head: `from inference import SpeculativeGenerator`."""

from .generator import GenerationOutput, GenerationStats, SpeculativeGenerator
from .sampling import SamplingParams
from .tree import TREE_PRESETS, TreeOptions

__all__ = ["GenerationOutput", "GenerationStats", "SamplingParams", "SpeculativeGenerator", "TREE_PRESETS",
           "TreeOptions"]
