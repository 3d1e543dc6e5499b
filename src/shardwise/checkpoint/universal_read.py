"""Read DeepSpeed's universal checkpoints (``ds_to_universal`` output, or ``to-universal``'s).

A universal checkpoint holds every parameter whole, one folder per parameter under ``zero/``
(:mod:`~shardwise.checkpoint.universal_names`), so it loads at any world size and ZeRO stage.
:class:`UniversalCheckpoint` reads it into the same shapes as the native DeepSpeed importer
(:class:`~shardwise.checkpoint.deepspeed_import.DeepSpeedCheckpoint`): the module's state dict
and the optimizer state in ``OptimizerState.full_state_dict`` form (``master/<name>``,
``optim/<name>/<key>``, ``optim/param_groups``). Every ``<state>.pt`` file of a parameter's
folder is optimizer state, whatever its name (Adam's ``exp_avg``/``exp_avg_sq``, SGD's
``momentum_buffer``, Muon's ``momentum_buffer``...), not only Adam's.

Files are read with ``weights_only=True`` and stand-ins for DeepSpeed's classes (no DeepSpeed
needed, no arbitrary pickle code).

Example:
    >>> # engine.load_checkpoint("universal_dir")   # with "checkpoint": {"load_universal": true}
    >>> # UniversalCheckpoint(Path("universal_dir/global_step3")).module_state_dict()
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import keys
from shardwise.checkpoint import universal_names as names
from shardwise.checkpoint.deepspeed_files import ForeignObject, _plain, _rank_of, load_file


def _number(value: Any) -> Any:
    """A step as a plain number (DeepSpeed writes ints, torch keeps 0-dim tensors)."""
    if torch.is_tensor(value) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class UniversalCheckpoint:
    """One universal tag directory, readable by parameter name.

    Raises:
        FileNotFoundError: no ``zero/optimizer_state.pt`` or no model-states file.
        ValueError: the model states name no parameters (``param_shapes``).
    """

    def __init__(self, tag_dir: Path) -> None:
        self.tag_dir = Path(tag_dir)
        self.zero_dir = self.tag_dir / names.ZERO_DIR
        optim_file = self.zero_dir / names.OPTIMIZER_STATE_FILE
        if not optim_file.is_file():
            raise FileNotFoundError(
                f"{tag_dir} is not a universal checkpoint: {names.ZERO_DIR}/{names.OPTIMIZER_STATE_FILE} is missing"
            )
        candidates = [self.tag_dir / names.MODEL_STATES_FILE, self.tag_dir / names.STAGE3_MODEL_STATES_FILE]
        candidates += sorted(self.tag_dir.glob("*model_states.pt"))
        self.model_file = next((f for f in candidates if f.is_file()), None)
        if self.model_file is None:
            raise FileNotFoundError(f"{tag_dir} has no *_model_states.pt file")
        self.model: dict[str, Any] = load_file(self.model_file)
        self.optim: dict[str, Any] = load_file(optim_file)
        self.stage = int(_plain(self.optim.get("zero_stage", 0)) or 0)
        self.world_size = int(self.model.get("dp_world_size", 1) or 1)
        self.buffer_names = list(self.model.get("buffer_names") or [])
        groups = self.model.get("param_shapes")
        if isinstance(groups, dict):
            groups = [groups]
        if not groups:
            raise ValueError(
                f"{self.model_file}: 'param_shapes' is empty, so the checkpoint names no trainable parameters; "
                "it was not written by ds_to_universal or shardwise checkpoint to-universal"
            )
        self.groups: list[dict[str, tuple[int, ...]]] = [
            {name: tuple(shape) for name, shape in group.items()} for group in groups
        ]
        self.shapes = {n: s for group in self.groups for n, s in group.items()}
        frozen = self.model.get("frozen_param_shapes") or {}
        self.frozen_shapes = {n: tuple(s) for n, s in frozen.items()}

    # ------------------------------------------------------------------ files
    def state_keys(self, name: str) -> list[str]:
        """The state files of parameter ``name`` (``fp32``, ``exp_avg``, ``step``...), sorted."""
        folder = self.zero_dir / name
        return sorted(p.stem for p in folder.glob("*.pt")) if folder.is_dir() else []

    def read_state(self, name: str, key: str) -> Any:
        """One state of a parameter: a full tensor at its shape, or a number for ``step``.

        Raises:
            FileNotFoundError: no such file.
            ValueError: the tensor's size differs from the parameter's.
        """
        path = self.zero_dir / name / f"{key}.pt"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: the universal checkpoint has no {key!r} for {name!r}"
            )
        value = load_file(path)
        if key == names.STEP:
            return _number(value)
        if isinstance(value, dict):
            if names.PARAM not in value:
                raise ValueError(
                    f"{path}: expected a dict with a {names.PARAM!r} tensor, found keys {sorted(value)}"
                )
            value = value[names.PARAM]
        if isinstance(value, ForeignObject) or not torch.is_tensor(value):
            raise ValueError(f"{path}: expected a tensor, found {type(value).__name__}")
        shape = self.shapes.get(name) or self.frozen_shapes.get(name)
        if shape is not None:
            if value.numel() != math.prod(shape):
                raise ValueError(
                    f"{path}: {value.numel()} elements, but parameter {name!r} has shape {shape} "
                    f"({math.prod(shape)} elements)"
                )
            value = value.reshape(shape)
        return value

    def _step(self, name: str) -> Any:
        if (self.zero_dir / name / f"{names.STEP}.pt").is_file():
            return self.read_state(name, names.STEP)
        inner = self.optim.get("optimizer_state_dict") or {}  # DeepSpeed's ZeRO-3 conversion keeps it here
        state = (inner.get("state") or {}).get(0) or {}
        return _number(state[names.STEP]) if names.STEP in state else None

    # ------------------------------------------------------------------ module
    def module_specs(self, *, exclude_frozen: bool = False) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``name -> (shape, dtype)`` of the module's state dict, in its order."""
        specs = {}
        for name, tensor in self.model["module"].items():
            if exclude_frozen and name in self.frozen_shapes:
                continue
            shape = self.shapes.get(name) or self.frozen_shapes.get(name) or tuple(tensor.shape)
            specs[name] = (tuple(shape), tensor.dtype)
        return specs

    def best_dtype(self, name: str) -> torch.dtype:
        """fp32 where ``zero/<name>/fp32.pt`` exists, else the saved dtype."""
        if (self.zero_dir / name / f"{names.FP32}.pt").is_file():
            return torch.float32
        return self.model["module"][name].dtype

    def read_module_tensor(self, name: str) -> torch.Tensor:
        """A full module tensor: the fp32 value from ``zero/`` where there is one."""
        if (self.zero_dir / name / f"{names.FP32}.pt").is_file():
            return self.read_state(name, names.FP32)
        tensor = self.model["module"][name]
        shape = self.module_specs()[name][0]
        if name in self.frozen_shapes and tensor.numel() == 0 and math.prod(shape):
            return self._stage3_frozen(name, shape)
        if name not in self.buffer_names and tensor.numel() == 0 and math.prod(shape):
            raise ValueError(f"{self.tag_dir}: parameter {name!r} has no {names.ZERO_DIR}/{name}/fp32.pt")
        return tensor

    def _stage3_frozen(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A frozen ZeRO-3 parameter: DeepSpeed's conversion writes no ``fp32.pt`` for it, but keeps
        every rank's ``frozen_param_fragments`` in the copied ``zero_pp_rank_*`` model states."""
        files = sorted(self.tag_dir.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"), key=_rank_of)
        found = [(load_file(f).get("frozen_param_fragments") or {}).get(name) for f in files]
        pieces = [p for p in found if p is not None]
        if not files or len(pieces) != len(found):
            raise ValueError(f"{self.tag_dir}: frozen parameter {name!r} has neither fp32.pt nor ZeRO-3 fragments")
        return torch.cat([p.reshape(-1) for p in pieces])[: math.prod(shape)].view(shape)

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """Every module entry, full size, in the module's dtype."""
        return {
            name: self.read_module_tensor(name).to(dtype) for name, (_, dtype) in self.module_specs().items()
        }

    # ------------------------------------------------------------------ optimizer
    def optimizer_state(self, trainable_names: Sequence[str] = ()) -> dict[str, Any]:
        """Masters, every optimizer state and the param groups in ``full_state_dict`` form."""
        out: dict[str, Any] = {}
        scalars = self.optim.get(names.SCALAR_STATE) or {}
        saved_groups = list(self.optim.get("param_groups") or [])
        if saved_groups and len(saved_groups) != len(self.groups):
            raise ValueError(
                f"{self.tag_dir}: {len(saved_groups)} optimizer param groups but {len(self.groups)} groups of "
                "param_shapes; the two files are from different checkpoints"
            )
        groups = []
        for index, shapes in enumerate(self.groups):
            for name in shapes:
                out[keys.master_key(name)] = self.read_state(name, names.FP32)
                for key in self.state_keys(name):
                    if key not in (names.FP32, names.STEP):
                        out[f"{keys.OPTIM}{name}/{key}"] = self.read_state(name, key)
                step = self._step(name)
                if step is not None:
                    out[f"{keys.OPTIM}{name}/{names.STEP}"] = step
                for key, value in (scalars.get(name) or {}).items():
                    out[f"{keys.OPTIM}{name}/{key}"] = value
            hyper = saved_groups[index] if saved_groups else {}
            groups.append(
                {**{k: v for k, v in hyper.items() if k != "params"}, keys.PARAM_NAMES: list(shapes)}
            )
        out[keys.PARAM_GROUPS] = groups
        return out

    def saved_loss_scaler(self) -> Any:
        """The saved loss scaler: shardwise's state dict, or DeepSpeed's object (a stand-in), or None."""
        return self.optim.get(names.LOSS_SCALER) or self.optim.get("loss_scaler")

    def counters(self) -> dict[str, int]:
        """``global_steps``, ``skipped_steps`` and (when saved) ``global_samples``."""
        out = {
            "global_steps": int(self.model.get("global_steps", 0) or 0),
            "skipped_steps": int(self.model.get("skipped_steps", 0) or 0),
        }
        if self.model.get("global_samples") is not None:
            out["global_samples"] = int(self.model["global_samples"])
        return out

    def describe(self) -> dict[str, Any]:
        """A short summary for ``shardwise checkpoint info``."""
        first = next(iter(self.shapes))
        return {
            "zero_stage": self.stage,
            "world_size": self.world_size,
            "global_steps": self.model.get("global_steps"),
            "ds_version": self.optim.get("ds_version") or self.model.get("ds_version"),
            "trainable_parameters": sum(math.prod(s) for s in self.shapes.values()),
            "frozen_parameters": sum(math.prod(s) for s in self.frozen_shapes.values()),
            "optimizer_state_keys": [k for k in self.state_keys(first) if k != names.FP32],
            "files": len(list(self.tag_dir.rglob("*.pt"))),
        }


def read_universal_checkpoint(path: str | Path, tag: str | None = None) -> UniversalCheckpoint:
    """Open a universal checkpoint: a directory with ``latest_universal``, or a tag directory.

    Example:
        >>> # read_universal_checkpoint("universal").optimizer_state()["optim/fc.weight/exp_avg"]
    """
    from shardwise.checkpoint import layout

    return UniversalCheckpoint(layout.resolve(path, tag, latest_name=layout.LATEST_UNIVERSAL))
