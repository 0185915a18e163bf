"""Shared test set-up: MindSpore on CPU, and the repo's tests folder importable."""

from __future__ import annotations

import os
import sys

import mindspore

mindspore.set_device("CPU")
sys.path.insert(0, os.path.dirname(__file__))
