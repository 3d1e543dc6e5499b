"""One rank of the NVMe offload benchmark (run by ``nvme_offload_bench.py``; not for direct use).

Invoked as ``python nvme_offload_worker.py '<json spec>'`` with the launcher variables in the
environment; writes this rank's numbers as JSON to ``spec["out"]``. The same file runs under the
project venv (shardwise) and under ``.venv-ds`` (DeepSpeed, ``DS_ACCELERATOR=cpu``): it imports only
the standard library at module level and loads the GPT from ``src/shardwise/testing/models.py`` by
its file path, so DeepSpeed's venv never imports shardwise.

What it measures on this rank:

* per phase (``model``: construction (under ``zero.Init``); ``initialize``; ``build``: the
  larger of the two; ``forward``, ``backward`` and
  ``optimizer`` (``engine.step()``) over all steps; ``steps``: the largest of those three) the
  peak ``RssAnon`` and ``VmRSS`` seen by a 50 ms sampler thread reading ``/proc/self/status``;
* ``VmHWM`` (the kernel's peak resident set) after the build and at the end;
* per step: wall time, loss, and the deltas of ``/proc/self/io`` (``read_bytes``/``write_bytes``:
  bytes the process made the block layer fetch or caused to be written back; ``rchar``/``wchar``:
  bytes through read/write system calls, page-cache hits included) and of the swap disk's
  ``/sys/dev/block/M:m/stat`` (the whole machine's reads and writes on that device);
* the bytes the swap files take on disk after the steps.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import threading
import time
import traceback
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench_models import load_models  # this script's directory is on sys.path

_SAMPLE_S = 0.05
_IO_KEYS = ("read_bytes", "write_bytes", "rchar", "wchar")


def _status_kib(keys: tuple[str, ...]) -> dict[str, int]:
    """Values (KiB) of ``keys`` in ``/proc/self/status``."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in keys:
                out[name] = int(rest.split()[0])
    return out


def proc_io() -> dict[str, int]:
    """This process's ``/proc/self/io`` counters (all its threads)."""
    out: dict[str, int] = {}
    with open("/proc/self/io") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in _IO_KEYS:
                out[name] = int(value)
    return out


def device_io(stat_path: str | None) -> dict[str, int]:
    """Bytes the block device has read and written (``/sys/dev/block/M:m/stat``, 512-byte sectors):
    the whole machine's I/O to the swap files' disk, page-cache write-back included."""
    if stat_path is None:
        return {"dev_read": 0, "dev_write": 0}
    with open(stat_path) as f:
        fields = f.read().split()
    return {"dev_read": int(fields[2]) * 512, "dev_write": int(fields[6]) * 512}


