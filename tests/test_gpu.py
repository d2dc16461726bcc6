"""The optional accelerator report: works without torch and never raises."""

import sys

from prefixmesh.inference.gpu import GpuReport, describe, gpu_report


def test_report_without_torch_names_the_llama_build(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    report = gpu_report()
    assert report.devices == ()
    assert report.llama_gpu_offload in (True, False)  # llama_cpp is installed here
    assert "no GPU reported" in describe(report)


def test_describe_lists_devices():
    line = describe(GpuReport(llama_gpu_offload=True, devices=(("H200", 2**30, 2**31),)))
    assert "H200 (1.0 of 2.0 GiB free)" in line and "offload available" in line
