"""LMCache's blending (CacheBlend) settings: read as LMCache reads them, checked as KVLens must.

LMCache (``lmcache/v1/config.py``, ``config_base._to_float_list`` / ``_to_int_list``) takes a
list, one number, or text of numbers separated by commas for ``blend_recompute_ratios``,
``blend_thresholds`` and ``blend_check_layers``; KVLens takes the same forms (and a YAML list
in an ``LMCACHE_*`` variable) and turns them into tuples. Where LMCache accepts anything
(a ratio of 7, a layer of -1, three ratios for two check layers, of which its blender reads only
the first), KVLens refuses at start-up naming the key: what a later blender would do with such
values is undefined. Older LMCache versions had one ``blend_recompute_ratio`` (0.15 by
default); KVLens reads it as a one-ratio ``blend_recompute_ratios``.

The defaults a blender uses where LMCache leaves a key unset (``BlendSettings``): check layer 1
and 15% recompute, LMCache's example (``examples/blend_kv_v1``) and the CacheBlend paper's.
Pure logic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BeforeValidator

DEFAULT_SEPARATOR = " # # "  # LMCache's blend_special_str
DEFAULT_CHECK_LAYERS = (1,)
DEFAULT_RECOMPUTE_RATIOS = (0.15,)
# Settings that make sense only with blending (a note says KVLens needs no layerwise mode).
BLEND_KEYS = (
    "enable_blending",
    "blend_special_str",
    "blend_recompute_ratios",
    "blend_check_layers",
    "blend_thresholds",
    "blend_min_tokens",
)


def _items(value: Any) -> list[Any] | None:
    """LMCache's list forms: a list, one value, or text with commas; None stays None."""
    if value is None:
        return None
    if isinstance(value, list | tuple):
        return list(value)
    if isinstance(value, str):
        parts = [p.strip() for p in value.strip().strip("[]").split(",")]
        if not any(parts):
            raise ValueError("must hold at least one value")
        return parts
    return [value]


def _number(item: Any) -> float:
    if isinstance(item, bool):
        raise ValueError("must be numbers (true or false is not one)")
    try:
        number = float(item)
    except (TypeError, ValueError, OverflowError):
        shown = repr(item[:20]) if isinstance(item, str) else f"a {type(item).__name__}"
        raise ValueError(
            f"must be numbers ({'too large' if isinstance(item, int) else shown + ' is not one'})"
        ) from None
    if not math.isfinite(number):
        raise ValueError("must be finite numbers")
    return number


def _numbers(value: Any, what: str) -> tuple[float, ...] | None:
    """A list setting's numbers (None: not set); at least one."""
    items = _items(value)
    if items is None:
        return None
    out = tuple(_number(i) for i in items)
    if not out:
        raise ValueError(f"must hold at least one {what} (or be null)")
    return out


def ratios(value: Any) -> tuple[float, ...] | None:
    out = _numbers(value, "ratio")
    if out is None:
        return None
    if any(not 0 <= r <= 1 for r in out):
        raise ValueError("must be shares between 0 and 1 (0.15: recompute 15% of the reused tokens)")
    return out


def thresholds(value: Any) -> tuple[float, ...] | None:
    out = _numbers(value, "threshold")
    if out is None:
        return None
    if any(t < 0 for t in out):
        raise ValueError("must be deviations >= 0")
    return out


def layers(value: Any) -> tuple[int, ...] | None:
    numbers = _numbers(value, "layer number")
    if numbers is None:
        return None
    out = []
    for number in numbers:
        if number != int(number):
            raise ValueError(f"must be layer numbers (whole numbers), not {number}")
        out.append(int(number))
    if any(layer < 0 for layer in out):
        raise ValueError("must be layer numbers >= 0 (0 is the first layer)")
    if len(set(out)) != len(out):
        raise ValueError("must not name a layer twice")
    return tuple(out)


def separator(value: Any) -> Any:
    if isinstance(value, str) and not value:
        raise ValueError("must not be empty: it is the text that separates the reusable parts")
    return value


Ratios = Annotated[tuple[float, ...] | None, BeforeValidator(ratios)]
Thresholds = Annotated[tuple[float, ...] | None, BeforeValidator(thresholds)]
CheckLayers = Annotated[tuple[int, ...] | None, BeforeValidator(layers)]
Separator = Annotated[str, BeforeValidator(separator)]


def length_problems(
    check_layers: tuple[int, ...] | None,
    recompute_ratios: tuple[float, ...] | None,
    blend_thresholds: tuple[float, ...] | None,
    sources: Mapping[str, str],
) -> list[str]:
    """Ratios and thresholds pair with check layers: one for all of them, or one each.

    LMCache's blender reads ``recomp_ratios[0]`` at every check layer and no threshold ("TODO:
    different ratios for different layers"); a longer list there is silently cut to its first
    value. KVLens takes one value (for every check layer) or one per check layer, in the order
    the layers are listed, and refuses any other length.
    """
    n = len(check_layers or DEFAULT_CHECK_LAYERS)
    out = []
    for key, values in (("blend_recompute_ratios", recompute_ratios), ("blend_thresholds", blend_thresholds)):
        if values is not None and len(values) not in (1, n):
            layers_source = sources.get("blend_check_layers", "default")
            out.append(
                f"{key} (from {sources.get(key, 'config')}) has {len(values)} values for {n} check "
                f"layer{'s' if n > 1 else ''} (blend_check_layers, from {layers_source}): give one "
                "value for every check layer, or one per check layer"
            )
    return out


def _per_layer(values: tuple[float, ...], layers: int) -> tuple[float, ...]:
    """One value for every check layer, or one per check layer (length_problems refused others)."""
    return values * layers if len(values) == 1 else values


@dataclass(frozen=True, slots=True)
class BlendSettings:
    """What a blender works with: LMCache's settings, defaults filled in, one pair per layer."""

    separator: str
    check_layers: tuple[int, ...]
    recompute_ratios: tuple[float, ...]  # one per check layer
    thresholds: tuple[float, ...] | None  # one per check layer, or None
    min_tokens: int

    @classmethod
    def of(
        cls,
        separator: str,
        check_layers: tuple[int, ...] | None,
        recompute_ratios: tuple[float, ...] | None,
        blend_thresholds: tuple[float, ...] | None,
        min_tokens: int,
    ) -> BlendSettings:
        layers_ = check_layers or DEFAULT_CHECK_LAYERS
        n = len(layers_)
        return cls(
            separator,
            layers_,
            _per_layer(recompute_ratios or DEFAULT_RECOMPUTE_RATIOS, n),
            None if blend_thresholds is None else _per_layer(blend_thresholds, n),
            min_tokens,
        )

    def layers_problem(self, num_layers: int) -> str | None:
        """The check layers the model lacks (known only once the model is loaded), as a sentence."""
        beyond = [layer for layer in self.check_layers if layer >= num_layers]
        if not beyond:
            return None
        return (
            f"blend_check_layers names layer{'s' if len(beyond) > 1 else ''} "
            f"{', '.join(map(str, beyond))}, but the model has {num_layers} layers (0 to {num_layers - 1})"
        )
