"""The optional accelerator report: works without torch and never raises."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefixmesh.inference.gpu import GpuReport, cpu_only_warning, describe, gpu_report


def test_report_without_torch_names_the_llama_build(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    report = gpu_report()
    assert report.devices == ()
    assert report.llama_gpu_offload in (True, False)  # llama_cpp is installed here
    assert "no GPU named" in describe(report)


def test_describe_lists_devices():
    line = describe(GpuReport(llama_gpu_offload=True, devices=(("H200", 2**30, 2**31),)))
    assert "H200 (1.0 of 2.0 GiB free)" in line and "offload available" in line


def test_cpu_only_build_with_gpu_layers_is_a_warning_with_the_fix():
    cpu = GpuReport(llama_gpu_offload=False, devices=())
    text = cpu_only_warning(-1, cpu)
    assert text is not None and "CPU-only" in text and "make llama-gpu" in text
    assert "all layers" in text
    assert "20 layers" in cpu_only_warning(20, cpu)
    assert cpu_only_warning(0, cpu) is None  # nothing asked of a GPU
    assert cpu_only_warning(-1, GpuReport(llama_gpu_offload=True, devices=())) is None
    assert cpu_only_warning(-1, GpuReport(llama_gpu_offload=None, devices=())) is None


def test_describe_no_longer_suggests_the_torch_extra():
    assert "extra" not in describe(GpuReport(llama_gpu_offload=False, devices=()))


@pytest.mark.slow
def test_node_on_a_cpu_only_build_warns_about_gpu_layers(tmp_path):
    """A real ``prefixmesh node --n-gpu-layers -1`` (real model, real libp2p) on this
    CPU-only build logs the WARNING with the fix, and still serves."""
    import llama_cpp

    if llama_cpp.llama_supports_gpu_offload():
        pytest.skip("this llama-cpp-python build can offload: the warning does not apply")
    from _model_fixture import default_model_path

    script = Path(sys.executable).parent / "prefixmesh"
    cli = [str(script)] if script.exists() else [sys.executable, "-m", "prefixmesh"]
    proc = subprocess.Popen(
        [*cli, "node", "--n-gpu-layers", "-1", "--model", str(default_model_path()),
         "--n-ctx", "512", "--n-threads", "1", "--key-file", str(tmp_path / "node.key"),
         "--cache-dir", str(tmp_path / "cache"), "--no-mdns"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        for line in proc.stdout:
            if line.strip() == "ready" or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    warnings = [ln for ln in err.splitlines() if " WARNING " in ln and "CPU-only" in ln]
    assert len(warnings) == 1, err
    assert "n_gpu_layers = -1" in warnings[0] and "make llama-gpu" in warnings[0]
    assert proc.returncode == 0, err
