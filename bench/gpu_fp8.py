"""The fp8 rows of bench/gpu_check.sh: does ``precision="fp8-mixed"`` pay on a model large enough for float8 matmuls
to matter?

A Llama-style decoder (tests/support/llama_models.py ``BENCH``: width 2048, 16 layers, 16 heads, SwiGLU 5632, vocab
32000, about 0.9 B parameters), 4 sequences of 2048 tokens per step, fused AdamW at 3e-4, on a learnable token chain,
trained 50 steps through a phalanx Fabric on one GPU, three ways, each in a fresh process (gpu_check's ``--part
fp8:<variant>``):

* ``bf16 eager``: ``precision="bf16-mixed"``;
* ``bf16 + compile``: the same, ``torch.compile(model)`` before ``fabric.setup``;
* ``fp8 + compile``: ``precision="fp8-mixed"`` (torchao float8, every block projection; the output head stays bf16),
  compiled the same way.

Per variant: ms per step over steps 11-50 (the first 10 include compilation), MFU (the FLOPs of one step, counted
once on the meta device by torch's FlopCounterMode, over the peak FLOP/s of the precision's ``compute_dtype``: bf16's
for bf16, float8's, twice as high on Hopper, for fp8) and the training loss at step 50. The rows compare fp8 +
compile with bf16 + compile: the goal is at least 1.2x the throughput with the loss within 2 %.

``--cpu-smoke`` runs the same code on the CPU with the tiny test model, fp8 emulated (the script's own check).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

STEPS, TIMED_FROM, BATCH = 50, 10, 4
#: variant -> (precision name, compiled)
VARIANTS = {"bf16 eager": ("bf16-mixed", False), "bf16 + compile": ("bf16-mixed", True),
            "fp8 + compile": ("fp8-mixed", True)}
BASELINE, CANDIDATE = "bf16 + compile", "fp8 + compile"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_flops(cfg: Any, batch: int) -> int:
    """FLOPs of one training step (forward and backward) of the model, counted on the meta device."""
    from llama_models import Llama, lm_loss

    from phalanx.utilities.throughput import measure_flops

    with torch.device("meta"):
        model = Llama(cfg)
        tokens = torch.zeros(batch, cfg.seq + 1, dtype=torch.long)
    x, y = tokens[:, :-1], tokens[:, 1:]
    return measure_flops(model, lambda: model(x), lambda logits: lm_loss(logits, y))


def run_variant(name: str, cpu_smoke: bool) -> dict[str, Any]:
    """Train one variant STEPS steps; its ms/step, MFU and last loss."""
    from llama_models import BENCH, LlamaConfig, lm_loss, make_llama, markov_tokens, split

    import phalanx
    from phalanx.fabric.throughput import peak_flops
    from phalanx.precision import Float8Precision

    cfg = LlamaConfig() if cpu_smoke else BENCH
    precision_name, compiled = VARIANTS[name]
    precision: Any = precision_name
    if precision_name == "fp8-mixed" and cpu_smoke:
        precision = Float8Precision(emulate=True)
    fabric = phalanx.Fabric(accelerator="cpu" if cpu_smoke else "cuda", devices=1, precision=precision)
    fabric.launch()
    model: Any = make_llama(cfg)
    if compiled:
        model = torch.compile(model)  # fabric.setup converts (fp8) the plain module, then compiles it in place
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-4, fused=not cpu_smoke))
    batches = [split(b.to(fabric.device)) for b in markov_tokens(cfg, STEPS, BATCH)]
    losses = []
    start = 0.0
    for step in range(STEPS):
        if step == TIMED_FROM:
            _sync(fabric.device)
            start = time.perf_counter()
        x, y = batches[step]
        loss = lm_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())  # read once, at the end: no host read in the timed steps
    _sync(fabric.device)
    seconds = (time.perf_counter() - start) / (STEPS - TIMED_FROM)
    flops = step_flops(cfg, BATCH)
    peak = peak_flops(fabric)
    return {"ms_per_step": seconds * 1e3, "mfu": flops / seconds / peak if peak else None, "loss": losses[-1].item(),
            "first_loss": losses[0].item(), "tflops_per_step": flops / 1e12, "peak_tflops": (peak or 0) / 1e12,
            "float8_layers": len(getattr(fabric.strategy.precision, "converted", [])),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if not cpu_smoke else None}


def rows(args: argparse.Namespace, spawn: Callable[..., dict[str, Any]]) -> tuple[dict[str, Any], list[tuple[str, str,
                                                                                                            str]]]:
    """Run every variant (gpu_check's ``spawn``) and make its table rows: ``(check, result, against)``."""
    results = {name: spawn(args, f"fp8:{name}", timeout=600) for name in VARIANTS}
    out: list[tuple[str, str, str]] = []
    base = results[BASELINE]
    for name, r in results.items():
        label = f"Llama 0.9B fp8: {name}"
        if "error" in r:
            out.append((label, r["error"], ""))
            continue
        mfu = f"MFU {r['mfu'] * 100:.1f} % of {r['peak_tflops']:.0f} TFLOP/s" if r["mfu"] else "MFU n/a"
        value = (f"{r['ms_per_step']:.1f} ms/step, {mfu}, loss {r['first_loss']:.3f} -> {r['loss']:.4f} after "
                 f"{STEPS} steps ({r['float8_layers']} float8 layers)")
        against = ""
        if name == CANDIDATE and "error" not in base:
            speedup = base["ms_per_step"] / r["ms_per_step"]
            gap = abs(r["loss"] - base["loss"]) / base["loss"]
            verdict = "meets" if speedup >= 1.2 and gap <= 0.02 else "MISSES"
            against = (f"{speedup:.2f}x {BASELINE} throughput, loss {gap * 100:.2f} % apart ({verdict} the goal: "
                       ">= 1.2x, <= 2 %)")
        out.append((label, value, against))
    return results, out
