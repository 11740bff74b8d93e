"""One GPU check (bench/gpu_check.sh runs it; about 4 minutes on one H100): does the accelerator ever wait for
phalanx, and what do phalanx's paths cost next to raw torch and Lightning on a GPT-2-small step?

1. **Synchronizations per step.** torch's sync debug mode counts every host-device synchronization during the
   steady-state steps (15-55) of: a Fabric loop (bf16-mixed, fused AdamW, accumulation with no_backward_sync,
   clip_gradients, save_snapshot "auto", stop_requested), a Trainer fit (self.log with prog_bar on step and
   epoch, a progress bar, a CSV logger every 10 steps, ModelCheckpoint, LearningRateMonitor, clipping,
   accumulation, Snapshot()), and the Fabric loop under strategy="fsdp" and ModelParallelStrategy (1 GPU).
   Expected: 0, except the Trainer's one batched read per logger flush (4 in 40 steps).
2. **GPT-2 small (124 M, tied embedding), 8 x 1024 tokens, bf16, fused AdamW, eager**, ms per step: raw
   PyTorch (autocast), phalanx Fabric, phalanx Trainer, Lightning's Trainer (where it is importable); raw FSDP2 vs
   phalanx "fsdp"; raw TP x FSDP2 vs ModelParallelStrategy (a 1 x 1 mesh on one GPU). Same init and data.
3. **Snapshots of GPT-2 small** (Fabric loop, ``--snapshot-steps`` steps, 300 by default): per variant (none,
   every step, "auto") the mean ms/step over the whole run, its start included, against none; what the cadence
   measured (the stall per snapshot, the copy's time and GB/s, the k it chose) and the copy's path; and the
   limit: the same bytes copied once into a registered ``/dev/shm`` mapping with nothing else running.
4. **The CUDA tests** (``pytest -m gpu`` over the files that hold them).
5. **fp8** (bench/gpu_fp8.py): a 0.9 B Llama-style model, 50 steps of 4 x 2048 tokens: bf16 eager, bf16 +
   torch.compile, fp8 + torch.compile; ms/step, MFU and the loss after 50 steps.

Each part runs in a fresh process (``--part``). Prints one table, then one JSON line with everything. Without a
CUDA device it prints a skip line and exits 0. ``--cpu-smoke``: every part on the CPU with a tiny model (the
script's own check; no numbers worth reading).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "tests" / "support")]
import gpu  # noqa: E402  (bench/gpu.py: the GPT-2 model and the raw contenders)
import gpu_fp8  # noqa: E402  (bench/gpu_fp8.py: the fp8 rows)
from host_reads import DeviceSyncs  # noqa: E402  (what the CUDA tests count with)

FIRST, LAST = 15, 55  # the steady-state steps whose synchronizations are counted
TEST_FILES = ["tests/utils/test_late_reads.py", "tests/checkpoint/test_snapshot_device.py",
              "tests/fabric/test_anomaly.py", "tests/fabric/test_unmanaged_backward.py"]


def _device(args: argparse.Namespace) -> str:
    return "cpu" if args.cpu_smoke else "cuda"


def _small_gpt(args: argparse.Namespace) -> gpu.GPT:
    torch.manual_seed(0)
    if args.cpu_smoke:
        return gpu.GPT(**{k: v for k, v in gpu.SMOKE.items()})
    return gpu.GPT(vocab=8192, d=512, layers=4, heads=8, ctx=256)


def _batches(args: argparse.Namespace, vocab: int, seq: int, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (args.batch, seq + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _sync_counter(args: argparse.Namespace) -> DeviceSyncs:
    """torch's sync debug mode, counted (tests/support/host_reads.py); on the CPU smoke run, one that sees none."""
    if not args.cpu_smoke:
        return DeviceSyncs()

    class Nothing(DeviceSyncs):
        def __enter__(self) -> DeviceSyncs:
            return self

        def tick(self) -> None:
            pass

        def __exit__(self, *exc: Any) -> None:
            pass

    return Nothing()


