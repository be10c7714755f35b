"""Bundled real scan for demos, examples and tests (see ATTRIBUTION.md)."""

import os

import numpy as np

LIDAR_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lidar_198k.npz")


def load_lidar():
    """The bundled outdoor LiDAR sweep: float32 [198130, 3] (x, y, z in metres)."""
    return np.load(LIDAR_PATH)["pc"]
