"""Lookups from a parameter to stage-3 bookkeeping: weak registries, no parameter attributes."""

from __future__ import annotations

import gc
import weakref

import torch

from shardwise.zero.external_params import (
    is_external,
    register_external_parameter,
    unregister_external_parameter,
)
from shardwise.zero.sharded_model import record_of


def test_external_registration_is_kept_outside_the_parameter_and_released_with_it():
    head = torch.nn.Linear(2, 2)
    weight = head.weight
    assert not is_external(weight)
    register_external_parameter(head, weight)
    assert is_external(weight) and not is_external(head.bias)
    assert not [k for k in vars(weight) if k.startswith("_shardwise")]
    unregister_external_parameter(head, weight)
    assert not is_external(weight)
    register_external_parameter(head, weight)
    ref = weakref.ref(weight)
    del head, weight
    gc.collect()
    assert ref() is None  # the registry does not keep parameters alive


def test_an_unsharded_parameter_or_module_has_no_record():
    model = torch.nn.Linear(2, 2)
    assert record_of(model) is None and record_of(model.weight) is None