# ---------------------------------------------------------------------- 1. synchronizations
def syncs_fabric(args: argparse.Namespace, strategy: Any) -> dict[str, Any]:
    import phalanx

    if strategy == "model_parallel":  # bench/gpu.py's TP x FSDP plan (FSDP2's bf16 policy inside) on a 1 x 1 mesh
        from phalanx.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(gpu.parallelize, 1, 1)
        model, precision, vocab = gpu.make_tp_model(smoke=True), "32-true", gpu.SMOKE["vocab"]
    else:
        model, precision = _small_gpt(args), "bf16-mixed"
        vocab = model.wte.num_embeddings
    fabric = phalanx.Fabric(accelerator=_device(args), devices=1, strategy=strategy, precision=precision)
    fabric.launch()
    model = fabric.setup_module(model)
    # fused AdamW where its kernels take the parameters (not DTensors of a tensor-parallel plan)
    kind = {"foreach": True} if precision == "32-true" else {"fused": True}
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-4, **kind))
    seq = 64 if args.cpu_smoke or precision == "32-true" else 256
    batches = [(x.to(fabric.device), y.to(fabric.device)) for x, y in _batches(args, vocab, seq)]
    counter = _sync_counter(args)
    with counter:
        for step in range(1, LAST + 6):
            counter.active = FIRST < step <= LAST
            for micro in range(2):
                x, y = batches[(2 * step + micro) % len(batches)]
                with fabric.no_backward_sync(model, enabled=micro == 0):
                    logits = model(x)
                    fabric.backward(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / 2)
            fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
            optimizer.step()
            optimizer.zero_grad()
            fabric.save_snapshot({"model": model, "optimizer": optimizer, "step": step}, step, "snapshots")
            fabric.stop_requested()
            counter.tick()
    fabric.teardown()
    return {"syncs": sum(counter.syncs.values()), "where": dict(counter.syncs), "steps": LAST - FIRST}


def syncs_trainer(args: argparse.Namespace) -> dict[str, Any]:
    import phalanx
    from phalanx.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, Snapshot
    from phalanx.loggers import CSVLogger

    counter = _sync_counter(args)

    class GPTModule(phalanx.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = _small_gpt(args)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.gpt(x).float().flatten(0, 1), y.flatten())
            self.log("loss", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
            return loss

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.parameters(), lr=3e-4, fused=True)
            return {"optimizer": optimizer, "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.999 ** s), "interval": "step"}}

    class Count(Callback):
        def on_train_batch_end(self, trainer: Any, *rest: Any) -> None:
            counter.tick()
            counter.active = FIRST <= trainer.global_step < LAST

    data = _batches(args, gpu.SMOKE["vocab"] if args.cpu_smoke else 8192, 64 if args.cpu_smoke else 256,
                    n=2 * (LAST + 8))
    loader = torch.utils.data.DataLoader(data, batch_size=None, pin_memory=not args.cpu_smoke)
    trainer = phalanx.Trainer(
        accelerator=_device(args), devices=1, precision="bf16-mixed", max_steps=LAST + 4, log_every_n_steps=10,
        accumulate_grad_batches=2, gradient_clip_val=1.0, num_sanity_val_steps=0, enable_model_summary=False,
        default_root_dir="trainer-run", logger=CSVLogger("trainer-logs"),
        callbacks=[Count(), ModelCheckpoint("trainer-ckpt", monitor="loss"), LearningRateMonitor(), Snapshot()])
    with counter:
        trainer.fit(GPTModule(), loader)
    return {"syncs": sum(counter.syncs.values()), "where": dict(counter.syncs), "steps": LAST - FIRST}


# ---------------------------------------------------------------------- 2. GPT-2 small, ms per step
def _gpt2_batches(args: argparse.Namespace) -> list[Any]:
    device = torch.device(_device(args))
    return [(x.to(device), y.to(device)) for x, y in
            _batches(args, gpu.SMOKE["vocab"] if args.cpu_smoke else 50257, args.seq)]


class Timed:
    """What the Trainer contenders share: GPT-2 small's step (the loss every contender computes), its optimizer,
    the loader over the same batches (pinned, as users load), and a clock read (synchronized) at the end of the
    warm-up and of the timed steps."""

    def __init__(self, args: argparse.Namespace, batches: list[Any]) -> None:
        self.args, self.clock = args, {}  # type: ignore[var-annotated]
        cpu = [(x.cpu(), y.cpu()) for x, y in batches]
        self.steps = args.warmup + args.steps
        self.loader = torch.utils.data.DataLoader([cpu[i % len(cpu)] for i in range(self.steps)], batch_size=None,
                                                  pin_memory=not args.cpu_smoke)

    def model(self) -> gpu.GPT:
        return gpu.make_model() if not self.args.cpu_smoke else gpu.GPT(**gpu.SMOKE)

    @staticmethod
    def loss(gpt: gpu.GPT, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = gpt(x)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))

    @staticmethod
    def optimizer(module: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(module.parameters(), lr=3e-4, fused=True)

    def tick(self, step: int, outputs: Any) -> None:
        if step in (self.args.warmup, self.steps):
            gpu._sync()
            self.clock[step] = time.perf_counter()
            self.clock["loss"] = float(outputs["loss"])

    def result(self) -> tuple[float, float]:
        return (self.clock[self.steps] - self.clock[self.args.warmup]) / self.args.steps, self.clock["loss"]


def speed_trainer(args: argparse.Namespace, batches: list[Any]) -> tuple[float, float]:
    import phalanx
    from phalanx.callbacks import Callback

    timed = Timed(args, batches)

    class Module(phalanx.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = timed.model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return timed.loss(self.gpt, batch)

        def configure_optimizers(self) -> Any:
            return timed.optimizer(self)

    class Clock(Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *rest: Any) -> None:
            timed.tick(trainer.global_step, outputs)

    trainer = phalanx.Trainer(accelerator=_device(args), devices=1, precision="bf16-mixed", max_steps=timed.steps,
                              logger=False, enable_checkpointing=False, enable_progress_bar=False,
                              enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Clock()])
    trainer.fit(Module(), timed.loader)
    return timed.result()


def speed_lightning(args: argparse.Namespace, batches: list[Any]) -> tuple[float, float]:
    import lightning as L

    timed = Timed(args, batches)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = timed.model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return timed.loss(self.gpt, batch)

        def configure_optimizers(self) -> Any:
            return timed.optimizer(self)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            timed.tick(self.trainer.global_step, outputs)

    trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=timed.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), timed.loader)
    return timed.result()


