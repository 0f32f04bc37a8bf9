"""Tiny policies for the engine and learner unit tests (built from a config, no download)."""

from __future__ import annotations

import pytest
import torch

from scalerl.config import TinyModel
from scalerl.policy.models import load_policy


@pytest.fixture(scope="module")
def model0() -> torch.nn.Module:
    return load_policy(TinyModel(), seed=0)[0]


@pytest.fixture(scope="module")
def model1() -> torch.nn.Module:
    return load_policy(TinyModel(), seed=1)[0]
