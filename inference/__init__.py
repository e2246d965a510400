"""Lossless speculative decoding: `from inference import SpeculativeGenerator`. Drafters: an EAGLE head's dynamic
tree (TreeDrafter), PromptLookupDrafter, DraftModelDrafter, HybridDrafter (head + prompt lookup)."""

from .draft_model import DraftModelDrafter, TokenizerMismatchError
from .drafter import Drafter, PlainDrafter
from .engine import GenerationOutput, GenerationStats, QueueOutput, SpeculativeGenerator
from .hybrid import HybridDrafter
from .prompt_lookup import PromptLookupDrafter
from .sampling import SamplingParams
from .tree import TREE_PRESETS, TreeDrafter, TreeOptions

__all__ = ["DraftModelDrafter", "Drafter", "GenerationOutput", "GenerationStats", "HybridDrafter", "PlainDrafter",
           "PromptLookupDrafter", "QueueOutput", "SamplingParams", "SpeculativeGenerator", "TREE_PRESETS",
           "TokenizerMismatchError", "TreeDrafter", "TreeOptions"]