def speed_2d(kind: str, args: argparse.Namespace, batches: list[Any]) -> tuple[float, float]:
    """A TP x FSDP contender of bench/gpu.py on a 1 x 1 mesh, in this process."""
    import socket

    class Queue(list):  # type: ignore[type-arg]
        def put(self, item: Any) -> None:
            self.append(item)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out, environ = Queue(), dict(os.environ)
    try:
        gpu._tp_worker(0, kind, argparse.Namespace(**{**vars(args), "tp": 1, "smoke_cpu": False}), port, out)
    finally:  # its phalanx contender sets the launch variables of a 1-rank job: not for the next contender
        os.environ.clear()
        os.environ.update(environ)
    return float(out[0][0]), float(out[0][1])


#: contender -> (runner, its raw baseline). Run interleaved in one process, as bench/gpu.py does.
SPEED = {
    "raw PyTorch (autocast)": (lambda a, b: gpu.raw_single(a, b), "raw PyTorch (autocast)"),
    "phalanx Fabric": (lambda a, b: gpu.phalanx_run("single", a, b), "raw PyTorch (autocast)"),
    "phalanx Trainer": (speed_trainer, "raw PyTorch (autocast)"),
    "raw FSDP2": (lambda a, b: gpu.raw_fsdp(a, b), "raw FSDP2"),
    "phalanx fsdp": (lambda a, b: gpu.phalanx_run("fsdp", a, b), "raw FSDP2"),
    "raw TP x FSDP2 (1 x 1)": (lambda a, b: speed_2d("raw", a, b), "raw TP x FSDP2 (1 x 1)"),
    "phalanx ModelParallelStrategy (1 x 1)": (lambda a, b: speed_2d("phalanx", a, b), "raw TP x FSDP2 (1 x 1)"),
}
LIGHTNING = "Lightning Trainer"


