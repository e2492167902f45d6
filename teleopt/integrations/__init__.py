"""Integrations with other libraries, recognised by structure (nothing here imports them).

* :mod:`teleopt.integrations.peft`: peft LoRA adapters as ``lora_gl`` sites
  (``lora_sites``), which ``teleopt.find_symmetries`` also adds.
* :mod:`teleopt.integrations.qk_clip`: per-head query/key rescalings of Hugging Face
  attention, QK-clip's invariant half (``qk_head_scalings``).

How to use ``Teleport`` and ``Syre`` from the transformers ``Trainer`` and from
Lightning is shown in ``examples/08_hf_trainer.py`` and the README; it needs no
code here (both wrappers are real ``torch.optim.Optimizer`` subclasses).
"""

from teleopt.integrations.peft import LoRASites, is_lora_layer, lora_sites
from teleopt.integrations.qk_clip import qk_head_scalings

__all__ = ["LoRASites", "is_lora_layer", "lora_sites", "qk_head_scalings"]
