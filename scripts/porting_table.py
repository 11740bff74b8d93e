"""Generate the Lightning -> phalanx name table of docs/porting.md.

Run it with a Python that has Lightning installed (the peer venv; phalanx never depends on Lightning):

    /work/lightning-venv/bin/python scripts/porting_table.py            # rewrite the table in docs/porting.md
    /work/lightning-venv/bin/python scripts/porting_table.py --check    # exit 1 if docs/porting.md is stale

It introspects Lightning's public Fabric, Trainer, LightningModule, LightningDataModule, Callback hooks,
callbacks, loggers, profilers and Tuner, finds each name in phalanx, and compares parameter names.
Each row is one of:

* yes: the name exists with Lightning's parameters;
* yes, other parameters: it exists, but some of Lightning's parameters are not accepted (listed);
* deliberate difference: it exists and behaves differently on purpose (the reason is given);
* missing: phalanx has no such name.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
DOC = REPO / "docs" / "porting.md"
START, END = "<!-- generated table: start -->", "<!-- generated table: end -->"

# Every deliberate difference, with its reason. Keys: "<Section>.<name>" as in the table.
DIFFERENCES: dict[str, str] = {
    "Fabric.all_gather": "always adds the leading world dimension, also on one process (Lightning omits it when "
                         "world_size == 1), so code written for N ranks runs unchanged on one; group= is refused "
                         "(collectives span all ranks and are lockstep-checked)",
    "Fabric.init_module": "empty_init=True under FSDP/ModelParallelStrategy materializes the meta model with the "
                          "values one process draws on any number of ranks (each module initialized whole from the "
                          "shared seeded state, each rank keeping its slice); Lightning on CPU lets every rank draw "
                          "its own shard from the same state (repeated rows)",
    "Fabric.all_reduce": "the mean of an integer tensor is refused (Lightning truncates it); Python ints are "
                         "averaged as floats; group= is refused",
    "Fabric.setup": "move_to_device=False is refused when the module is not already on the rank's device (every "
                    "strategy runs it there); a torch.compile'd module is set up and compiled again with the same "
                    "settings as in Lightning, but refused under DeepSpeed and together with a strategy's compile=",
    "Fabric.setup_module": "as Fabric.setup",
    "Fabric.save": "filter= is refused: checkpoints hold whole state dicts so they always load back strictly",
    "Fabric.load": "weights_only=False is refused: phalanx's reader never runs code from the file",
    "Fabric.load_raw": "weights_only=False is refused",
    "Fabric.__init__": "plugins= is refused with the phalanx equivalent of each plugin kind; warn_nonfinite_loss= "
                       "(phalanx's own, on by default) warns naming the rank and backward call of a nan/inf loss",
    "Fabric.backward": "gradients are in sync on every call path (a DDP submodule called directly is synced, or "
                       "the step is refused), where Lightning silently steps on unsynced gradients; a loss from "
                       "modules none of which was set up is refused on several processes (allowed on one, as in "
                       "Lightning); a nan/inf loss is never silent (a warning names the rank and backward call)",
    "loggers.LitLogger": "importable, but constructing it is refused (phalanx uploads nothing): the message names "
                         "CSVLogger, TensorBoardLogger, WandbLogger and MLFlowLogger",
    "Trainer.plugins": "refused, with the equivalent of each plugin kind (precision=, strategy objects, "
                       "sync_batchnorm=)",
    "Trainer.model_registry": "refused: phalanx uploads nothing",
    "Trainer.val_check_interval": "a time interval (str/timedelta/dict) is refused: validation would fall on a "
                                  "different batch in every rerun; ints and fractions as in Lightning",
    "Trainer.logger": "the default logger is a CSVLogger (Lightning: TensorBoard when installed), so no optional "
                      "package is needed",
    "Trainer.num_sanity_val_steps": "the sanity check restores every RNG state afterwards, so a fit is the same "
                                    "with or without it (Lightning's consumes random numbers)",
    "Trainer.use_distributed_sampler": "phalanx's training sampler orders data by seed + epoch identically for "
                                       "every world size (exact resume, N ranks == 1 process); evaluation scores "
                                       "each sample once (no padding duplicates) or refuses the split",
    "Trainer.save_checkpoint": "storage_options= is refused (checkpoints are written atomically by the strategy); "
                               "saving inside a gradient-accumulation window is refused",
    "Trainer.fit": "weights_only=False is refused",
    "Trainer.validate": "weights_only=False is refused",
    "Trainer.test": "weights_only=False is refused",
    "Trainer.predict": "weights_only=False is refused",
    "LightningModule.training_step": "returning None (skip the batch) is refused in automatic optimization: on "
                                     "several ranks the others would wait in backward",
    "LightningModule.log": "sync_dist=False metrics take rank 0's value on every rank (Lightning keeps each "
                           "rank's), so callbacks decide identically everywhere; enable_graph=True, "
                           "sync_dist_group, add_dataloader_idx=False, metric_attribute and rank_zero_only=True "
                           "are refused with the reason",
    "LightningModule.log_dict": "as LightningModule.log",
    "LightningModule.load_from_checkpoint": "weights_only=False is refused; map_location must be a device",
    "LightningModule.all_gather": "as Fabric.all_gather",
    "LightningModule.trainer": "under a Fabric loop, self.trainer raises (use self.fabric)",
    "LightningDataModule.load_from_checkpoint": "weights_only=False is refused",
    **{f"{owner}.{hook}": "overriding it is refused (phalanx's data loaders move batches to the device; do the work "
                          "in collate_fn or in the *_step method)"
       for owner in ("LightningModule", "LightningDataModule")
       for hook in ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")},
    "callbacks.TQDMProgressBar": "process_position and leave=True are refused (one bar per stage on rank 0)",
    "callbacks.RichProgressBar": "leave/theme/console_kwargs are refused",
    "Tuner.lr_find": "method must be 'fit'; val_dataloaders are accepted but not used (the range test trains only); "
                     "the suggestion rule, the probe fits on a still-falling curve (probe=), the learning-rate "
                     "steps, the stop at a non-finite loss, the search not capped by max_epochs and the in-memory "
                     "restore differ (see Deliberate differences)",
    "callbacks.LearningRateFinder": "runs Tuner.lr_find: its suggestion rule, probe fits on a still-falling curve "
                                    "(probe=), learning-rate steps, stop at a non-finite loss, search not capped by "
                                    "max_epochs and in-memory restore differ (see Deliberate differences)",
}


def params(obj: Any) -> list[str] | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return [p.name for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            and p.name not in ("self", "cls") and not p.name.startswith("_")]


def accepts_anything(obj: Any) -> bool:
    try:
        return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return False


def public(cls: type, exclude: set[str]) -> list[str]:
    return sorted(n for n in dir(cls) if not n.startswith("_") and n not in exclude)


def kind(cls: type, name: str) -> str:
    attr = inspect.getattr_static(cls, name, None)
    return "property" if isinstance(attr, property) else ("method" if callable(getattr(cls, name, None)) else "attr")


def row(section: str, name: str, theirs: Any, ours_owner: Any, ours_name: str | None = None) -> tuple[str, ...]:
    key = f"{section}.{name}"
    ours_name = ours_name or name
    found = ours_owner is not None and (hasattr(ours_owner, ours_name) or ours_name in getattr(
        ours_owner, "__dict__", {}))
    if not found:
        return (section, name, "missing", "")
    ours = getattr(ours_owner, ours_name)
    if key in DIFFERENCES:
        absent = _absent(theirs, ours)
        extra = f"; not accepted: {', '.join(absent)}" if absent else ""
        return (section, name, "deliberate difference", DIFFERENCES[key] + extra)
    if callable(theirs) and callable(ours) and not isinstance(inspect.getattr_static(ours_owner, ours_name, None),
                                                                property):
        mine = params(ours)
        want = params(theirs)
        if mine is not None and want is not None and not accepts_anything(ours):
            if section == "Callback":
                # The Trainer calls hooks positionally: what matters is that each argument has a place.
                if len(mine) < len(want):
                    return (section, name, "yes, other parameters", f"takes {len(mine)} of {len(want)} arguments")
                return (section, name, "yes", "")
            absent = [p for p in want if p not in mine]
            if absent:
                return (section, name, "yes, other parameters", "not accepted: " + ", ".join(absent))
    return (section, name, "yes", "")


def _absent(theirs: Any, ours: Any) -> list[str]:
    if not (callable(theirs) and callable(ours)) or accepts_anything(ours):
        return []
    mine, want = params(ours), params(theirs)
    if mine is None or want is None:
        return []
    return [p for p in want if p not in mine]


def table_rows() -> list[tuple[str, ...]]:
    import lightning.fabric as lf
    import lightning.pytorch as lp
    import torch
    from lightning.pytorch import callbacks as lcb
    from lightning.pytorch import loggers as llog
    from lightning.pytorch import profilers as lprof
    from lightning.pytorch.tuner import Tuner as LTuner

    import phalanx
    from phalanx import callbacks as pcb
    from phalanx import loggers as plog
    from phalanx import profilers as pprof
    from phalanx.tuner.lr_find import Tuner as PTuner

    rows: list[tuple[str, ...]] = []
    for pkg, names in (("lightning", ["Callback", "Fabric", "LightningDataModule", "LightningModule", "Trainer",
                                      "seed_everything"]),
                       ("lightning.pytorch", list(lp.__all__)), ("lightning.fabric", list(lf.__all__))):
        for name in names:
            rows.append(row(pkg, name, getattr(lp if pkg != "lightning.fabric" else lf, name, None), phalanx))
    # Fabric
    rows.append(row("Fabric", "__init__", lf.Fabric.__init__, phalanx.Fabric))
    for name in public(lf.Fabric, set()):
        rows.append(row("Fabric", name, getattr(lf.Fabric, name), phalanx.Fabric))
    # Trainer
    trainer_params = params(lp.Trainer.__init__) or []
    ours_params = set(params(phalanx.Trainer.__init__) or [])
    for name in trainer_params:
        key = f"Trainer.{name}"
        if name not in ours_params:
            rows.append(("Trainer", name, "missing", "argument"))
        elif key in DIFFERENCES:
            rows.append(("Trainer", name, "deliberate difference", DIFFERENCES[key]))
        else:
            rows.append(("Trainer", name, "yes", "argument"))
    for name in public(lp.Trainer, set(trainer_params)):
        rows.append(row("Trainer", name, getattr(lp.Trainer, name), _instance_attrs(phalanx.Trainer)))
    # LightningModule (without nn.Module's own API), LightningDataModule
    module_base = set(dir(torch.nn.Module))
    for name in public(lp.LightningModule, module_base):
        rows.append(row("LightningModule", name, getattr(lp.LightningModule, name), phalanx.LightningModule))
    for name in public(lp.LightningDataModule, set()):
        rows.append(row("LightningDataModule", name, getattr(lp.LightningDataModule, name),
                        phalanx.LightningDataModule))
    # Callback hooks, callbacks, loggers, profilers, Tuner
    for name in public(lcb.Callback, set()):
        rows.append(row("Callback", name, getattr(lcb.Callback, name), pcb.Callback))
    for name in lcb.__all__:
        rows.append(row("callbacks", name, getattr(lcb, name), pcb))
    for name in llog.__all__:
        rows.append(row("loggers", name, getattr(llog, name), plog))
    for name in lprof.__all__:
        rows.append(row("profilers", name, getattr(lprof, name), pprof))
    for name in public(LTuner, set()):
        rows.append(row("Tuner", name, getattr(LTuner, name), PTuner))
    return rows


class _instance_attrs:
    """The Trainer's attributes as an instance has them (some are set in __init__, not on the class)."""

    def __init__(self, cls: type) -> None:
        import phalanx

        self._cls = cls
        trainer = phalanx.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                                  enable_checkpointing=False, enable_model_summary=False)
        self.__dict__.update({k: v for k, v in vars(trainer).items() if not k.startswith("_")})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cls, name)


def render(rows: list[tuple[str, ...]]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r[2]] = counts.get(r[2], 0) + 1
    summary = ", ".join(f"{counts.get(k, 0)} {k}" for k in ("yes", "yes, other parameters", "deliberate difference",
                                                            "missing"))
    import lightning

    lines = [
        START,
        f"Generated by `scripts/porting_table.py` against Lightning {lightning.__version__}: {len(rows)} names; "
        f"{summary}.",
        "",
        "| where | name | in phalanx | notes |",
        "|---|---|---|---|",
    ]
    for section, name, status, note in rows:
        lines.append(f"| {section} | `{name}` | {status} | {note.replace('|', '/')} |")
    lines.append(END)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/porting.md is not up to date")
    args = parser.parse_args()
    table = render(table_rows())
    text = DOC.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{DOC} has no {START} ... {END} markers")
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    updated = before + table + after
    if args.check:
        if updated != text:
            print(f"{DOC} is out of date: run scripts/porting_table.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(updated)
    print(table.splitlines()[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