def speed(args: argparse.Namespace) -> dict[str, Any]:
    batches = _gpt2_batches(args)
    names = [n for n in SPEED if not args.cpu_smoke or n == "phalanx Trainer"]  # gpu.py's runners need CUDA
    ms: dict[str, list[float]] = {n: [] for n in names}
    loss: dict[str, float] = {}
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else reversed(names):
            seconds, loss[name] = SPEED[name][0](args, batches)
            ms[name].append(seconds * 1e3)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return {"ms": ms, "loss": loss}


# ---------------------------------------------------------------------- 3. snapshots
def snapshot_cost(args: argparse.Namespace, every: str) -> dict[str, Any]:
    """GPT-2 small in a Fabric loop for ``--snapshot-steps`` steps, snapshotting every ``every`` steps ("none", an
    int, "auto"): the mean time per step over the whole run, its start included (synchronized before the first
    step and after the last), and what the cadence measured: the stall per snapshot, the copy and its rate, k."""
    import phalanx
    from phalanx.checkpoint.snapshot import Cadence

    fabric = phalanx.Fabric(accelerator=_device(args), devices=1, precision="bf16-mixed")
    fabric.launch()
    model = fabric.setup_module(gpu.make_model() if not args.cpu_smoke else gpu.GPT(**gpu.SMOKE))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True))
    batches = _gpt2_batches(args)
    cadence = None if every == "none" else Cadence("auto" if every == "auto" else int(every))
    steps, half, taken = args.snapshot_steps, args.snapshot_steps // 2, 0
    clock: dict[int, float] = {}
    gpu._sync()
    clock[0] = time.perf_counter()
    for step in range(1, steps + 1):
        x, y = batches[step % len(batches)]
        logits = model(x)
        fabric.backward(F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cadence is not None:
            taken += fabric.save_snapshot({"model": model, "optimizer": optimizer, "step": step}, step,
                                          "gpt2-snapshots", every_n_steps=cadence) is not None
        if step == half:  # once, for the steady half's own mean
            gpu._sync()
            clock[half] = time.perf_counter()
    gpu._sync()
    clock[steps] = time.perf_counter()
    out: dict[str, Any] = {"ms_per_step": (clock[steps] - clock[0]) / steps * 1e3,
                           "steady_ms_per_step": (clock[steps] - clock[half]) / (steps - half) * 1e3}
    if cadence is not None:
        writer = fabric._snapshots._folders[fabric._snapshots.folder("gpt2-snapshots")].writer
        assert writer is not None
        writer.wait()
        cadence.due(steps + 1)  # collects the last measurements (it snapshots nothing more)
        stall, copy = cadence.stall_seconds or 0.0, cadence.copy_seconds or 0.0
        out.update(bytes=cadence.snapshot_bytes, cadence=cadence.every_n_steps, snapshots=taken, path=writer.path,
                   setup_s=writer.setup_seconds, stall_ms=stall * 1e3, copy_ms=copy * 1e3,
                   copy_gbps=cadence.snapshot_bytes / copy / 1e9 if copy else 0.0)
    fabric.teardown()
    return out


def snapshot_limit(args: argparse.Namespace) -> dict[str, Any]:
    """The limit: the same tensors (GPT-2 small's weights and AdamW moments) copied once, on a side stream, into a
    ``/dev/shm`` mapping registered with ``cudaHostRegister``, with nothing else running (torch alone)."""
    import mmap
    import tempfile

    model = gpu.make_model().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    model(torch.zeros(1, 8, dtype=torch.long, device="cuda")).float().sum().backward()
    optimizer.step()  # the moments exist
    tensors = [p.detach() for p in model.parameters()] + [t for s in optimizer.state.values() for t in s.values()
                                                          if t.is_cuda and t.dim() > 0]
    sizes = [-(-t.nbytes // 64) * 64 for t in tensors]
    total = sum(sizes)
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as fh:
        os.posix_fallocate(fh.fileno(), 0, total)
        mapped = mmap.mmap(fh.fileno(), total)
        buffer = torch.frombuffer(mapped, dtype=torch.uint8)
        began = time.perf_counter()
        result = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), total, 1))
        register_s = time.perf_counter() - began
        if result != 0:
            return {"error": f"cudaHostRegister refused: error {result}"}
        views, at = [], 0
        for t, size in zip(tensors, sizes):
            views.append(buffer[at:at + t.nbytes].view(t.dtype).view(t.shape))
            at += size
        side, times = torch.cuda.Stream(), []
        for _ in range(6):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            begin.record(side)
            with torch.cuda.stream(side):
                torch._foreach_copy_(views, tensors, non_blocking=True)
            end.record(side)
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
        del views, buffer
        mapped.close()
    copy = statistics.median(times[1:])
    return {"bytes": total, "copy_ms": copy * 1e3, "copy_gbps": total / copy / 1e9, "register_s": register_s}


