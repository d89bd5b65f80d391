"""What ``tpu_fit``'s parent and each path's child agree on: the paths, the config, the report.

Torch-free: the parent (:mod:`torch_xla_ext.tpu.fit`) imports it without
starting torch_xla; the child (:mod:`torch_xla_ext.tpu._fit_step`) reads its
request with it and answers with a :class:`FitReport`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

__all__ = ["FitReport", "Path", "PATHS", "DEFAULT_PATHS", "load_config", "parse_path", "lowering_devices",
           "split_hbm"]

#: Set to ``1`` by ``fit`` in a child's environment: the child then prints each phase it starts on stdout,
#: a line ``PHASE_MARK name``, for the parent's progress.
PHASES_ENV = "TORCH_XLA_EXT_FIT_PHASES"
PHASE_MARK = "tpu-fit-phase:"

#: The paths ``fit`` knows: ``loop`` (the layers run one after another) or
#: ``scan`` (one ``scan_layers`` loop), a scan's remat policy after ``+``,
#: ``+bf16`` for bf16 compute over fp32 parameters and optimizer state
#: (``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``), and a scan's
#: ``+stacked`` for the layers' parameters stored stacked
#: (``hf.prepare(..., stacked=True)``).
_BASE = ("loop", "scan", "scan+nothing_saveable", "scan+dots_saveable", "loop+bf16", "scan+bf16",
         "scan+nothing_saveable+bf16", "scan+dots_saveable+bf16")
PATHS = _BASE + tuple(p + "+stacked" for p in _BASE if p.startswith("scan"))
DEFAULT_PATHS = ("loop", "scan", "scan+nothing_saveable")
#: ``fit``'s ``attention``: the model's own attention implementations, and torch_xla's Pallas flash kernel
#: lowered for the TPU (shape-only, causal and unpadded: :mod:`torch_xla_ext.tpu._flash`).
ATTENTIONS = ("sdpa", "eager", "flash")
_REMAT = ("nothing_saveable", "dots_saveable")


@dataclasses.dataclass(frozen=True)
class Path:
    """What a path name asks for (:func:`parse_path`)."""

    scan: bool
    remat: str | None
    bf16: bool
    stacked: bool


@dataclasses.dataclass(frozen=True)
class FitReport:
    """One path's answer; byte counts are per chip (the TPU compiler's), ``host_rss_bytes`` this machine's."""

    path: str
    topology: str
    chips: int
    batch: int
    seq: int
    #: The TPU compiler's figures (``tpu.CompiledForTpu`` as a dict), or None when the step failed to lower.
    compiled: dict[str, Any] | None
    #: Peak resident memory of the process that lowered and compiled the step; from ``fit``, the larger of
    #: its two children's (one lowers, then the other compiles).
    host_rss_bytes: int
    lower_seconds: float
    parameters: int
    #: Virtual devices the step was lowered on: the chips, or for 128 chips and more a divisor of them
    #: (the program is then annotated for every chip: :mod:`torch_xla_ext.tpu._widen`).
    lowered_on: int = 0
    error: str | None = None
    #: The attention the step was built with (``fit``'s ``attention``; None: the config's own).
    attention: str | None = None

    @property
    def fits(self) -> bool:
        return self.compiled is not None and bool(self.compiled["fits"])

    @property
    def required_bytes(self) -> int | None:
        """What the step needs per chip (``CompiledForTpu.required_bytes``; for a step the compiler refused
        for HBM, the bytes its message says it used), None when it did not compile."""
        c = self.compiled
        if c is None:
            return None
        if c["error"] is not None:
            return _exhausted_bytes(c["error"])
        from ._client import required_bytes  # torch-free, like this module's parent side

        return required_bytes(c["peak_bytes"], c["argument_bytes"], c["output_bytes"], c["alias_bytes"],
                              c["temp_bytes"], c["generated_code_bytes"], c.get("hbm_buffer_bytes"))

    def breakdown(self) -> dict[str, int] | None:
        """What the step holds in HBM per chip, by kind (:func:`split_hbm`; the token batch is int64)."""
        return split_hbm(self.compiled, self.batch * self.seq * 8 // self.chips)


def split_hbm(compiled: dict[str, Any] | None, token_bytes: int) -> dict[str, int] | None:
    """What a compiled AdamW step (``tpu.CompiledForTpu`` as a dict) holds in HBM per chip, by kind; None when
    it did not compile or has no buffer assignment to split.

    The step's arguments are the parameters, AdamW's two moments (sharded
    like them, so twice their bytes) and the token batch (``token_bytes``
    per chip); every other HBM buffer is a temporary of the step (the
    gradients, the activations kept for the backward, the partitioner's
    gathered weights), which the buffer assignment does not label; the code
    is the compiled program's.
    """
    c = compiled
    if c is None or c["error"] is not None or c.get("hbm_buffer_bytes") is None:
        return None
    parameters = (c["argument_bytes"] - token_bytes) // 3
    return {"parameters": parameters, "optimizer moments": c["argument_bytes"] - token_bytes - parameters,
            "token batch": token_bytes,
            "temporaries (gradients, activations)": c["hbm_buffer_bytes"] - c["argument_bytes"],
            "code": c["generated_code_bytes"]}


def _exhausted_bytes(message: str) -> int | None:
    """The bytes the TPU compiler's RESOURCE_EXHAUSTED message says the program needs ("Used 223.23G of
    95.74G hbm", or "(16.00G) exceeds available HBM"; XLA's units are powers of 1024), or None."""
    import re

    found = (re.search(r"Used ([\d.]+)([KMGT]?)i?B? of ", message)
             or re.search(r"\(([\d.]+)([KMGT]?)i?B?\) exceeds available", message))
    if found is None:
        return None
    return int(float(found.group(1)) * 1024 ** " KMGT".index(found.group(2) or " "))


def parse_path(path: str) -> Path:
    """The :class:`Path` of a path name; ValueError naming the known ones."""
    if not isinstance(path, str) or path not in PATHS:
        raise ValueError(f"tpu_fit: unknown path {path!r}; known: {', '.join(PATHS)}")
    parts = path.split("+")
    return Path(parts[0] == "scan", next((p for p in parts if p in _REMAT), None), "bf16" in parts,
                "stacked" in parts)


def load_config(config: Any) -> Any:
    """A transformers config from a config (or its ``to_dict()``), a model type transformers ships (``"llama"``),
    a JSON file or a folder holding ``config.json``.

    The JSON file is a ``config.json`` as on the Hub: its ``model_type``
    picks the class, the other keys override that class's defaults.
    ValueError for an unknown model type or a file that is not such a JSON.
    """
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    if isinstance(config, dict):  # a config's to_dict(): how fit() hands it to its children
        values = dict(config)
        return AutoConfig.for_model(values.pop("model_type"), **values)
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"tpu_fit: config must be a transformers config, a model type or a JSON file, got "
                        f"{type(config).__name__}")
    text = os.fspath(config)
    if os.path.isdir(text):  # a downloaded model's folder
        text = os.path.join(text, "config.json")
    if text.endswith(".json") or os.path.sep in text:
        try:
            with open(text) as f:
                values = json.load(f)
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"tpu_fit: cannot read the config file {text!r}: {error}") from None
        if not isinstance(values, dict) or "model_type" not in values:
            raise ValueError(f"tpu_fit: {text!r} is not a transformers config.json (no model_type)")
        model_type = values.pop("model_type")
    else:
        model_type, values = text, {}
    try:
        return AutoConfig.for_model(model_type, **values)
    except ValueError as error:
        raise ValueError(f"tpu_fit: transformers ships no config for {model_type!r} ({error})") from None


def lowering_devices(chips: int) -> int:
    """How many virtual devices a slice of ``chips`` is lowered on: all of them below 128, else the largest
    divisor below 128 (autograd's 8-bit device count: :mod:`torch_xla_ext.tpu._widen`)."""
    return chips if chips < 128 else max(d for d in range(1, 128) if chips % d == 0)
