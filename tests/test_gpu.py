"""The optional accelerator report: works without torch and never raises."""

import sys

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
