"""No part of phalanx reaches into another's private names: neither another module's (``from phalanx.x import
_name``, ``module._name``) nor another object's (``obj._name`` where ``obj`` is not ``self`` or ``cls``).

A private name is its owner's to change; code elsewhere that reads or writes it breaks when the owner changes
it, and the owner cannot see that from its own file. Where one part needs another's state, the owner gives it a
public method or attribute with a docstring (a door). Ruff's PLC2701 checks imports only, and lets every module
of the same top-level package through, so this test does both for phalanx's own code.

The libraries phalanx drives (torch, DeepSpeed, torchmetrics, the standard library) have privates with no
public equivalent that phalanx must use; each such name is listed in :data:`THIRD_PARTY`, with why. A name
that phalanx itself defines as private can never be listed: the check for those has no allowlist.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Private names of other libraries that phalanx reads or writes, and why there is no public way.
THIRD_PARTY: dict[str, str] = {
    # torch.nn.Module's registries: a restore point swaps them wholesale to put a module back exactly
    # (core/module_state.py), which load_state_dict cannot do for non-persistent buffers and submodules.
    "_parameters": "torch.nn.Module", "_buffers": "torch.nn.Module", "_modules": "torch.nn.Module",
    "_non_persistent_buffers_set": "torch.nn.Module",
    # A module's hook dicts: whether a forward may bypass the wrapper (fabric/wrappers.py); no public query.
    "_forward_hooks": "torch.nn.Module", "_forward_pre_hooks": "torch.nn.Module",
    "_backward_hooks": "torch.nn.Module", "_backward_pre_hooks": "torch.nn.Module",
    # Recompiling a module after wrapping (fabric/compiled.py): torch.compile's bound call.
    "_call_impl": "torch.nn.Module", "_compiled_call_impl": "torch.nn.Module",
    # A tensor's version counter: whether a snapshot's source changed while it was being copied.
    "_version": "torch.Tensor",
    # torch.compile's OptimizedModule holds the module it compiled there (fabric/compiled.py).
    "_orig_mod": "torch._dynamo.OptimizedModule",
    # torch's skip-on-device protocol: whether an optimizer's step skips itself where found_inf is set.
    "_step_supports_amp_scaling": "torch.optim.Optimizer",
    "_foreach_copy_": "torch (the fused copy of a tensor list)",
    # torch.serialization internals for writing a checkpoint file tensor by tensor (offline/convert.py)
    # and reading a DCP layout (checkpoint/dcp.py).
    "_utils": "torch", "_rebuild_tensor_v2": "torch._utils", "_dtype_to_storage_type_map": "torch.storage",
    "_open_zipfile_writer": "torch.serialization", "_get_storage_alignment": "torch.serialization",
    "_get_layout": "torch.serialization",
    # FSDP2's state: materialising lazily-initialised state before a collective the guard checks.
    "_get_fsdp_state": "torch FSDP2", "_lazy_init": "torch FSDP2",
    "_C": "torch", "_current_graph_task_id": "torch._C (whether a backward is running)",
    # A sampler built with num_samples= draws a different number of indices than the dataset holds.
    "_num_samples": "torch.utils.data.RandomSampler (no public attribute before torch 2.6)",
    # torchmetrics.Metric's accumulation state, which Metric.state_dict leaves out (core/module_state.py,
    # trainer/results.py): restoring a metric exactly after a tuning phase needs it.
    "_update_count": "torchmetrics.Metric", "_forward_cache": "torchmetrics.Metric",
    "_computed": "torchmetrics.Metric", "_defaults": "torchmetrics.Metric",
    # DeepSpeed: merging ZeRO partitions without an engine, and materialising the optimizer state of its
    # fp32 partitions before a snapshot (checkpoint/deepspeed_shards.py, strategies/deepspeed/checkpoint.py).
    "_get_fp32_state_dict_from_zero2_checkpoint": "deepspeed.utils.zero_to_fp32",
    "_zero2_merge_trainable_params": "deepspeed.utils.zero_to_fp32",
    "_get_fp32_state_dict_from_zero3_checkpoint": "deepspeed.utils.zero_to_fp32",
    "_zero3_merge_trainable_params": "deepspeed.utils.zero_to_fp32",
    "_hp_optimizer_states_linked": "deepspeed ZeRO optimizer", "_lazy_init_hp_params_optimizer_state": "deepspeed",
    # The standard library: call sites for error messages, every thread's stack for the watchdog, an exit
    # that skips interpreter teardown when a peer is gone, argparse's subparser type and its option list.
    "_getframe": "sys", "_current_frames": "sys", "_exit": "os",
    "_SubParsersAction": "argparse", "_actions": "argparse.ArgumentParser",
    "_fields": "collections.namedtuple (public API, underscored so as not to clash with field names)",
    # NumPy's global generator: capturing its state without drawing from it (utils/seed.py).
    "_rand": "numpy.random.mtrand", "_bit_generator": "numpy.random.RandomState",
}


def _is_module(name: str) -> bool:
    path = SRC.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _trees(root: Path) -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for path in sorted(root.rglob("*.py"))]


def private_imports(path: Path, tree: ast.Module | None = None) -> list[str]:
    """Every import of another phalanx module's private name in the file at ``path``, as ``line: what``."""
    tree = tree or ast.parse(path.read_text(), str(path))
    modules: dict[str, str] = {}  # local name -> the phalanx module it is bound to
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "phalanx":
                    modules[alias.asname or "phalanx"] = alias.name if alias.asname else "phalanx"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "phalanx":
            for alias in node.names:
                if _is_module(f"{node.module}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif _private(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and _private(node.attr)):
            found.append(f"{node.lineno}: {modules[node.value.id]}.{node.attr}")
    return found


def own_private_members(trees: list[tuple[Path, ast.Module]]) -> set[str]:
    """The private member names phalanx defines: methods and class attributes of its classes, and attributes
    assigned through ``self``."""
    names: set[str] = set()
    for _, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        names.update(t.id for t in item.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return {name for name in names if _private(name)}


def _is_own_object(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: an object reaching its own members."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def private_member_access(path: Path, tree: ast.Module, own: set[str]) -> list[str]:
    """Every ``obj._name`` in the file at ``path`` where ``obj`` is not the object itself: a private of phalanx's
    own (always refused), or of a library and not listed in :data:`THIRD_PARTY`; as ``line: obj._name``.
    Module attributes (``module._name``) are :func:`private_imports`' business; ``getattr``/``setattr`` with a
    private name in a string count too."""
    modules = {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
               if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    found: list[str] = []
    for node in ast.walk(tree):
        name, owner = None, None
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _is_own_object(node.value):
            name, owner = node.attr, node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) and \
                _private(node.args[1].value) and not _is_own_object(node.args[0]):
            name, owner = node.args[1].value, node.args[0]
        if name is None or owner is None:
            continue
        is_module = isinstance(owner, ast.Name) and owner.id in modules and name not in own
        if name in own or not (is_module or name in THIRD_PARTY):
            found.append(f"{node.lineno}: {ast.unparse(owner)}.{name}")
    return found


def test_no_module_imports_another_modules_private_names() -> None:
    found = [f"{path.relative_to(SRC)}:{hit}" for path, tree in _trees(SRC) for hit in private_imports(path, tree)]
    assert not found, (
        "These modules import private names of other modules. Make the name public (drop the underscore, give it "
        "a docstring) or move the code that needs it next to it:\n" + "\n".join(found)
    )


def test_no_object_reaches_another_objects_private_members() -> None:
    trees = _trees(SRC)
    own = own_private_members(trees)
    found = [f"{path.relative_to(SRC)}:{hit}" for path, tree in trees for hit in private_member_access(path, tree, own)]
    assert not found, (
        "These places reach private members of other objects. For phalanx's own classes, give the owner a public "
        "method or attribute (a door) and use it; for a library's private with no public equivalent, add it to "
        "THIRD_PARTY with the reason:\n" + "\n".join(found)
    )


def test_the_allowlist_holds_no_name_of_phalanx() -> None:
    clashes = own_private_members(_trees(SRC)) & set(THIRD_PARTY)
    assert not clashes, f"phalanx defines these private names itself, so they cannot be allowed: {sorted(clashes)}"


def test_the_checks_see_every_form(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import phalanx.checkpoint.format as fmt\nfrom phalanx.trainer.loaders import _hidden\n"
                     "from phalanx.checkpoint import format\n\nfmt._refused_global\nformat._x\nfmt.read_file\n")
    assert private_imports(probe) == ["2: from phalanx.trainer.loaders import _hidden",
                                      "5: phalanx.checkpoint.format._refused_global",
                                      "6: phalanx.checkpoint.format._x"]
    probe.write_text("import sys\nclass A:\n    def __init__(self):\n        self._mine = 1\n"
                     "    def f(self, other, module):\n        other._mine\n        self._mine\n        super()._mine\n"
                     "        module._parameters\n        other._unknown\n        setattr(other, '_mine', 2)\n"
                     "        sys._getframe\n        sys._mine\n")
    tree = ast.parse(probe.read_text())
    own = own_private_members([(probe, tree)])
    assert own == {"_mine"}
    assert private_member_access(probe, tree, own) == [
        "6: other._mine", "10: other._unknown", "11: other._mine", "13: sys._mine"]
