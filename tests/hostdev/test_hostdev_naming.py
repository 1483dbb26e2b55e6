from __future__ import annotations

import pytest

from hostdev.naming import nvidia_device_name, nvidia_resource_name, pci_resource_env


@pytest.mark.parametrize(
    ("pci_ids_name", "device_id", "expected"),
    [
        ("GH100[H100 SXM5 80GB]", 0x2330, "GH100H100_SXM5_80GB"),
        ("GA100 [A100 PCIe 80GB]", 0x20B5, "GA100_A100_PCIE_80GB"),
        ("GH100 [H100 NVSwitch]", 0x22A3, "GH100_H100_NVSWITCH"),
        ("TU104GL [Tesla T4]", 0x1EB8, "TU104GL_TESLA_T4"),
        ("GP104GL [Tesla P4]", 0x1BB3, "GP104GL_TESLA_P4"),
        ("AD102GL [L40S]", 0x26B9, "AD102GL_L40S"),
        ("GK210GL [Tesla K80]", 0x102D, "GK210GL_TESLA_K80"),
        ("GV100GL [Tesla V100 SXM2 16GB]", 0x1DB1, "GV100GL_TESLA_V100_SXM2_16GB"),
        ("GA102GL [RTX A6000/A40]", 0x2230, "GA102GL_RTX_A6000_A40"),
        ("GM200 [GeForce GTX 980 Ti]", 0x17C8, "GM200_GEFORCE_GTX_980_TI"),
        ("NV1x 2.0  \tfoo", 0x0001, "NV1X_2_0_FOO"),
        ("Straße (ß) + ünicode", 0x0002, "STRAE___NICODE"),
        (None, 0x2330, "2330"),
        ("  ", 0x0A1B, "0a1b"),
    ],
)
def test_names_match_nvidia_kubevirt_gpu_device_plugin(
    pci_ids_name: str | None, device_id: int, expected: str
) -> None:
    assert nvidia_device_name(pci_ids_name, device_id) == expected
    assert nvidia_resource_name(pci_ids_name, device_id) == f"nvidia.com/{expected}"


@pytest.mark.parametrize(
    ("resource", "env"),
    [
        ("nvidia.com/GH100H100_SXM5_80GB", "PCI_RESOURCE_NVIDIA_COM_GH100H100_SXM5_80GB"),
        ("nvidia.com/GH100", "PCI_RESOURCE_NVIDIA_COM_GH100"),
        ("intel.com/qat-vf", "PCI_RESOURCE_INTEL_COM_QAT-VF"),
        ("example.org/a.b", "PCI_RESOURCE_EXAMPLE_ORG_A_B"),
    ],
)
def test_env_name_is_the_one_virt_launcher_reads(resource: str, env: str) -> None:
    assert pci_resource_env(resource) == env
