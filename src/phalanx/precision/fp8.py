"""``"fp8-mixed"``: the matrix multiplications of eligible ``nn.Linear`` layers in float8 (torchao's float8
training), everything else as ``"bf16-mixed"``.

The name follows Lightning's ``<dtype>-<mode>`` strings: parameters stay float32 (``-mixed``), the eligible
layers compute in float8. Lightning's own float8 plugins are named after the library they wrap
(``"transformer-engine"``), which phalanx does not use; torchtitan applies the same technique as its
``float8`` model converter, which is what :meth:`Float8Precision.convert_module` does, through
``torchao.float8.convert_to_float8_training``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from phalanx.precision.base import Placement
from phalanx.precision.mixed import MixedPrecision
from phalanx.utils.diagnostics import warn
from phalanx.utils.errors import MisconfigurationError

INSTALL_HINT = "pip install 'phalanx[fp8]'"
#: torchao's scaling recipes (``Float8LinearConfig.from_recipe_name``).
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: torch._scaled_mm needs both dimensions of a float8 weight divisible by 16.
_MULTIPLE = 16
_FLOAT8_GPUS = "compute capability >= 8.9: L4, L40S, RTX 4090, H100, H200, B200 or newer"


def import_float8() -> ModuleType:
    """``torchao.float8``, or an error that says how to install it."""
    try:
        float8 = importlib.import_module("torchao.float8")
    except Exception as err:  # missing, or built for another torch (which fails in many ways)
        raise MisconfigurationError(
            f"precision='fp8-mixed' needs torchao's float8 training, which does not import here "
            f"({type(err).__name__}: {err}). Install it with `{INSTALL_HINT}` (torchao's release must match torch "
            f"{torch.__version__}; the extra's torchao 0.18 runs with torch 2.13)."
        ) from err
    return float8


class Float8Precision(MixedPrecision):
    """``precision="fp8-mixed"``: bf16 mixed precision, with the matmuls of eligible ``nn.Linear`` layers in
    float8 (dynamic scales, torchao's ``Float8Linear``). Under FSDP2 the float8 weights are all-gathered in
    float8, and their scales are computed for the next step in one all-reduce after each optimizer step.

    Eligible: a plain ``nn.Linear`` (a subclass keeps its own forward) whose in and out features are both
    divisible by 16 (float8 matmuls need it), other than the model itself.

    Args:
        emulate: run the float8 matmuls in emulation (any device, the CPU included; slow, numerically the same
            casts). Without it fp8 needs a CUDA GPU with compute capability >= 8.9.
        recipe: torchao's scaling recipe, ``"tensorwise"`` (default), ``"rowwise"`` or ``"rowwise_with_gw_hp"``.
        module_filter_fn: ``fn(linear, fqn) -> bool``, which eligible layers to convert. Default: every one but
            the output head, taken to be the model's last ``nn.Linear`` (as torchtitan skips ``output``).
        fsdp_float8_all_gather: under FSDP2 with the tensorwise recipe, all-gather the weights in float8 (half
            the bytes of bf16) and precompute their scales after each optimizer step.
    """

    def __init__(
        self,
        *,
        emulate: bool = False,
        recipe: str = "tensorwise",
        module_filter_fn: Callable[[nn.Linear, str], bool] | None = None,
        fsdp_float8_all_gather: bool = True,
    ) -> None:
        super().__init__("bf16-mixed")
        if recipe not in RECIPES:
            raise MisconfigurationError(f"Float8Precision(recipe={recipe!r}): choose one of {RECIPES}.")
        self.name = "fp8-mixed"
        self.emulate = emulate
        self.recipe = recipe
        self.module_filter_fn = module_filter_fn
        self.fsdp_float8_all_gather = fsdp_float8_all_gather
        #: The layers converted to float8, by qualified name within the module set up.
        self.converted: list[str] = []
        # Modules whose float8 weights FSDP2 all-gathers in float8: their scales are precomputed after a step.
        self._gathered_in_float8: list[weakref.ref[nn.Module]] = []

    def configure(self, placement: Placement) -> None:
        if placement.tensor_parallel:
            raise MisconfigurationError(
                "precision='fp8-mixed' does not run under tensor parallelism here: the layers' parallel styles "
                "would have to be torchao's float8 ones. Use strategy='fsdp' (float8 all-gather included), or "
                "precision='bf16-mixed' with ModelParallelStrategy."
            )
        import_float8()
        if not self.emulate:
            self._check_device(placement.device_type)
        super().configure(placement)
        # A new strategy is a new run: the modules of an earlier one are not this one's to precompute.
        self.converted.clear()
        self._gathered_in_float8.clear()

    @staticmethod
    def _check_device(device_type: str) -> None:
        hint = ("Train with precision='bf16-mixed' here, or pass precision=Float8Precision(emulate=True) (from "
                "phalanx.precision) to run the float8 code path emulated: slow, for tests.")
        if device_type != "cuda":
            raise MisconfigurationError(
                f"precision='fp8-mixed' runs float8 matmuls on a CUDA GPU ({_FLOAT8_GPUS}); this run is on "
                f"{device_type!r}. {hint}"
            )
        capability = torch.cuda.get_device_capability()
        if capability < (8, 9):
            raise MisconfigurationError(
                f"precision='fp8-mixed' needs a GPU with {_FLOAT8_GPUS}; {torch.cuda.get_device_name()} has "
                f"{capability[0]}.{capability[1]}. {hint}"
            )

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    def convert_module(self, module: nn.Module) -> nn.Module:
        module = super().convert_module(module)
        float8 = import_float8()
        gather = self.placement.fsdp_casts and self.fsdp_float8_all_gather and self.recipe == "tensorwise"
        config = dataclasses.replace(
            float8.Float8LinearConfig.from_recipe_name(self.recipe),
            emulate=self.emulate, enable_fsdp_float8_all_gather=gather,
        )
        chosen = self._choose(module)
        if not chosen:
            warn(
                f"precision='fp8-mixed' found no layer of {type(module).__name__} to run in float8 (an eligible "
                "layer is a plain nn.Linear with in and out features divisible by 16, not the output head); it "
                "trains as precision='bf16-mixed'.",
                rank=int(os.environ.get("RANK", "0")),
            )
            return module
        float8.convert_to_float8_training(module, config=config, module_filter_fn=lambda _, fqn: fqn in chosen)
        self.converted.extend(sorted(chosen))
        if gather:
            self._gathered_in_float8.append(weakref.ref(module))
            module.register_state_dict_post_hook(_plain_weights)
            module.register_load_state_dict_post_hook(self._weights_loaded)
        return module

    def _choose(self, module: nn.Module) -> set[str]:
        linears = [(fqn, m) for fqn, m in module.named_modules() if type(m) is nn.Linear]
        head = linears[-1][0] if linears else ""
        chosen = set()
        for fqn, linear in linears:
            if not fqn or linear.in_features % _MULTIPLE or linear.out_features % _MULTIPLE:
                continue
            if self.module_filter_fn(linear, fqn) if self.module_filter_fn is not None else fqn != head:
                chosen.add(fqn)
        return chosen

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        if self._gathered_in_float8:
            with self.placement.guarded("float8 weight scales (precompute_float8_dynamic_scale_for_fsdp)"):
                self._precompute_scales(optimizer)

    def _precompute_scales(self, optimizer: Optimizer) -> None:
        # One all-reduce for every float8 weight's scale, instead of one per weight inside each all-gather; only
        # for the modules this optimizer changed (a frozen teacher's scales stay valid). Every rank holds the same
        # modules and optimizer, so every rank makes the same all-reduces.
        float8 = import_float8()
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for module in self._gathered_modules():
            if any(id(p) in stepped for p in module.parameters()):
                float8.precompute_float8_dynamic_scale_for_fsdp(module)

    def _gathered_modules(self) -> list[nn.Module]:
        return [m for m in (ref() for ref in self._gathered_in_float8) if m is not None]

    def _drop_scales(self) -> None:
        """Forget the precomputed scales: torchao keeps them until its next precompute, so after weights change any
        other way than by a step (a load) the next all-gather would cast them with the old weights' scales. Without
        one, the all-gather computes each scale from the weight itself (torchao's dynamic path, the same value)."""
        from torch.distributed.tensor import DTensor

        for module in self._gathered_modules():
            for param in module.parameters():
                # torch's attribute: to_local() of a parameter is a fresh view, not the tensor torchao annotates.
                local = param._local_tensor if isinstance(param, DTensor) else None
                if getattr(local, "_precomputed_scale", None) is not None:
                    setattr(local, "_precomputed_scale", None)  # noqa: B010  (torchao's attribute, no setter)

    def _weights_loaded(self, module: nn.Module, incompatible_keys: Any) -> None:
        self._drop_scales()

    def state_dict(self) -> dict[str, Any]:
        return {"float8_recipe": self.recipe}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Every phalanx load (checkpoint, snapshot, a tuner's restore point) ends here after the weights are back,
        # some by copying into the shards in place, which no load_state_dict hook sees.
        super().load_state_dict(state)
        self._drop_scales()


def _plain_weights(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """A float8 weight FSDP all-gathers in float8 is a DTensor over torchao's wrapper tensor, which holds no storage
    of its own: the state dict gets the DTensor over the wrapped float32 shard (the same storage), so checkpoints
    and snapshots hold plain tensors and loads write into the weight itself."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for key, value in state_dict.items():
            if not isinstance(value, DTensor):
                continue
            local = value.to_local()
            if type(local) is torch.Tensor or not hasattr(local, "__tensor_flatten__"):
                continue
            names, _ = local.__tensor_flatten__()  # a traceable wrapper subclass names its inner tensors
            state_dict[key] = DTensor.from_local(getattr(local, names[0]), value.device_mesh, value.placements,
                                                 run_check=False, shape=value.shape, stride=value.stride())


__all__ = ["INSTALL_HINT", "RECIPES", "Float8Precision", "import_float8"]