# ---------------------------------------------------------------------- running the parts
def run_part(args: argparse.Namespace) -> dict[str, Any]:
    kind, _, name = args.part.partition(":")
    if kind == "syncs":
        return syncs_trainer(args) if name == "trainer" else syncs_fabric(args, "auto" if name == "fabric" else name)
    if kind == "speed":
        if name == LIGHTNING:
            runs = [speed_lightning(args, _gpt2_batches(args)) for _ in range(args.reps)]
            return {"ms": {name: [r[0] * 1e3 for r in runs]}, "loss": {name: runs[-1][1]}}
        return speed(args)
    if kind == "snapshot":
        return snapshot_limit(args) if name == "limit" else snapshot_cost(args, name)
    if kind == "fp8":
        return gpu_fp8.run_variant(name, args.cpu_smoke)
    raise SystemExit(f"unknown part {args.part!r}")


def spawn(args: argparse.Namespace, part: str, timeout: float = 240) -> dict[str, Any]:
    forward = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("reps", "steps", "warmup", "batch", "seq",
                                                                       "snapshot_steps")]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--part", part, *forward,
           *(["--cpu-smoke"] if args.cpu_smoke else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=args.workdir)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    out: dict[str, Any] = json.loads(lines[-1])
    out["seconds"] = round(time.monotonic() - start, 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed GPT-2 steps per repetition")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--snapshot-steps", type=int, default=300, help="steps of each snapshot variant's run")
    p.add_argument("--no-tests", action="store_true")
    p.add_argument("--parts", default="syncs,speed,snapshots,tests,fp8", help="which parts, comma-separated")
    p.add_argument("--snapshot-variants", default="none,1,auto,limit",
                   help="snapshot cadences to time (none, an int, auto), and limit: the registered copy alone")
    p.add_argument("--cpu-smoke", action="store_true")
    args = p.parse_args()
    if args.cpu_smoke and not args.part:
        args.seq, args.batch, args.steps, args.reps, args.snapshot_steps = 64, 2, 3, 1, 30
    if args.part:
        print(json.dumps(run_part(args)))
        return
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu_check: skipped (no CUDA device here; on a machine with one, run bench/gpu_check.sh as it is)")
        return
    import tempfile

    with tempfile.TemporaryDirectory() as workdir:
        args.workdir = workdir
        report(args)


def snapshot_rows(snaps: dict[str, dict[str, Any]]) -> list[tuple[str, str, str]]:
    """Per variant: the mean ms/step over the whole run (start included) and against none, the stall per
    snapshot, k, the copy's time and rate, the path; the limit: the registered copy alone."""
    rows = []
    none = snaps.get("none", {}).get("ms_per_step")
    for every, r in snaps.items():
        name = f"GPT-2 small, snapshot {'the limit (registered copy alone)' if every == 'limit' else every}"
        if "error" in r:
            rows.append((name, r["error"], ""))
        elif every == "limit":
            rows.append((name, f"{r['bytes'] / 2**30:.2f} GiB in {r['copy_ms']:.1f} ms ({r['copy_gbps']:.1f} GB/s); "
                               f"registering it {r['register_s']:.2f} s once", ">= 40 GB/s"))
        elif every == "none":
            steady = r["steady_ms_per_step"]
            rows.append((name, f"{r['ms_per_step']:.2f} ms/step over the run (steady half {steady:.2f})", ""))
        else:
            ratio = f"{r['ms_per_step'] / none:.3f}x none" if none else ""
            rows.append((name, f"{r['ms_per_step']:.2f} ms/step over the run, start included (steady half "
                               f"{r['steady_ms_per_step']:.2f}); every {r['cadence']} steps ({r['snapshots']} "
                               f"snapshots); stall {r['stall_ms']:.2f} ms per snapshot; {r['bytes'] / 2**30:.2f} GiB "
                               f"copied in {r['copy_ms']:.1f} ms ({r['copy_gbps']:.1f} GB/s); {r['path']}; slots set "
                               f"up in {r['setup_s']:.2f} s", ratio + (" (<= 1.05x, every <= 4)" if every == "auto"
                                                                      else " (<= 1.35x)" if every == "1" else "")))
    return rows


