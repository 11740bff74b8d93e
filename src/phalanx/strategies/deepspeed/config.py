"""Building the DeepSpeed config from DeepSpeedStrategy's arguments, Fabric's precision and the user's
own config. A setting given in two places must agree; phalanx never lets one silently win."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from phalanx.utils.errors import MisconfigurationError

# Fabric precision -> DeepSpeed config section that must be enabled (None: full fp32).
PRECISION_SECTIONS: dict[str, str | None] = {
    "32-true": None, "bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "16-true": "fp16",
}

def _load_user_config(config: dict[str, Any] | str | Path | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, Path)):
        path = Path(config)
        if not path.is_file():
            raise MisconfigurationError(f"DeepSpeed config file {path} does not exist.")
        try:
            loaded = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise MisconfigurationError(f"DeepSpeed config file {path} is not valid JSON: {err}.") from err
        if not isinstance(loaded, dict):
            raise MisconfigurationError(f"DeepSpeed config file {path} must hold a JSON object.")
        return loaded
    raise MisconfigurationError(
        f"config must be a dict, a path to a JSON file, or None; got {type(config).__name__}."
    )


def conflict(what: str, config_value: Any, arg: str) -> MisconfigurationError:
    return MisconfigurationError(
        f"The DeepSpeed config sets {what}={config_value!r}, but DeepSpeedStrategy was given {arg}. "
        "Set it in one place only: remove it from the config or drop the argument."
    )


def _offload_device(section: Any, key: str) -> str | None:
    if section is None:
        return None
    if not isinstance(section, dict):
        raise MisconfigurationError(f"zero_optimization.{key} in the DeepSpeed config must be a dict.")
    return str(section.get("device", "none"))


def build_zero_config(
    config: dict[str, Any] | str | Path | None,
    stage: int | None,
    offload_optimizer: bool | None,
    offload_parameters: bool | None,
) -> dict[str, Any]:
    """Merge the strategy's arguments into the user's config; a value set differently in both raises."""
    cfg = _load_user_config(config)
    zero = cfg.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise MisconfigurationError("zero_optimization in the DeepSpeed config must be a dict.")
    cfg_stage = zero.get("stage")
    if stage is not None and cfg_stage is not None and int(cfg_stage) != stage:
        raise conflict("zero_optimization.stage", cfg_stage, f"stage={stage}")
    final_stage = stage if stage is not None else int(cfg_stage) if cfg_stage is not None else 2
    if final_stage not in (1, 2, 3):
        raise MisconfigurationError(
            f"ZeRO stage must be 1, 2 or 3, got {final_stage}. For plain data parallelism (stage 0) use "
            "strategy='ddp'."
        )
    zero["stage"] = final_stage
    for key, arg_name, arg in (
        ("offload_optimizer", "offload_optimizer", offload_optimizer),
        ("offload_param", "offload_parameters", offload_parameters),
    ):
        device = _offload_device(zero.get(key), key)
        enabled = device not in (None, "none")
        if arg is not None and device is not None and enabled != arg:
            raise conflict(f"zero_optimization.{key}.device", device, f"{arg_name}={arg}")
        if arg and device is None:
            zero[key] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        if (arg or enabled) and key == "offload_param" and final_stage != 3:
            raise MisconfigurationError(
                f"Parameter offload needs ZeRO stage 3, but the stage is {final_stage}. "
                "Pass stage=3, or drop offload_parameters."
            )
    gas = cfg.get("gradient_accumulation_steps")
    if gas is not None and int(gas) != 1:
        raise MisconfigurationError(
            f"The DeepSpeed config sets gradient_accumulation_steps={gas}. phalanx expresses accumulation the "
            "same way on every backend (no_backward_sync for the non-final micro-batches, optimizer.step() "
            "at the boundary, or Trainer(accumulate_grad_batches=N)); DeepSpeed's own counter would divide "
            "the loss a second time and skip steps. Remove gradient_accumulation_steps from the config."
        )
    if cfg.get("managed_gradient_accumulation") is False:
        raise MisconfigurationError(
            "The DeepSpeed config sets managed_gradient_accumulation=false; phalanx drives the accumulation "
            "boundary itself (see phalanx.strategies.deepspeed.strategy). Remove that key."
        )
    cfg["gradient_accumulation_steps"] = 1
    if "train_batch_size" not in cfg:
        # DeepSpeed insists on a batch size; it only uses it for its throughput log and its own loader.
        cfg.setdefault("train_micro_batch_size_per_gpu", 1)
    # DeepSpeed clips to norm 1.0 unless told otherwise; no other backend clips unasked, so off by default
    # (fabric.clip_gradients or the config's own gradient_clipping turn it on).
    cfg.setdefault("gradient_clipping", 0.0)
    # phalanx's tests run torch optimizers under ZeRO (equal to DDP); DeepSpeed would refuse them.
    cfg.setdefault("zero_allow_untested_optimizer", True)
    cfg.setdefault("zero_force_ds_cpu_optimizer", False)
    return cfg


def apply_precision(cfg: dict[str, Any], precision: str) -> None:
    """Enable the config section the Fabric precision asks for; refuse a config that enables another."""
    want = PRECISION_SECTIONS[precision]
    for section in ("bf16", "fp16"):
        aliases = ("bf16", "bfloat16") if section == "bf16" else ("fp16",)
        for key in aliases:
            entry = cfg.get(key)
            if entry is None:
                continue
            enabled = entry.get("enabled", False) if isinstance(entry, dict) else bool(entry)
            if enabled and section != want:
                raise MisconfigurationError(
                    f"The DeepSpeed config enables {key}, but Fabric's precision is {precision!r}. Set the "
                    f"precision in one place: pass precision='{'bf16-mixed' if section == 'bf16' else '16-mixed'}' "
                    f"to Fabric (and drop {key} from the config), or remove {key} from the config."
                )
            if not enabled and section == want and isinstance(entry, dict) and "enabled" in entry:
                raise MisconfigurationError(
                    f"The DeepSpeed config sets {key}.enabled=false, but Fabric's precision is {precision!r}, "
                    f"which needs it. Remove {key}.enabled from the config or choose precision='32-true'."
                )
    if want is not None:
        key = "bfloat16" if want == "bf16" and "bfloat16" in cfg else want
        section_cfg = cfg.setdefault(key, {})
        section_cfg["enabled"] = True
