"""What accelerator a node has, for operators' logs: optional, never required.

Only llama.cpp's own build decides whether ``n_gpu_layers`` offloads anything: the wheel
pip builds by default is CPU-only, and nothing else installed (torch included) changes
that. Rebuild llama-cpp-python with a GPU backend (``make llama-gpu GPU=cuda|metal|
vulkan``, README "GPU"). ``torch``, when it happens to be installed, is used only to name
the GPU and report its free memory.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = ["GpuReport", "gpu_report", "describe", "cpu_only_warning", "REBUILD_HINT"]

REBUILD_HINT = ("rebuild llama-cpp-python with a GPU backend: make llama-gpu GPU=cuda "
                "(or metal, vulkan); see the README section 'GPU'")


@dataclass(frozen=True)
class GpuReport:
    llama_gpu_offload: bool | None  # llama.cpp built with a GPU backend? None = unknown
    devices: tuple[tuple[str, int, int], ...]  # (name, free bytes, total bytes) per GPU


def _llama_offload() -> bool | None:
    try:
        llama_cpp = importlib.import_module("llama_cpp")
        return bool(llama_cpp.llama_supports_gpu_offload())
    except Exception:  # not installed, or a build without the symbol
        return None


def _torch_devices() -> tuple[tuple[str, int, int], ...]:
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return ()
    try:
        if not torch.cuda.is_available():
            return ()
        out = []
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            out.append((torch.cuda.get_device_name(i), int(free), int(total)))
        return tuple(out)
    except Exception:  # a broken driver must not stop a CPU node
        return ()


def gpu_report() -> GpuReport:
    return GpuReport(llama_gpu_offload=_llama_offload(), devices=_torch_devices())


def describe(report: GpuReport) -> str:
    """One line for the node's start-up log."""
    offload = {True: "llama.cpp GPU offload available", False: "llama.cpp CPU-only build",
               None: "llama.cpp GPU offload unknown"}[report.llama_gpu_offload]
    if not report.devices:
        return f"no GPU named (torch is not installed or sees none); {offload}"
    gpus = ", ".join(f"{name} ({free / 2**30:.1f} of {total / 2**30:.1f} GiB free)"
                     for name, free, total in report.devices)
    return f"{gpus}; {offload}"


def cpu_only_warning(n_gpu_layers: int, report: GpuReport) -> str | None:
    """The warning for ``n_gpu_layers != 0`` on a llama.cpp that cannot offload, or None."""
    if n_gpu_layers == 0 or report.llama_gpu_offload is not False:
        return None
    layers = "all layers" if n_gpu_layers < 0 else f"{n_gpu_layers} layers"
    return (f"n_gpu_layers = {n_gpu_layers} asks for {layers} on a GPU, but this "
            f"llama-cpp-python build is CPU-only: the model runs on the CPU; {REBUILD_HINT}")
