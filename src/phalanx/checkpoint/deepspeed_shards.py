"""DeepSpeed engine checkpoints read in one plain process: ZeRO's partitions merged into full tensors.

DeepSpeedStrategy's sharded checkpoint is DeepSpeed's own engine checkpoint (``checkpoint/`` in the
directory): per rank, the float32 master partition of each flattened parameter group and the torch
optimizer's state of that partition (same layout). Only the same world size and ZeRO stage can load
it natively. Everything else (another stage, another world size, another strategy) reads it here in
full: the weights as DeepSpeed's own ``zero_to_fp32`` rebuilds them, and the optimizer state rebuilt
with the same merge (each state tensor is laid out like the master partition it belongs to), in
torch's index-keyed layout, the form a single-file checkpoint holds. DeepSpeed's merge helpers are
private; a version that changes them gives a ``CheckpointError`` that says how to get a portable
checkpoint, never a half-converted one.

DeepSpeed's optimizer files pickle a few plain classes of its own (the ZeRO stage enum, the loss
scaler, ZeRO-2's fragment addresses). They are allowed by name, so the files open with
``weights_only=True`` like every other checkpoint.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint.format import DEEPSPEED_LAYOUT, META_KEY, read_file
from phalanx.checkpoint.protocol import DEEPSPEED, MODULE, Entry, Shapes, Source, guess_kind, placeholder
from phalanx.utils.errors import CheckpointError

TAG = "checkpoint"
PORTABLE = ("save it in the portable form instead: in the original setup, DeepSpeedStrategy(state_dict_type='full') "
            "writes one file every strategy and world size loads")


def _deepspeed_globals() -> list[Any]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def _load(path: Path, weights_only: bool) -> dict[str, Any]:
    try:
        if weights_only:
            with torch.serialization.safe_globals(_deepspeed_globals()):
                out = torch.load(path, map_location="cpu", weights_only=True)
        else:
            out = torch.load(path, map_location="cpu", weights_only=False)
    except ImportError as err:
        raise CheckpointError(f"Reading the DeepSpeed checkpoint file {path} needs DeepSpeed "
                              "(pip install 'phalanx[deepspeed]').") from err
    except Exception as err:
        raise CheckpointError(
            f"Cannot read the DeepSpeed checkpoint file {path}: {type(err).__name__}: {str(err).splitlines()[0]}. If "
            "it holds other DeepSpeed objects and you trust where it comes from, load with weights_only=False."
        ) from err
    if not isinstance(out, dict):
        raise CheckpointError(f"{path} holds a {type(out).__name__}, not a DeepSpeed checkpoint.")
    return out


def _by_rank(files: list[Path]) -> list[Path]:
    def rank(path: Path) -> int:
        found = re.search(r"zero_pp_rank_(\d+)_", path.name)
        return int(found.group(1)) if found else 0

    return sorted(files, key=rank)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DeepSpeed's merge prints its progress; in a training job that is noise on every rank."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


class DeepSpeedShards:
    """Reads a DeepSpeedStrategy sharded checkpoint in full (``ShardIO`` for reading only)."""

    layout = DEEPSPEED_LAYOUT

    def write(self, directory: Path, entries: list[Entry]) -> dict[str, Any]:
        raise CheckpointError("DeepSpeed engine checkpoints are written by DeepSpeedStrategy only.")

    def check(self, directory: Path, info: dict[str, Any], entries: list[Entry], weights_only: bool = True) -> None:
        folder = directory / TAG
        optim = list(folder.glob("*optim_states.pt"))
        if not list(folder.glob("*model_states.pt")) or len(optim) != info.get("world_size"):
            raise CheckpointError(
                f"{directory} is not a complete DeepSpeed engine checkpoint: {folder} should hold the model states "
                f"and {info.get('world_size')} optimizer files ({len(optim)} found). Use an earlier checkpoint."
            )

    def saved_shapes(self, directory: Path, info: dict[str, Any], key: str) -> Shapes | None:
        return None  # the loading strategy's own load checks names and shapes

    def read(self, directory: Path, info: dict[str, Any], entries: list[Entry], strict: bool) -> None:
        raise CheckpointError("DeepSpeedShards reads in full only; a strategy loads through FullStateReader.")

    def read_all(self, directory: Path, info: dict[str, Any], weights_only: bool = True) -> dict[str, Any]:
        sharded = list(info.get("sharded", []))
        if not sharded:
            return {}
        self.check(directory, info, [], weights_only)
        try:
            from deepspeed.utils import zero_to_fp32
        except ImportError as err:
            raise CheckpointError(f"Reading the DeepSpeed checkpoint {directory} needs DeepSpeed "
                                  "(pip install 'phalanx[deepspeed]').") from err
        folder = directory / TAG
        models = [_model_state(zero_to_fp32, _load(f, weights_only))
                  for f in _by_rank(list(folder.glob("*model_states.pt")))]
        optims = [_load(f, weights_only)["optimizer_state_dict"]
                  for f in _by_rank(list(folder.glob("*optim_states.pt")))]
        try:
            with _quiet():
                weights, optimizer = _merge(zero_to_fp32, models, optims)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(
                f"Cannot merge the ZeRO partitions of {directory} into full tensors ({type(err).__name__}: {err}); "
                f"this DeepSpeed version's checkpoint layout is not supported. Resume with the world size and stage "
                f"it was saved with, or {PORTABLE}."
            ) from err
        out: dict[str, Any] = {sharded[0]: weights}
        if len(sharded) > 1:
            out[sharded[1]] = optimizer
        return out


def _model_state(zero_to_fp32: Any, states: dict[str, Any]) -> Any:
    buffers = set(states.get("buffer_names", []))
    return zero_to_fp32.zero_model_state(
        buffers={k: v.float() if v.is_floating_point() else v for k, v in states["module"].items() if k in buffers},
        param_shapes=states["param_shapes"],
        shared_params=[[k, v] for k, v in (states.get("shared_params") or {}).items()],
        ds_version=states.get("ds_version"),
        frozen_param_shapes=states.get("frozen_param_shapes"),
        frozen_param_fragments=states.get("frozen_param_fragments"),
    )


def _full(value: Any) -> torch.Tensor:
    """A merged tensor of its own (ZeRO-3's merge gives lazy ``GatheredTensor`` objects, ZeRO-2's views)."""
    out = value.contiguous() if not isinstance(value, torch.Tensor) else value
    return out.detach().clone()


def _merge(zero_to_fp32: Any, models: list[Any], optims: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Full float32 weights and the optimizer state in torch's index-keyed layout."""
    stage = int(optims[0]["zero_stage"])
    counts = optims[0]["partition_count"]
    world = max(counts) if isinstance(counts, list) else int(counts)
    if world != len(optims):
        raise CheckpointError(f"The checkpoint names {world} partitions but holds {len(optims)} optimizer files.")
    if stage <= 2:
        flats = [o["single_partition_of_fp32_groups"] for o in optims]
        base = [o["base_optimizer_state"] for o in optims]
        if not all(isinstance(b, dict) and "state" in b for b in base):
            raise CheckpointError(f"ZeRO's elastic checkpoint layout cannot be converted; {PORTABLE}.")
        # The saved master partitions had their padding (the last rank's group tail) removed; the
        # optimizer state still has it: cut it the same way so both line up.
        paddings = [o.get("group_paddings") or [0] * len(f) for o, f in zip(optims, flats)]
        alignment = optims[0].get("param_alignment_paddings")
        weights = zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint(world, flats, models, False, alignment)

        def merge(per_rank: list[list[torch.Tensor]]) -> dict[str, Any]:
            lean = [[t[: t.numel() - pad] for t, pad in zip(groups, paddings[r])] for r, groups in enumerate(per_rank)]
            out: dict[str, Any] = OrderedDict()
            zero_to_fp32._zero2_merge_trainable_params(out, world, lean, models, alignment)
            return out

        torch_states = [b["state"] for b in base]
        hyper = base[0].get("param_groups", [])
    elif stage == 3:
        flats = [o["fp32_flat_groups"] for o in optims]
        weights = zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint(world, flats, models, False)

        def merge(per_rank: list[list[torch.Tensor]]) -> dict[str, Any]:
            out: dict[str, Any] = OrderedDict()
            zero_to_fp32._zero3_merge_trainable_params(out, world, per_rank, models)
            return out

        torch_states = [o["optimizer_state_dict"]["state"] for o in optims]
        hyper = optims[0]["optimizer_state_dict"].get("param_groups", [])
    else:
        raise CheckpointError(f"Unknown ZeRO stage {stage} in the checkpoint.")
    weights = {k: _full(v) for k, v in weights.items()}
    return weights, _optimizer(models[0].param_shapes, torch_states, hyper, merge)


