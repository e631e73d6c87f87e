"""The text tower of a multimodal checkpoint (Gemma 3): its tensors under the names of the
text model's own checkpoint, the vision weights never read.
See docs/models.md#gemma-2-and-gemma-3.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

from jaxinfer.config import families

log = logging.getLogger(__name__)

# (prefix in the multimodal checkpoint, prefix in the text model's), tried in order
TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                 ("language_model.lm_head.", "lm_head."))
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                   "model.multi_modal_projector.")


def text_tower_tensors(hf: dict[str, Any], tensors: dict[str, Any],
                       root: pathlib.Path) -> dict[str, Any]:
    """`tensors` of the checkpoint at `root` (config.json dict `hf`) renamed to the text
    model's names, without the vision tensors; as they are for a text-only config."""
    if not families.wraps_text_model(hf):
        return tensors
    out, vision = {}, 0
    for name, tensor in tensors.items():
        if name.startswith(VISION_PREFIXES):
            vision += 1
            continue
        for old, new in TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        out[name] = tensor
    log.info("%s: serving the text tower of %s; %d vision tensors ignored (text only)",
             root, (hf.get("architectures") or [hf.get("model_type")])[0], vision)
    return out
