"""``LightningCLI`` and ``phalanx fit|validate|test|predict``: training configured from YAML and flags.

A config key the code does not have (a typo, an option of another version) is an error, never
dropped. The parser is jsonargparse (as in Lightning): it
is built from the signatures of the Trainer, the Module and the DataModule, so every key of the YAML
and every ``--trainer.max_epochs=3`` flag is checked against a real parameter and its type, and
``class_path``/``init_args`` entries build callbacks, loggers, models and datamodules.

    phalanx fit --config digits.yaml --trainer.max_epochs=3
    phalanx fit --print_config          # the full config with every default

jsonargparse is imported only here (``pip install 'phalanx[cli]'``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from phalanx.utils.errors import MisconfigurationError
from phalanx.utils.tensors import optional_module

SUBCOMMANDS = ("fit", "validate", "test", "predict")


def _jsonargparse() -> Any:
    return optional_module("jsonargparse", "LightningCLI", "cli")


class SaveConfigCallback:
    """Writes the resolved config to ``<log_dir>/config.yaml`` when fit starts (global rank 0), so a
    run can be repeated exactly. Refuses to overwrite an existing file unless ``overwrite=True``."""

    def __init__(self, parser: Any, config: Any, config_filename: str = "config.yaml", overwrite: bool = False,
                 multifile: bool = False, save_to_log_dir: bool = True) -> None:
        self.parser, self.config = parser, config
        self.config_filename, self.overwrite = config_filename, overwrite
        self.multifile, self.save_to_log_dir = multifile, save_to_log_dir

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        if not self.save_to_log_dir or stage != "fit":
            return
        log_dir = Path(trainer.log_dir)  # a collective: every rank reads it
        path = log_dir / self.config_filename
        if trainer.is_global_zero:
            if path.exists() and not self.overwrite:
                raise MisconfigurationError(
                    f"{path} exists; SaveConfigCallback does not overwrite it. Use another log dir (or version), or "
                    "pass save_config_kwargs={'overwrite': True}."
                )
            log_dir.mkdir(parents=True, exist_ok=True)
            self.parser.save(self.config, path, skip_none=False, overwrite=self.overwrite, multifile=self.multifile)


class LightningCLI:
    """Parse the command line / config files, build the Trainer, model and datamodule, and run the
    subcommand (Lightning's LightningCLI; hooks ``add_arguments_to_parser``, ``before_instantiate_classes``,
    ``after_instantiate_classes``, ``before_<subcommand>``, ``after_<subcommand>``).

    Args:
        model_class / datamodule_class: the classes (or base classes with ``subclass_mode_*=True``, then the
            config chooses with ``class_path``). None: any phalanx.Module / DataModule by class_path.
        save_config_callback / save_config_kwargs: how the config is saved (None: not saved).
        trainer_class / trainer_defaults: the Trainer and defaults for its arguments.
        seed_everything_default: True (seed chosen and saved), False (no seeding) or an int.
        parser_kwargs: for the ArgumentParser (e.g. ``{"default_config_files": [...]}``).
        args: the arguments (default ``sys.argv[1:]``), a list or a dict.
        run: run the subcommand (False: only parse and instantiate; then no subcommand is expected).
        auto_configure_optimizers: with ``--optimizer``/``--lr_scheduler`` given, they replace the module's
            configure_optimizers.
    """

    def __init__(
        self,
        model_class: Any = None,
        datamodule_class: Any = None,
        save_config_callback: Any = SaveConfigCallback,
        save_config_kwargs: dict[str, Any] | None = None,
        trainer_class: Any = None,
        trainer_defaults: dict[str, Any] | None = None,
        seed_everything_default: bool | int = True,
        parser_kwargs: dict[str, Any] | None = None,
        parser_class: Any = None,
        subclass_mode_model: bool = False,
        subclass_mode_data: bool = False,
        args: Sequence[str] | dict[str, Any] | None = None,
        run: bool = True,
        auto_configure_optimizers: bool = True,
        load_from_checkpoint_support: bool = True,
    ) -> None:
        from phalanx.core.datamodule import DataModule
        from phalanx.core.module import Module
        from phalanx.trainer.trainer import Trainer

        self.jsonargparse = _jsonargparse()
        self.save_config_callback = save_config_callback
        self.save_config_kwargs = save_config_kwargs or {}
        self.trainer_class = trainer_class or Trainer
        self.trainer_defaults = trainer_defaults or {}
        self.seed_everything_default = seed_everything_default
        self.parser_kwargs = parser_kwargs or {}
        self.parser_class = parser_class or self.jsonargparse.ArgumentParser
        self.auto_configure_optimizers = auto_configure_optimizers
        self.load_from_checkpoint_support = load_from_checkpoint_support
        self.model_class = model_class or Module
        self.subclass_mode_model = model_class is None or subclass_mode_model
        self.datamodule_class = datamodule_class
        self.subclass_mode_data = datamodule_class is None or subclass_mode_data
        self._data_base = datamodule_class or DataModule
        self.parser = self._build_parser(run)
        self.config = self.parse(args)
        self.subcommand = self.config.get("subcommand") if run else None
        self.before_instantiate_classes()
        self.instantiate_classes()
        self.after_instantiate_classes()
        if self.subcommand is not None:
            self._run_subcommand(self.subcommand)

    # ------------------------------------------------------------------ parser
    def _new_parser(self, **kwargs: Any) -> Any:
        # allow_abbrev=False: argparse would otherwise take "--trainer.max_epoch" for "--trainer.max_epochs".
        return self.parser_class(**{"allow_abbrev": False, **self.parser_kwargs, **kwargs})

    def _build_parser(self, run: bool) -> Any:
        if not run:
            parser = self._new_parser()
            self._add_arguments(parser, None)
            return parser
        parser = self._new_parser(description="phalanx: train from a config (jsonargparse)")
        subcommands = parser.add_subcommands(required=True, dest="subcommand")
        for name in SUBCOMMANDS:
            sub = self._new_parser(description=f"trainer.{name}() from a config")
            self._add_arguments(sub, name)
            subcommands.add_subcommand(name, sub, help=f"run trainer.{name}()")
        return parser

    def _add_arguments(self, parser: Any, subcommand: str | None) -> None:
        from phalanx.callbacks import Callback
        from phalanx.loggers import Logger

        ja = self.jsonargparse
        parser.add_argument("-c", "--config", action=ja.ActionConfigFile, help="a YAML config file (repeatable)")
        parser.add_argument("--seed_everything", type=bool | int, default=self.seed_everything_default,
                            help="True: pick and record a seed; an int: that seed; False: no seeding")
        parser.add_class_arguments(self.trainer_class, "trainer", skip={"callbacks", "logger"}, fail_untyped=False,
                                   instantiate=False)
        parser.add_argument("--trainer.callbacks", type=list[Callback] | Callback | None, default=None)
        parser.add_argument("--trainer.logger", type=bool | Logger | list[Logger] | None, default=None)
        if self.trainer_defaults:
            parser.set_defaults({f"trainer.{k}": v for k, v in self.trainer_defaults.items()})
        if self.subclass_mode_model:
            parser.add_subclass_arguments(self.model_class, "model", fail_untyped=False, required=True)
        else:
            parser.add_class_arguments(self.model_class, "model", fail_untyped=False)
        if self.subclass_mode_data:
            parser.add_subclass_arguments(self._data_base, "data", fail_untyped=False, required=False)
        else:
            parser.add_class_arguments(self._data_base, "data", fail_untyped=False)
        if self.auto_configure_optimizers:
            import torch

            parser.add_subclass_arguments(torch.optim.Optimizer, "optimizer", skip={"params"}, instantiate=False,
                                          required=False, fail_untyped=False)
            parser.add_subclass_arguments(torch.optim.lr_scheduler.LRScheduler, "lr_scheduler",
                                          skip={"optimizer"}, instantiate=False, required=False, fail_untyped=False)
        if subcommand is not None:
            parser.add_argument("--ckpt_path", type=str | None, default=None,
                                help="checkpoint to resume from (fit) or to load (validate/test/predict)")
            if subcommand in ("validate", "test"):
                parser.add_argument("--verbose", type=bool, default=True)
        self.add_arguments_to_parser(parser)

    def add_arguments_to_parser(self, parser: Any) -> None:
        """Override to add arguments or ``parser.link_arguments(...)``."""

    def parse(self, args: Sequence[str] | dict[str, Any] | None) -> Any:
        if isinstance(args, dict):
            return self.parser.parse_object(args)
        return self.parser.parse_args(list(args) if args is not None else None)

    # ------------------------------------------------------------------ objects
    def _section(self) -> Any:
        return self.config[self.subcommand] if self.subcommand is not None else self.config

    def before_instantiate_classes(self) -> None: ...

    def after_instantiate_classes(self) -> None: ...

    def instantiate_classes(self) -> None:
        from phalanx.utils.seed import seed_everything

        section = self._section()
        seed = section.get("seed_everything")
        if seed is True:
            seed = int.from_bytes(os.urandom(4), "little") % (2**31)
            section["seed_everything"] = seed  # the saved config repeats the run exactly
        if seed is not False and seed is not None:
            seed_everything(int(seed), workers=True)
        instantiate = getattr(self.parser, "instantiate", None) or self.parser.instantiate_classes
        self.config_init = instantiate(self.config)
        init = self.config_init[self.subcommand] if self.subcommand is not None else self.config_init
        self.model = init.get("model")
        self.datamodule = init.get("data")
        self._configure_optimizers(section)
        trainer_args = dict(init.get("trainer") or {})
        callbacks = trainer_args.get("callbacks")
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else ([callbacks] if callbacks else [])
        if self.save_config_callback is not None and self.subcommand == "fit":
            callbacks.append(self.save_config_callback(self.parser, self.config, **self.save_config_kwargs))
        trainer_args["callbacks"] = callbacks
        self.trainer = self.instantiate_trainer(**trainer_args)

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        return self.trainer_class(**kwargs)

    def _configure_optimizers(self, section: Any) -> None:
        optimizer, scheduler = section.get("optimizer"), section.get("lr_scheduler")
        if not self.auto_configure_optimizers or optimizer is None or self.model is None:
            if scheduler is not None and optimizer is None:
                raise MisconfigurationError("--lr_scheduler needs --optimizer (the scheduler steps that optimizer).")
            return
        model = self.model

        def configure_optimizers() -> Any:
            opt = instantiate_class(model.parameters(), optimizer)
            if scheduler is None:
                return opt
            return {"optimizer": opt, "lr_scheduler": instantiate_class(opt, scheduler)}

        model.configure_optimizers = configure_optimizers

    # ------------------------------------------------------------------ running
    def _run_subcommand(self, subcommand: str) -> None:
        before: Callable[[], None] | None = getattr(self, f"before_{subcommand}", None)
        if callable(before):
            before()
        section = self.config[subcommand]
        kwargs: dict[str, Any] = {"datamodule": self.datamodule, "ckpt_path": section.get("ckpt_path")}
        if subcommand in ("validate", "test"):
            kwargs["verbose"] = section.get("verbose", True)
        getattr(self.trainer, subcommand)(self.model, **kwargs)
        after: Callable[[], None] | None = getattr(self, f"after_{subcommand}", None)
        if callable(after):
            after()


def instantiate_class(args: Any, init: Any) -> Any:
    """``class_path(args, **init_args)`` from a ``{"class_path": ..., "init_args": {...}}`` config."""
    import importlib

    spec = dict(init) if isinstance(init, dict) else vars(init)
    module_name, _, class_name = str(spec["class_path"]).rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    init_args = spec.get("init_args") or {}
    kwargs = dict(init_args) if isinstance(init_args, dict) else vars(init_args)
    args = args if isinstance(args, tuple) else (args,)
    return cls(*args, **kwargs)


def main(argv: Sequence[str]) -> int:
    """``phalanx fit|validate|test|predict ...``: a LightningCLI over any phalanx Module / DataModule,
    chosen in the config by ``class_path``. The working directory is importable (as for ``python -m``),
    so ``class_path: my_module.MyModel`` finds ``./my_module.py``."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    LightningCLI(args=list(argv))
    return 0