def _optimizer(param_shapes: list[dict[str, Any]], torch_states: list[dict[int, dict[str, Any]]],
               hyper: list[dict[str, Any]], merge: Any) -> dict[str, Any]:
    groups = []
    start = 0
    if hyper and len(hyper) != len(param_shapes):
        # ZeRO-3 splits a large group into sub-groups of one optimizer group each; they share its settings.
        distinct = {repr(sorted((k, v) for k, v in g.items() if k != "params")) for g in hyper}
        if len(distinct) != 1:
            raise CheckpointError(
                f"The checkpoint's {len(hyper)} ZeRO optimizer groups cannot be mapped onto the model's "
                f"{len(param_shapes)} parameter groups; {PORTABLE}."
            )
        hyper = [hyper[0]] * len(param_shapes)
    for g, shapes in enumerate(param_shapes):
        settings = {k: v for k, v in hyper[g].items() if k != "params"} if hyper else {}
        groups.append({**settings, "params": list(range(start, start + len(shapes)))})
        start += len(shapes)
    first = torch_states[0].get(0) if torch_states[0] else None
    if not first:
        return {"state": {}, "param_groups": groups}  # the optimizer had not stepped: nothing to merge
    indices = sorted(torch_states[0])
    tensor_keys = [k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
    scalars = {k: v for k, v in first.items() if k not in tensor_keys}
    merged = {key: merge([[states[i][key] for i in indices] for states in torch_states]) for key in tensor_keys}
    names = [name for shapes in param_shapes for name in shapes]
    state: dict[int, dict[str, Any]] = {}
    for index, name in enumerate(names):
        entry = {key: _full(merged[key][name]) for key in tensor_keys}
        entry.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()})
        state[index] = entry
    return {"state": state, "param_groups": groups}



