"""``Module.load_from_checkpoint`` / ``DataModule.load_from_checkpoint`` / ``DataModule.from_datasets``.

A model is rebuilt with the constructor arguments its checkpoint recorded (overridable by keyword),
and a partial load names the keys that did not match.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from phalanx.utils.errors import CheckpointError, MisconfigurationError


def _read(path: str | Path, weights_only: bool | None) -> dict[str, Any]:
    """Everything in a phalanx checkpoint (a file or a sharded directory), as plain CPU values.
    ``weights_only`` (None means True) is the checkpoint layer's: False only for a trusted file."""
    from phalanx.checkpoint import read_everything

    return read_everything(Path(path), weights_only=weights_only is not False)


def _hparams_from_file(path: str | Path) -> dict[str, Any]:
    try:
        import yaml  # type: ignore[import-untyped, unused-ignore]
    except ImportError as err:
        raise MisconfigurationError("hparams_file= needs PyYAML: pip install pyyaml.") from err
    with open(path) as fh:
        loaded = yaml.safe_load(fh) or {}
    if not isinstance(loaded, dict):
        raise MisconfigurationError(f"hparams_file {path} holds a {type(loaded).__name__}, not a mapping.")
    return loaded


def _constructor_kwargs(cls: type, ckpt: dict[str, Any], key: str, hparams_file: Any, kwargs: dict[str, Any]) -> Any:
    saved = dict(ckpt.get(key) or {})
    if hparams_file is not None:
        saved = _hparams_from_file(hparams_file)
    params = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    names = [n for n, p in list(params.items())[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    name = ckpt.get(key.replace("hyper_parameters", "hparams_name"))
    if name and name != "kwargs" and name in names:
        saved = {name: saved}  # save_hyperparameters(config) recorded one argument's contents
    merged = {**saved, **kwargs}
    if not takes_kwargs:
        merged = {k: v for k, v in merged.items() if k in names}
    return merged


def _device(map_location: Any) -> torch.device:
    if map_location is None:
        return torch.device("cpu")
    if isinstance(map_location, (str, int, torch.device)):
        return torch.device(map_location)
    raise MisconfigurationError(
        f"load_from_checkpoint(map_location={type(map_location).__name__}) is not supported: pass a device (e.g. "
        "'cpu', 'cuda:0') or leave it unset; remapping storages by dict or function is not."
    )


def load_module(
    cls: type, path: str | Path, map_location: Any, hparams_file: Any, strict: bool | None,
    weights_only: bool | None, kwargs: dict[str, Any], builds_in_configure_model: bool = False,
) -> Any:
    """``Module.load_from_checkpoint``; ``builds_in_configure_model``: the class overrides
    ``configure_model`` (told by the caller, so this module needs no import of the Module class)."""
    from phalanx.checkpoint import load_into_module

    device = _device(map_location)
    ckpt = _read(path, weights_only)
    state = ckpt.get("state_dict", ckpt.get("model"))
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{path} has no model weights (no 'model' or 'state_dict' entry; keys: {sorted(ckpt)}). Was it written "
            "by trainer.save_checkpoint / ModelCheckpoint?"
        )
    model = cls(**_constructor_kwargs(cls, ckpt, "hyper_parameters", hparams_file, kwargs))
    if strict is not None and model.strict_loading_set and strict != model.strict_loading:
        raise MisconfigurationError(
            f"load_from_checkpoint(strict={strict}) contradicts {cls.__name__}.strict_loading={model.strict_loading};"
            " set one of them."
        )
    strict = model.strict_loading if strict is None else strict
    if builds_in_configure_model:
        model.configure_model()
    model.on_load_checkpoint(ckpt)
    load_into_module(model, state, strict)
    return model.to(device)


def load_datamodule(
    cls: type, path: str | Path, hparams_file: Any, weights_only: bool | None, kwargs: dict[str, Any]
) -> Any:
    ckpt = _read(path, weights_only)
    datamodule = cls(**_constructor_kwargs(cls, ckpt, "datamodule_hyper_parameters", hparams_file, kwargs))
    if "datamodule" in ckpt:
        datamodule.load_state_dict(ckpt["datamodule"])
    return datamodule


def datamodule_from_datasets(
    cls: type, train: Any, val: Any, test: Any, predict: Any, batch_size: int, num_workers: int,
    extra: dict[str, Any],
) -> Any:
    from torch.utils.data import DataLoader, IterableDataset

    def loaders(ds: Any, shuffle: bool) -> Any:
        if isinstance(ds, (list, tuple)):
            return [loaders(d, shuffle) for d in ds]
        if isinstance(ds, dict):
            return {k: loaders(d, shuffle) for k, d in ds.items()}
        return DataLoader(ds, batch_size=batch_size, num_workers=num_workers,
                          shuffle=shuffle and not isinstance(ds, IterableDataset))

    datamodule = cls(**extra)
    datasets = {"train_dataloader": (train, True), "val_dataloader": (val, False),
                "test_dataloader": (test, False), "predict_dataloader": (predict, False)}
    for method, (ds, shuffle) in datasets.items():
        if ds is not None:
            setattr(datamodule, method, lambda ds=ds, shuffle=shuffle: loaders(ds, shuffle))
    return datamodule
