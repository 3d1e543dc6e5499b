"""Names in DeepSpeed's universal checkpoint layout (what ``ds_to_universal`` writes; spec 8.5).

::

    <dir>/latest_universal                      the tag
    <dir>/<tag>/mp_rank_00_model_states.pt      module, param_shapes, counters, scheduler, config
    <dir>/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt   the same for a ZeRO-3 loader
    <dir>/<tag>/zero/optimizer_state.pt         param_groups, clip_grad, ds_version, ...
    <dir>/<tag>/zero/<param>/fp32.pt            {"param": full fp32 tensor, "cat_dim": 0}
    <dir>/<tag>/zero/<param>/<state>.pt         the same for each element-wise optimizer state
    <dir>/<tag>/zero/<param>/step.pt            the optimizer step (a number, not a dict)

DeepSpeed's ZeRO-3 conversion writes ``<state>.pt`` as a bare flat tensor and no ``step.pt``
(the step is in ``optimizer_state.pt``); readers accept both.
"""

from __future__ import annotations

ZERO_DIR = "zero"
OPTIMIZER_STATE_FILE = "optimizer_state.pt"
MODEL_STATES_FILE = "mp_rank_00_model_states.pt"
STAGE3_MODEL_STATES_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"
FP32 = "fp32"
STEP = "step"
PARAM = "param"
CAT_DIM = "cat_dim"
UNIVERSAL_INFO = "universal_checkpoint_info"
UNIVERSAL_VERSION_KEY = "universal_checkpoint_version"
UNIVERSAL_VERSION = 0.2
DS_VERSION = "0.19.8"  # the DeepSpeed release whose layout and loader this follows
# shardwise's own additions (DeepSpeed's loaders ignore keys they do not read)
SCALAR_STATE = "shardwise_scalar_state"  # {param: {key: value}}: non-element-wise state besides step
LOSS_SCALER = (
    "shardwise_loss_scaler"  # shardwise's loss-scaler state_dict (DeepSpeed's own key holds its object)
)