# ---------------------------------------------------------------------- opened tensor by tensor
def _model_states(directory: Path) -> Path:
    """DeepSpeed's model-states file (ZeRO 1/2: one for all ranks; ZeRO-3: rank 0's holds the same shapes)."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        found = sorted(directory.glob(f"*/{name}"))
        if len(found) == 1:
            return found[0]
    raise CheckpointError(f"{directory} does not hold one DeepSpeed engine checkpoint (a folder with "
                          "mp_rank_00_model_states.pt).")


def open_deepspeed(directory: Path, weights_only: bool, marker: dict[str, Any], full: bool,
                   verified: bool | None) -> Source:
    """The checkpoint as a ``Source`` (``phalanx.checkpoint.sources``): with ``full`` everything merged now;
    otherwise the weights' shapes from DeepSpeed's model-states file, read through zero_to_fp32 when asked for."""
    meta = marker[META_KEY]
    info = meta.get("shards", {})
    entries = meta.get("entries", {})
    sharded = list(info.get("sharded", []))
    model_key = next((k for k in sharded if entries.get(k) == MODULE), "model")
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    rest = {k: entries.get(k) or guess_kind(v) for k, v in marker["extras"].items()}
    if full:
        # ZeRO keeps each parameter group as one flat partition per rank: the state is rebuilt whole.
        merged = DeepSpeedShards().read_all(directory, info, weights_only)
        return Source(directory, DEEPSPEED, meta, {**merged, **marker["extras"]},
                      {**{k: entries.get(k, MODULE) for k in merged}, **rest}, files, verified=verified)
    # Shapes without reading the partitions: DeepSpeed's model-states file holds them (and the buffers).
    states = read_file(_model_states(directory), True, what="DeepSpeed model states")
    buffers = set(states.get("buffer_names", []))
    shapes: dict[str, Any] = {}
    for group in states.get("param_shapes", []):
        shapes.update(group)
    shapes.update(states.get("frozen_param_shapes") or {})
    module: dict[str, Any] = {}
    for name, value in states.get("module", {}).items():
        if name in buffers:
            module[name] = value.float() if value.is_floating_point() else value  # zero_to_fp32's choice
    for name, shape in shapes.items():
        module[name] = placeholder(shape, torch.float32)  # the float32 master weights
    for alias, target in (states.get("shared_params") or {}).items():
        if target in module:
            module[alias] = module[target]
    source = Source(directory, DEEPSPEED, meta, {model_key: module, **marker["extras"]}, {model_key: MODULE, **rest},
                    files, verified=verified)
    merged_weights: dict[str, Any] = {}

    def weight(name: str) -> torch.Tensor:
        if not merged_weights:
            merged_weights.update(_zero_to_fp32(directory, weights_only))
        value = merged_weights[name]
        return value if isinstance(value, torch.Tensor) else value.contiguous()  # ZeRO-3's lazy gathered tensor

    for name, value in module.items():
        if value.is_meta:
            source.loaders[id(value)] = lambda name=name: weight(name)  # type: ignore[misc]
    skipped = [k for k in sharded if k != model_key]
    if skipped:
        how = "is read when converting" if not full else "is not read here"
        source.notes.append(f"{', '.join(skipped)}: DeepSpeed's partitioned optimizer state (laid out for "
                            f"{info.get('world_size')} ranks at ZeRO stage {info.get('stage')}) {how}.")
    return source


def _zero_to_fp32(directory: Path, weights_only: bool) -> dict[str, Any]:
    """The model's float32 weights through DeepSpeed's own zero_to_fp32 (its files unpickled in full)."""
    if weights_only:
        raise CheckpointError(
            f"{directory} is a DeepSpeed engine checkpoint: its optimizer files hold DeepSpeed objects that only "
            "unpickling (which can run code) rebuilds. If you trust where it comes from, pass --trust."
        )
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as err:
        raise CheckpointError(f"Reading the DeepSpeed checkpoint {directory} needs deepspeed "
                              "(pip install phalanx[deepspeed]).") from err
    # DeepSpeed prints its progress: keep stdout for phalanx's own output (--json).
    with contextlib.redirect_stdout(sys.stderr):
        out: dict[str, Any] = get_fp32_state_dict_from_zero_checkpoint(
            str(directory), tag=_model_states(directory).parent.name, lazy_mode=True)
    return out


__all__ = ["DeepSpeedShards", "open_deepspeed"]
