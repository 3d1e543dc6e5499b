"""MoE checkpoints between shardwise and real DeepSpeed 0.19.8 in DeepSpeed's per-expert file layout.

1. shardwise trains the tiny MoE GPT of ``tests/distributed/moe_cases.py`` at EP=2 on 2 gloo ranks
   (ZeRO 0, fp32, Adam), saves, and ``to-deepspeed`` writes the checkpoint for EP=2 and for EP=1;
   DeepSpeed loads each (2 ranks at EP=2, 1 rank at EP=1): every weight and Adam moment is compared
   bitwise with shardwise's saved ones; and DeepSpeed loads shardwise's own save directory (the
   DeepSpeed MoE files ``save_checkpoint`` writes next to its own) with ``load_module_only=True``.
2. DeepSpeed trains the same model at EP=2 and saves (ZeRO 0, then ZeRO 2); shardwise loads it at the
   same stage at EP=2 and at EP=1 and saves again: every weight and moment DeepSpeed can give
   (``safe_get_full_*``; at ZeRO 2 it gives no expert moments) is compared bitwise.
3. The same in bf16 at ZeRO 0 (DeepSpeed's fused 16-bit wrapper).
4. With ``--ds-tests`` (a DeepSpeed checkout's tests/): DeepSpeed's AutoEP test model (bf16, its
   ``torch_adam``, so DeepSpeed's unfused 16-bit wrapper) written by ``to-deepspeed`` and resumed by
   DeepSpeed (masters and moments compared); saved by shardwise's engine and loaded by DeepSpeed (module
   only); and the reverse (weights, and the fp32 masters and moments DeepSpeed's unfused wrapper holds).

    python benchmarks/moe_checkpoint_interop.py --ds-python /work/venv-ds/bin/python [--ds-tests /path/DeepSpeed/tests]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "distributed"))
sys.path.insert(0, str(HERE))

from moe_cases import deepspeed_format_round_trip  # noqa: E402
from universal_interop import free_port  # noqa: E402

from shardwise.checkpoint.universal_write import read_full_checkpoint  # noqa: E402
from shardwise.testing import run_distributed_cases  # noqa: E402


def run_deepspeed(python: str, world: int, args: list[str]) -> None:
    """``world`` ranks of ``moe_checkpoint_worker.py``; raises with the output when one fails."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
        procs.append(subprocess.Popen([python, str(HERE / "moe_checkpoint_worker.py"), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        if proc.returncode and b"RECORD " not in out:  # (a crash at exit, after the record, is DeepSpeed's)
            raise RuntimeError(out.decode(errors="replace")[-3000:])


def compare(dumps: list[Path], tag_dir: Path) -> tuple[int, int]:
    """``(tensors compared, tensors that differ)`` between DeepSpeed's dumps and a shardwise tag."""
    full = read_full_checkpoint(tag_dir)
    module, optimizer = full["module"], full["optimizer"]
    seen = differ = 0
    for dump in dumps:
        for key, value in torch.load(dump).items():
            name, _, state = key.partition("/")
            ref = optimizer[f"optim/{name}/{state}"] if state else optimizer.get(f"master/{name}", module[name])
            seen += 1
            differ += not torch.equal(value, ref.to(value.dtype).reshape(value.shape))
    return seen, differ


def main() -> None:
    """Both directions; prints one line per check and exits 1 when a tensor differs."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ds-python", required=True, help="an interpreter with DeepSpeed 0.19.8")
    parser.add_argument("--ds-tests", help="a DeepSpeed checkout's tests/ directory: adds the AutoEP exchange")
    args = parser.parse_args()
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run_distributed_cases(deepspeed_format_round_trip, [{"action": "save", "ep": 2, "root": tmp}], 2, timeout=300)
        for ep in (2, 1):
            run_deepspeed(args.ds_python, ep, ["--dir", f"{tmp}/ds_ep{ep}", "--ep", str(ep), "--dump", f"{tmp}/d{ep}"])
            seen, differ = compare([root / f"d{ep}.{r}" for r in range(ep)], root / "shardwise" / "t2")
            print(f"shardwise EP=2 -> to-deepspeed -> DeepSpeed EP={ep}: {seen} tensors, {differ} differ")
            bad += differ
        run_deepspeed(args.ds_python, 2, ["--dir", f"{tmp}/shardwise", "--ep", "2", "--module-only", "--dump", f"{tmp}/m"])
        seen, differ = compare([root / f"m.{r}" for r in range(2)], root / "shardwise" / "t2")
        print(f"shardwise EP=2 save_checkpoint (its DeepSpeed MoE files) -> DeepSpeed EP=2, load_module_only: "
              f"{seen} weights, {differ} differ")
        bad += differ
        for stage in (0, 2):
            run_deepspeed(args.ds_python, 2, ["--dir", f"{tmp}/from_ds{stage}", "--ep", "2", "--stage", str(stage),
                                              "--save", "--dump", f"{tmp}/s{stage}"])
            for ep in (2, 1):
                out = f"{tmp}/back{stage}_ep{ep}"
                case = {"action": "load", "ep": ep, "stage": stage, "root": tmp, "src": f"{tmp}/from_ds{stage}",
                        "out": out}
                run_distributed_cases(deepspeed_format_round_trip, [case], 2, timeout=300)
                seen, differ = compare([root / f"s{stage}.{r}" for r in range(2)], Path(out) / "t2")
                print(f"DeepSpeed ZeRO {stage} EP=2 -> shardwise ZeRO {stage} EP={ep}: {seen} tensors, {differ} differ")
                bad += differ
        bad += bf16_exchange(args.ds_python, tmp, root)
        if args.ds_tests:
            bad += autoep_exchange(args.ds_python, args.ds_tests, root)
    sys.exit(1 if bad else 0)


def bf16_exchange(ds_python: str, tmp: str, root: Path) -> int:
    """The same at ZeRO 0 in bf16 (DeepSpeed's fused 16-bit wrapper: flat fp32 masters and moments per
    group), both ways at EP=2, and DeepSpeed's save into shardwise at EP=1; returns tensors that differ."""
    bad = 0
    run_distributed_cases(deepspeed_format_round_trip, [{"action": "save", "ep": 2, "root": f"{tmp}/bf", "bf16": True}],
                          2, timeout=300)
    run_deepspeed(ds_python, 2, ["--dir", f"{tmp}/bf/ds_ep2", "--ep", "2", "--bf16", "--dump", f"{tmp}/bfd"])
    seen, differ = compare([root / f"bfd.{r}" for r in range(2)], root / "bf" / "shardwise" / "t2")
    print(f"bf16: shardwise EP=2 -> to-deepspeed -> DeepSpeed EP=2: {seen} tensors (fp32 masters, moments), "
          f"{differ} differ")
    bad += differ
    run_deepspeed(ds_python, 2, ["--dir", f"{tmp}/from_ds_bf", "--ep", "2", "--bf16", "--save", "--dump", f"{tmp}/sbf"])
    for ep in (2, 1):
        out = f"{tmp}/back_bf_ep{ep}"
        case = {"action": "load", "ep": ep, "root": tmp, "src": f"{tmp}/from_ds_bf", "out": out, "bf16": True}
        run_distributed_cases(deepspeed_format_round_trip, [case], 2, timeout=300)
        seen, differ = compare([root / f"sbf.{r}" for r in range(2)], Path(out) / "t2")
        print(f"bf16: DeepSpeed EP=2 -> shardwise EP={ep}: {seen} tensors, {differ} differ")
        bad += differ
    return bad


def autoep_exchange(ds_python: str, ds_tests: str, root: Path) -> int:
    """DeepSpeed's AutoEP test model (mixtral preset, bf16, EP=1) saved by one side, loaded by the other;
    returns the number of parameters that differ."""
    site = root / "site"
    subprocess.run([sys.executable, "-m", "shardwise.cli.main", "compat", "install-deepspeed", "--target", str(site)],
                   check=True, capture_output=True)
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    sides = {"shardwise": (sys.executable, f"{site}{os.pathsep}{ds_tests}"), "DeepSpeed": (ds_python, ds_tests)}
    worker = str(HERE / "moe_autoep_checkpoint_worker.py")
    bad = 0
    # shardwise saves, `to-deepspeed` writes DeepSpeed's layout, DeepSpeed resumes it with its optimizer
    python, path = sides["shardwise"]
    run = dict(env, PYTHONPATH=path, MASTER_PORT=str(free_port()))
    subprocess.run([python, worker, "save", str(root / "autoep_sw")], env=run, check=True, capture_output=True)
    subprocess.run([python, "-m", "shardwise.cli.main", "checkpoint", "to-deepspeed", str(root / "autoep_sw"),
                    str(root / "autoep_ds")], check=True, capture_output=True)
    (root / "autoep_ds" / "params.pt").write_bytes((root / "autoep_sw" / "params.pt").read_bytes())
    python, path = sides["DeepSpeed"]
    out = subprocess.run([python, worker, "load", str(root / "autoep_ds"), "--dump", str(root / "autoep_dump")],
                         env=dict(env, PYTHONPATH=path, MASTER_PORT=str(free_port())), capture_output=True, text=True,
                         timeout=600)
    if "RECORD " not in out.stdout:
        raise RuntimeError(f"DeepSpeed load: {out.stdout[-2000:]}{out.stderr[-2000:]}")
    seen, differ = compare([root / "autoep_dump"], root / "autoep_sw" / "a")
    print(f"AutoEP (DeepSpeed's test model, bf16): shardwise -> to-deepspeed -> DeepSpeed full load: {seen} tensors "
          f"(fp32 masters, moments), {differ} differ")
    bad += differ
    for writer, reader, module_only in (("shardwise", "DeepSpeed", True), ("DeepSpeed", "shardwise", False)):
        directory = root / f"autoep_{writer}"
        for who, action in ((writer, "save"), (reader, "load")):
            python, path = sides[who]
            extra = ["--module-only"] if module_only and action == "load" else []
            out = subprocess.run([python, str(HERE / "moe_autoep_checkpoint_worker.py"), action, str(directory), *extra],
                                 env=dict(env, PYTHONPATH=path, MASTER_PORT=str(free_port())), capture_output=True,
                                 text=True, timeout=600)
            if out.returncode:
                raise RuntimeError(f"{who} {action}: {out.stdout[-2000:]}{out.stderr[-2000:]}")
        record = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RECORD "))[len("RECORD "):])
        how = "load_module_only" if module_only else "full load"
        print(f"AutoEP (DeepSpeed's test model, bf16): {writer} save_checkpoint -> {reader} {how}: "
              f"{record['params']} parameters, {len(record['differ'])} differ")
        bad += len(record["differ"])
    # and the optimizer of DeepSpeed's save: what DeepSpeed holds after loading it against shardwise's resave
    directory = root / "autoep_DeepSpeed"
    for who, extra in (("DeepSpeed", ["--dump", str(root / "autoep_ds_dump")]),
                       ("shardwise", ["--resave", str(root / "autoep_back")])):
        python, path = sides[who]
        subprocess.run([python, worker, "load", str(directory), *extra], check=True, capture_output=True,
                       env=dict(env, PYTHONPATH=path, MASTER_PORT=str(free_port())), timeout=600)
    seen, differ = compare([root / "autoep_ds_dump"], root / "autoep_back" / "a")
    print(f"AutoEP (DeepSpeed's test model, bf16): DeepSpeed save_checkpoint -> shardwise full load: {seen} tensors "
          f"(fp32 masters, moments), {differ} differ")
    return bad + differ


if __name__ == "__main__":
    main()
