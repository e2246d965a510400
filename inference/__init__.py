"""Lossless speculative decoding: `from inference import SpeculativeGenerator`. Drafters (drafter.py, drafters/): an
EAGLE head's dynamic trees (HeadDrafter), prompt lookup (prompt_lookup, LookupBranch), a draft model
(DraftModelDrafter) and self-speculation (StreamingSelfDrafter)."""

from .drafter import Accepted, Drafter, PlainDrafter
from .drafters.draft_model import DraftModelDrafter, TokenizerMismatchError
from .drafters.eagle import HeadDrafter
from .drafters.lookup import LookupBranch, prompt_lookup
from .drafters.self_draft import StreamingSelfDrafter
from .engine import GenerationOutput, QueueOutput, SpeculativeGenerator
from .sampling import SamplingParams
from .stats import GenerationStats
from .tree import TREE_PRESETS, DraftTree, TreeOptions

__all__ = ["Accepted", "DraftModelDrafter", "DraftTree", "Drafter", "GenerationOutput", "GenerationStats",
           "HeadDrafter", "LookupBranch", "PlainDrafter", "QueueOutput", "SamplingParams", "SpeculativeGenerator",
           "StreamingSelfDrafter", "TREE_PRESETS", "TokenizerMismatchError", "TreeOptions", "prompt_lookup"]
