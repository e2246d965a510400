"""Capture a target's per-layer hidden states with forward hooks (any HF causal LM, no modeling copies).

Layer id k means the output of decoder layer k (0-indexed), before any final norm. Used both by feature
collection (train) and by the target runner during verification (inference): one forward, no second pass.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder-layer list of a causal LM (model.model.layers for Llama/Qwen2/Mistral/Gemma...)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find decoder layers in {type(model).__name__}")
    return layers


class HiddenStateCapture:
    """Context manager: while active, every forward of `model` records the outputs of `layer_ids`.

        with HiddenStateCapture(model, [1, 14, 26, 29]) as cap:
            model(input_ids)
        feats = cap.stacked([1, 14, 26])      # (B, T, 3·H)

    attach() keeps the hooks registered beyond one `with` block (they record only inside one): a decoding loop
    then pays no hook registration per forward, and torch.compile traces the hooks once.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        layers = decoder_layers(model)
        bad = [i for i in layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"layer ids {bad} outside the target's {len(layers)} decoder layers")
        self.layers = layers
        self.layer_ids = sorted(set(layer_ids))
        self.outputs: dict[int, torch.Tensor] = {}
        self.recording = False
        self._handles: list = []
        self._attached = False  # hooks stay after the `with` block

    def _hook(self, layer_id: int):
        def hook(module, args, output):
            if self.recording:
                self.outputs[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def _register(self) -> None:
        if not self._handles:
            self._handles = [self.layers[i].register_forward_hook(self._hook(i)) for i in self.layer_ids]

    def attach(self) -> "HiddenStateCapture":
        """Register the hooks until detach(); they record only inside `with` blocks."""
        self._register()
        self._attached = True
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._attached = False

    def __enter__(self) -> "HiddenStateCapture":
        self.outputs.clear()
        self._register()
        self.recording = True
        return self

    def __exit__(self, *exc) -> None:
        self.recording = False
        if not self._attached:
            self.detach()

    def stacked(self, layer_ids: list[int]) -> torch.Tensor:
        """Concatenate the captured outputs of `layer_ids` (in that order) on the feature axis: (B, T, k·H)."""
        missing = [i for i in layer_ids if i not in self.outputs]
        if missing:
            raise RuntimeError(f"no captured output for layers {missing}: was the model run inside the context?")
        return torch.cat([self.outputs[i] for i in layer_ids], dim=-1)