def report(args: argparse.Namespace) -> None:
    started = time.monotonic()
    device = "CPU (smoke)" if args.cpu_smoke else torch.cuda.get_device_name()
    print(f"gpu_check: {device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}", flush=True)
    results: dict[str, Any] = {"device": device, "torch": torch.__version__}
    rows: list[tuple[str, str, str]] = []
    parts = set(args.parts.split(","))
    for name in ("fabric", "trainer", "fsdp", "model_parallel") if "syncs" in parts else ():
        r = results[f"syncs:{name}"] = spawn(args, f"syncs:{name}")
        expected = "<= 4 (one per logger flush)" if name == "trainer" else "0"
        value = r.get("error") or f"{r['syncs']} in {r['steps']} steps {r['where'] or ''}"
        rows.append((f"syncs: {name}", value, expected))
    fast = spawn(args, "speed:all", timeout=420) if "speed" in parts else {"error": "not asked for"}
    slow = spawn(args, f"speed:{LIGHTNING}", timeout=240) if not args.cpu_smoke and "speed" in parts else \
        {"error": "not on the CPU" if args.cpu_smoke else "not asked for"}
    results["speed"] = {"phalanx and raw": fast, LIGHTNING: slow}
    ms = {**fast.get("ms", {}), **slow.get("ms", {})}
    losses = {**fast.get("loss", {}), **slow.get("loss", {})}
    for name in [*SPEED, LIGHTNING]:
        if name not in ms:
            rows.append((f"GPT-2 small: {name}", (slow if name == LIGHTNING else fast).get("error", "not run"), ""))
            continue
        median = statistics.median(ms[name])
        base = SPEED[name][1] if name in SPEED else "raw PyTorch (autocast)"
        ratio = f"{statistics.median(ms[base]) / median:.3f}x raw throughput" if base in ms else ""
        rows.append((f"GPT-2 small: {name}", f"{median:.2f} ms/step (runs {', '.join(f'{m:.2f}' for m in ms[name])}; "
                     f"loss {losses[name]:.4f})", ratio))
    variants = args.snapshot_variants.split(",") if "snapshots" in parts else []
    if args.cpu_smoke and "limit" in variants:
        variants.remove("limit")  # a CUDA copy
    snaps = {every: spawn(args, f"snapshot:{every}", timeout=300) for every in variants}
    results["snapshots"] = snaps
    rows += snapshot_rows(snaps)
    if "fp8" in parts:
        results["fp8"], fp8_rows = gpu_fp8.rows(args, spawn)
        rows.extend(fp8_rows)
    if not args.no_tests and "tests" in parts:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests" / "support"),
                                                            str(REPO)])}
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                               *TEST_FILES], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
        summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
        results["tests"] = {"returncode": done.returncode, "summary": summary, "tail": done.stdout[-3000:]}
        rows.append(("CUDA tests", summary, "passed" if done.returncode == 0 else "FAILED"))
    width = max(len(r[0]) for r in rows)
    print(f"\n| {'check'.ljust(width)} | result | against |")
    print(f"| {'-' * width} | --- | --- |")
    for check, value, against in rows:
        print(f"| {check.ljust(width)} | {value} | {against} |")
    results["seconds"] = round(time.monotonic() - started, 1)
    print(f"\ngpu_check took {results['seconds']} s")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
