"""What every FP8 module shares: its delayed-scaling states (`fp8_meta`), their registration, and their place in
`state_dict()` as plain tensors."""

from __future__ import annotations

import warnings
from typing import Tuple

import torch

from ..autocast import Frame, has_pending_backward, register
from ..distributed import label_states
from ..state import ScalingState, resized_history

_PASSES = (("scaling_fwd", 3), ("scaling_bwd", 2))  # (name, slots per GEMM)
_FIELDS = ("amax_history", "scale", "update_count")


class FP8StateMixin:
    """Mixed into torch.nn.Module subclasses that hold `num_gemms` FP8 GEMMs.

    `fp8_meta["scaling_fwd"]` / `["scaling_bwd"]` are ScalingStates (None until the first FP8 forward or a
    checkpoint load); `fp8_meta["recipe"]` is the recipe of the last FP8 forward.
    """

    def _init_fp8_meta(self, num_gemms: int = 1) -> None:
        self.num_gemms = num_gemms
        self.fp8_meta = {"recipe": None, "scaling_fwd": None, "scaling_bwd": None}

    def fp8_states(self, frame: Frame, device: torch.device) -> Tuple[ScalingState, ScalingState]:
        """The (forward, backward) states for a delayed-scaling frame: created, resized to the recipe's history
        length, moved to `device` and registered under the frame's key as needed."""
        meta = self.fp8_meta
        fwd, bwd = meta["scaling_fwd"], meta["scaling_bwd"]
        key = frame.key
        if fwd is not None and bwd is not None and fwd.key == key and bwd.key == key \
                and fwd.scale.device == device and bwd.scale.device == device:
            meta["recipe"] = frame.recipe  # registered under this key, so sized for its recipe already
            return fwd, bwd
        length = frame.recipe.amax_history_len
        for name, per_gemm in _PASSES:
            state = meta[name]
            if state is None:
                meta[name] = ScalingState(per_gemm * self.num_gemms, length, device)
                continue
            if state.history_len != length:
                state.resize_(length)
            if state.scale.device != device:
                state.to_(device)
        meta["recipe"] = frame.recipe
        register(frame, meta["scaling_fwd"], meta["scaling_bwd"])
        label = getattr(self, "_fp8_label", None)
        if label is not None:  # names the module in registration-mismatch messages
            label_states(label, meta["scaling_fwd"], meta["scaling_bwd"])
        return meta["scaling_fwd"], meta["scaling_bwd"]

    # ---- checkpoints: plain tensors under `<prefix>fp8_meta.<pass>.<field>` ----------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        backward = self.fp8_meta["scaling_bwd"]
        if backward is not None and has_pending_backward(backward):
            warnings.warn(
                f"fp8kit: {prefix or 'the module'}: a backward amax update deferred by amax reduction has not run yet; "
                "call fp8kit.pytorch.distributed.apply_pending_updates() on every rank before saving, or a resumed "
                "run will merge it into the next step's update", stacklevel=3)
        for name, _ in _PASSES:
            state = self.fp8_meta[name]
            if state is None:
                continue
            base = f"{prefix}fp8_meta.{name}."
            destination[base + "amax_history"] = state.amax_history
            destination[base + "scale"] = state.scale
            destination[base + "update_count"] = state.count if keep_vars else state.count.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        ours = {k for k in state_dict if k.startswith(prefix + "fp8_meta.")}
        unexpected_keys[:] = [k for k in unexpected_keys if k not in ours]
        for name, per_gemm in _PASSES:
            base = f"{prefix}fp8_meta.{name}."
            found = {f: state_dict[base + f] for f in _FIELDS if base + f in state_dict}
            if not found:
                continue  # e.g. a torch.nn.Linear checkpoint: keep the current state
            problem = self._bad_fp8_entry(found, per_gemm * self.num_gemms)
            if problem:
                error_msgs.append(f"{base[:-1]}: {problem}")
                continue
            self._load_state(name, found)

    @staticmethod
    def _bad_fp8_entry(found, slots: int) -> str:
        missing = [f for f in _FIELDS if f not in found]
        if missing:
            return f"missing {', '.join(missing)}"
        history, scale = found["amax_history"], found["scale"]
        if history.dim() != 2 or history.shape[1] != slots or history.shape[0] < 1:
            return f"amax_history must have shape [L >= 1, {slots}], got {tuple(history.shape)}"
        if tuple(scale.shape) != (slots,):
            return f"scale must have shape [{slots}], got {tuple(scale.shape)}"
        if not (history.is_floating_point() and scale.is_floating_point()):
            return f"amax_history and scale must be floating, got {history.dtype} and {scale.dtype}"
        if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
            return "scale holds a value that is not finite and > 0"
        return ""

    def _load_state(self, name: str, found) -> None:
        state = self.fp8_meta[name]
        device = self.weight.device if state is None else state.scale.device
        history = found["amax_history"].detach().to(device=device, dtype=torch.float32)
        if state is None:
            state = self.fp8_meta[name] = ScalingState(history.shape[1], history.shape[0], device)
        elif state.key is not None and state.history_len != history.shape[0]:
            history = resized_history(history, state.history_len)  # registered: the recipe's length wins
        state.amax_history = history.clone()
        state.scale = found["scale"].detach().to(device=device, dtype=torch.float32).clone()
        state.update_count = int(found["update_count"])
