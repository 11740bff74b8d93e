"""``ModelSummary`` / ``RichModelSummary``: the layer table printed when fit starts.

A table of the module's layers (to ``max_depth``) with their type, parameter count and mode, plus
input/output sizes when the module sets ``example_input_array``; then trainable, frozen and total
parameter counts and the size of the parameters in MB. Rendered with ``rich`` when it is installed,
as plain text otherwise; written on global rank 0 only (the ``phalanx`` logger, stderr by default).
Counting parameters of a sharded module counts this rank's shard: the summary is taken before the
strategy shards it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from phalanx.callbacks.base import Callback
from phalanx.utils import diagnostics
from phalanx.utils.errors import MisconfigurationError


@dataclass
class Summary:
    """The numbers behind the table (``summarize(module)``)."""

    layer_names: list[str] = field(default_factory=list)
    layer_types: list[str] = field(default_factory=list)
    param_nums: list[int] = field(default_factory=list)
    training_modes: list[bool] = field(default_factory=list)
    in_sizes: list[Any] = field(default_factory=list)
    out_sizes: list[Any] = field(default_factory=list)
    total_parameters: int = 0
    trainable_parameters: int = 0
    model_size: float = 0.0  # MB of parameters

    @property
    def non_trainable_parameters(self) -> int:
        return self.total_parameters - self.trainable_parameters

    def rows(self) -> tuple[list[str], list[list[str]]]:
        header = ["", "Name", "Type", "Params", "Mode"]
        with_sizes = any(s is not None for s in self.in_sizes)
        if with_sizes:
            header += ["In sizes", "Out sizes"]
        rows = []
        for i, name in enumerate(self.layer_names):
            row = [str(i), name, self.layer_types[i], _human(self.param_nums[i]),
                   "train" if self.training_modes[i] else "eval"]
            if with_sizes:
                row += [_size(self.in_sizes[i]), _size(self.out_sizes[i])]
            rows.append(row)
        return header, rows

    def totals(self) -> list[tuple[str, str]]:
        return [(_human(self.trainable_parameters), "Trainable params"),
                (_human(self.non_trainable_parameters), "Non-trainable params"),
                (_human(self.total_parameters), "Total params"),
                (f"{self.model_size:,.3f}", "Total estimated model params size (MB)")]

    def __str__(self) -> str:
        header, rows = self.rows()
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [" | ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip()]
        lines.append("-" * len(lines[0]))
        lines += [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.append("-" * len(lines[0]))
        lines += [f"{value:<10} {label}" for value, label in self.totals()]
        return "\n".join(lines)

    def render_rich(self) -> str:
        import io

        from rich.console import Console
        from rich.table import Table

        header, rows = self.rows()
        table = Table(header_style="bold")
        for name in header:
            table.add_column(name, justify="right" if name in ("", "Params") else "left")
        for row in rows:
            table.add_row(*row)
        out = io.StringIO()
        console = Console(file=out, width=max(100, sum(len(h) for h in header) + 20), force_terminal=False)
        console.print(table)
        for value, label in self.totals():
            console.print(f"{value:<10} {label}")
        return out.getvalue().rstrip()


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return str(n)


def _size(value: Any) -> str:
    return "?" if value is None else str(value)


def _shapes(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return list(obj.shape)
    if isinstance(obj, (list, tuple)):
        return [_shapes(o) for o in obj]
    return None


def summarize(module: nn.Module, max_depth: int = 1) -> Summary:
    """Layers of ``module`` down to ``max_depth`` (-1: all; 0: totals only)."""
    if max_depth < -1:
        raise MisconfigurationError(f"max_depth must be >= -1, got {max_depth}.")
    params = list(module.parameters())
    out = Summary(
        total_parameters=sum(p.numel() for p in params),
        trainable_parameters=sum(p.numel() for p in params if p.requires_grad),
        model_size=sum(p.numel() * p.element_size() for p in params) / 1e6,
    )
    layers = [(name, m) for name, m in module.named_modules() if name and
              (max_depth == -1 or name.count(".") < max_depth)]
    sizes: dict[str, tuple[Any, Any]] = {}
    example = getattr(module, "example_input_array", None)
    def recorder(name: str) -> Any:
        def hook(_module: nn.Module, inputs: Any, output: Any) -> None:
            sizes.setdefault(name, (_shapes(inputs[0] if len(inputs) == 1 else inputs), _shapes(output)))
        return hook

    if example is not None and layers:
        handles = [m.register_forward_hook(recorder(name)) for name, m in layers]
        was_training = module.training
        try:
            module.eval()
            with torch.no_grad():
                if isinstance(example, (list, tuple)):
                    module(*example)
                elif isinstance(example, dict):
                    module(**example)
                else:
                    module(example)
        finally:
            module.train(was_training)
            for h in handles:
                h.remove()
    for name, m in layers:
        out.layer_names.append(name)
        out.layer_types.append(type(m).__name__)
        out.param_nums.append(sum(p.numel() for p in m.parameters()))
        out.training_modes.append(m.training)
        in_size, out_size = sizes.get(name, (None, None))
        out.in_sizes.append(in_size)
        out.out_sizes.append(out_size)
    return out


class ModelSummary(Callback):
    """Print the module's summary table at the start of fit (global rank 0), once per run: a restarted attempt
    does not print it again.

    Args:
        max_depth: how deep into submodules the table goes (-1: all, 0: totals only).
    """

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        if summarize_kwargs:
            raise MisconfigurationError(f"ModelSummary got unknown arguments {sorted(summarize_kwargs)}.")
        self.max_depth = max_depth

    def render(self, summary: Summary) -> str:
        if importlib.util.find_spec("rich") is not None:
            return summary.render_rich()
        return str(summary)

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        if not trainer.is_global_zero:
            return
        summary = summarize(module, self.max_depth)
        diagnostics.once_per_run(f"Model summary:\n{self.render(summary)}", rank=trainer.global_rank)


class RichModelSummary(ModelSummary):
    """ModelSummary rendered with ``rich`` (which must be installed)."""

    def render(self, summary: Summary) -> str:
        if importlib.util.find_spec("rich") is None:
            raise MisconfigurationError("RichModelSummary needs rich: pip install rich (or use ModelSummary).")
        return summary.render_rich()