def bytes_on_disk(directory: str) -> int:
    """Bytes allocated to the files under ``directory`` (sparse files count what is written)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total


class RssSampler:
    """Peak ``RssAnon``/``VmRSS`` per phase, sampled every 50 ms on a daemon thread."""

    def __init__(self) -> None:
        self.phase = "model"
        self.peaks: dict[str, dict[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> None:
        """Take one sample now (also called at phase ends, so short phases are seen)."""
        now = _status_kib(("RssAnon", "VmRSS"))
        peak = self.peaks.setdefault(self.phase, {"RssAnon": 0, "VmRSS": 0})
        for key, kib in now.items():
            peak[key] = max(peak[key], kib * 1024)

    def _run(self) -> None:
        while not self._stop.wait(_SAMPLE_S):
            self.sample()

    def enter(self, phase: str) -> None:
        """Close the current phase and start ``phase``."""
        self.sample()
        self.phase = phase
        self.sample()

    def stop(self) -> None:
        """Stop sampling."""
        self.sample()
        self._stop.set()
        self._thread.join()


def _framework(name: str) -> Any:
    """The library (``shardwise`` or ``deepspeed``), process group up (gloo)."""
    if name == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        return deepspeed
    import shardwise

    shardwise.init_distributed(dist_backend="gloo")
    return shardwise


@contextlib.contextmanager
def tinygpt_init_in_constructors(models: types.ModuleType, n_layer: int) -> Iterator[None]:
    """TinyGPT's initialisation done inside each layer's own constructor, where the parameters are real.

    ``TinyGPT.__init__`` initialises with ``self.apply(self._init)`` after its children are attached.
    Under ``zero.Init`` those parameters are already placeholders: DeepSpeed wraps ``Module.apply``
    to gather them, shardwise documents that such code must run under ``GatheredParameters``, else
    the layers keep torch's default init (N(0, 1) embeddings: a loss near 100); and gathering
    every module again after the build brings the whole model into memory. Here, while the model
    is constructed, ``nn.Linear``/``nn.Embedding.reset_parameters`` draw TinyGPT's values (N(0,
    0.02), zero biases; the attention and MLP output projections, the 2nd and 4th linear layer of
    each block, N(0, 0.02 / sqrt(2 n_layer))) and ``TinyGPT._init`` does nothing, so both frameworks
    draw the same values in the same order from the same seed, one layer in memory at a time.
    """
    import torch
    from torch import nn

    counter = itertools.count()
    scaled = 0.02 / (2 * n_layer) ** 0.5
    saved = (nn.Linear.reset_parameters, nn.Embedding.reset_parameters, models.TinyGPT.__dict__["_init"])

    def linear_reset(self: Any) -> None:
        i = next(counter)
        std = scaled if i < 4 * n_layer and i % 4 in (1, 3) else 0.02
        with torch.no_grad():
            nn.init.normal_(self.weight, mean=0.0, std=std)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    def embedding_reset(self: Any) -> None:
        with torch.no_grad():
            nn.init.normal_(self.weight, mean=0.0, std=0.02)

    nn.Linear.reset_parameters = linear_reset  # type: ignore[method-assign]
    nn.Embedding.reset_parameters = embedding_reset  # type: ignore[method-assign]
    models.TinyGPT._init = staticmethod(lambda module: None)
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved[0], saved[1]  # type: ignore[method-assign]
        models.TinyGPT._init = saved[2]


def _batch(torch: Any, spec: dict[str, Any], rank: int) -> tuple[Any, Any]:
    """This rank's fixed micro batch (the same every step: the loss must fall if training works)."""
    gen = torch.Generator().manual_seed(1234 + rank)
    row = torch.randint(0, spec["model"]["vocab_size"], (1, spec["seq"] + 1), generator=gen)
    return row[:, :-1].contiguous(), row[:, 1:].contiguous()


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Build, initialise and train; return this rank's numbers."""
    sampler = RssSampler()
    io_start = proc_io()
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(int(spec["threads"]))
    rank = int(os.environ["RANK"])
    lib = _framework(spec["framework"])
    models = load_models(spec["models_path"])
    gcfg = models.GPTConfig(**spec["model"])
    torch.manual_seed(1234)
    # Both libraries take the config under ``config_dict_or_path``; shardwise also as ``config``.
    zero_init = lib.zero.Init(
        remote_device="nvme", config_dict_or_path=spec["config"], enabled=spec["zero_init"]
    )
    with tinygpt_init_in_constructors(models, gcfg.n_layer), zero_init:
        model = models.TinyGPT(gcfg)
    t_model = time.perf_counter()
    params = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    sampler.enter("initialize")
    engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=spec["config"])
    t_built = time.perf_counter()
    sampler.enter("steps")
    hwm_build = _status_kib(("VmHWM",))["VmHWM"] * 1024
    io_built = proc_io()
    x, y = _batch(torch, spec, rank)
    steps = []
    stat = spec.get("device_stat")
    for _ in range(spec["steps"]):
        before, dev_before = proc_io(), device_io(stat)
        s0 = time.perf_counter()
        sampler.enter("forward")
        loss = engine(x, y)
        sampler.enter("backward")
        engine.backward(loss)
        sampler.enter("optimizer")
        engine.step()
        seconds = time.perf_counter() - s0
        after, dev_after = proc_io(), device_io(stat)
        steps.append(
            {
                "seconds": seconds,
                "loss": float(loss.detach().float()),
                "io": {k: after[k] - before[k] for k in _IO_KEYS},
                "device": {k: dev_after[k] - dev_before[k] for k in dev_after},
            }
        )
    sampler.stop()
    for phase, parts in (
        ("steps", ("forward", "backward", "optimizer")),
        ("build", ("model", "initialize")),
    ):
        peaks = [sampler.peaks.get(part, {}) for part in parts]
        sampler.peaks[phase] = {key: max(p.get(key, 0) for p in peaks) for key in ("RssAnon", "VmRSS")}
    swap_dir = spec["config"]["zero_optimization"]["offload_param"]["nvme_path"]
    result = {
        "rank": rank,
        "params": params,
        "model_s": t_model - t0,
        "build_s": t_built - t0,
        "build_io": {k: io_built[k] - io_start[k] for k in _IO_KEYS},
        "steps": steps,
        "peaks": sampler.peaks,
        "hwm_build": hwm_build,
        "hwm": _status_kib(("VmHWM",))["VmHWM"] * 1024,
        "swap_bytes": bytes_on_disk(swap_dir),  # every rank's files: the ranks share the directory
        "versions": {"torch": torch.__version__, spec["framework"]: getattr(lib, "__version__", "?")},
    }
    destroy = getattr(engine, "destroy", None)
    if callable(destroy):
        destroy()
    return result


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(spec["out"])
    try:
        result = run(spec)
    except BaseException:
        out.with_suffix(".error").write_text(traceback.format_exc())
        raise
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
