"""Emulated msm render node (level A): GEM over memfd, PROT_NONE IOVA window, kernel-like submit checks, PM4 on one ring."""
from backend.emu.executor import Dispatch, GpuFault
from backend.emu.node import RenderNode, SubmitRecord

__all__ = ["Dispatch", "GpuFault", "RenderNode", "SubmitRecord"]
