"""Device profiles: what one GPU model reports through NVML when idle and when loaded.

Each profile holds a model's identity strings, memory size, clocks and their maxima, power and
temperature limits, NVLink count and the NVML queries the model answers with NotSupported, as
FakeNvml needs them. Values come from a recorded ``nvidia-smi -q`` (H100, checked against it by
tests/agent/nvml/test_profiles.py), from a real GPU recorded through NVML (H200), or from NVIDIA's
published specifications (cited per profile).
Profiles hold data only; FakeNvml turns them into NVML answers over time.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024

# NVML queries that SXM data-centre boards answer with NVML_ERROR_NOT_SUPPORTED: they have no fan
# of their own (nvidia-smi prints "Fan Speed: N/A"), and since Ampere HBM errors are handled by row
# remapping instead of page retirement ("Retired Pages ... N/A" on A100/H100; NVIDIA, "NVIDIA A100
# Tensor Core GPU Architecture", section "Memory error handling", and the recorded H100 output).
_SXM_NOT_SUPPORTED = frozenset({
    "nvmlDeviceGetFanSpeed",
    "nvmlDeviceGetRetiredPages",
    "nvmlDeviceGetRetiredPagesPendingStatus",
})


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    key: str  # the scenario's `profile:` value
    name: str  # nvmlDeviceGetName
    memory_total_bytes: int  # nvmlDeviceGetMemoryInfo().total
    # nvmlDeviceGetMemoryInfo(v2).reserved: set aside by the driver and firmware, so counted in v1's
    # `used` even on an idle GPU. It depends on the driver as much as on the board.
    memory_reserved_bytes: int
    sm_clock_max_mhz: int
    memory_clock_max_mhz: int
    sm_clock_idle_mhz: int
    power_limit_mw: int  # enforced power limit (the board's default TDP)
    power_idle_mw: int
    power_busy_mw: int  # sustained draw at 100% utilization
    temperature_idle_celsius: int
    temperature_busy_celsius: int
    memory_temperature_idle_celsius: int
    memory_temperature_busy_celsius: int
    shutdown_temperature_celsius: int
    slowdown_temperature_celsius: int
    gpu_max_temperature_celsius: int
    memory_max_temperature_celsius: int
    nvlink_count: int
    vbios_version: str
    driver_version: str
    cuda_driver_version: int  # nvmlSystemGetCudaDriverVersion: 1000 * major + 10 * minor
    pcie_bus_ids: tuple[str, ...]  # one per GPU slot of the baseboard, NVML's 8-digit-domain form
    pcie_max_bytes_per_second: int  # for the simulated PCIe throughput
    not_supported: frozenset[str] = _SXM_NOT_SUPPORTED
    # NVML's GPM (GPU performance monitoring) API: Hopper and later only (NVML API reference,
    # "GPM Functions"; nvidia-smi dmon prints GPM metrics "for Hopper and later GPUs"); older GPUs
    # answer nvmlGpmQueryDeviceSupport with isSupportedDevice = 0.
    gpm_supported: bool = False
    # MIG GPU instance profiles the board offers: (profile name, the instance's memory in bytes as
    # NVML reports it). Empty: no MIG layout can be scripted (the board answers MIG mode only if its
    # queries are not in not_supported).
    mig_profiles: tuple[tuple[str, int], ...] = ()
    # Configuration facts (issue 44) as an untouched node of this board reports them; a scenario's
    # config_drift fault changes them. nvmlDeviceGetInforomImageVersion; ECC and persistence mode
    # on (data-centre defaults, and what every recording here shows); the application clocks at the
    # board's default, its maximum clocks (every recording here: "Applications Clocks" = "Max Clocks").
    inforom_image_version: str = ""
    # The PCIe link the GPU and its slot allow (nvmlDeviceGetMaxPcieLinkGeneration/Width).
    pcie_link_generation_max: int = 5
    pcie_link_width_max: int = 16
    # NVLink fabric (nvmlDeviceGetGpuFabricInfo[V]): True on NVSwitch baseboards of Hopper and later,
    # where Fabric Manager registers each GPU ("Fabric State: Completed, Status: Success" in the
    # recorded HGX H100); False: the call answers state NOT_SUPPORTED (or NotSupported where the
    # profile lists the call in not_supported).
    nvswitch_fabric: bool = False
    # NVML functions this profile's driver predates: the fake raises NVMLError_FunctionNotFound, as
    # pynvml does when libnvidia-ml lacks the symbol.
    functions_missing: frozenset[str] = frozenset()
    # Whether the driver knows field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (else its nvmlReturn is
    # NotSupported). Driver 580 prints "GPU Recovery Action: None" (tests/fixtures/nvml-real/
    # nvidia-smi-q.txt:62, nvml-real-h200 likewise); 535.161.08 prints only the older "GPU Reset Status"
    # pair (tests/fixtures/nvidia-smi/nvidia-smi-q-8xH100-535.161.08.txt:50-52).
    recovery_action_supported: bool = False
    # Whose GPU it is: "nvidia" (NVML answers for it, FakeNvml imitates it) or "amd" (amdsmi,
    # FakeAmdSmi: agent/amdsmi/profiles.py), the vendor GpuState.vendor reports.
    vendor: str = "nvidia"

    def mig_memory_bytes(self, profile: str) -> int | None:
        return next((size for name, size in self.mig_profiles if name == profile), None)


# MIG GPU instance profiles and their memory from NVIDIA's Multi-Instance GPU User Guide ("Supported
# MIG Profiles", and its `nvidia-smi mig -lgip` listings, memory in GiB), for the 80 GB A100 and
# H100; recalled from the guide, not checked against a GPU here. The "+me" (media-extension) and
# 1g.20gb variants are left out: no scenario uses them.
_GIB = 1024 * MIB
A100_80GB_MIG = (("1g.10gb", int(9.5 * _GIB)), ("2g.20gb", int(19.5 * _GIB)), ("3g.40gb", int(39.25 * _GIB)),
                 ("4g.40gb", int(39.25 * _GIB)), ("7g.80gb", int(78.75 * _GIB)))
H100_80GB_MIG = (("1g.10gb", int(9.75 * _GIB)), ("2g.20gb", int(19.75 * _GIB)), ("3g.40gb", int(39.5 * _GIB)),
                 ("4g.40gb", int(39.5 * _GIB)), ("7g.80gb", int(79.25 * _GIB)))


# HGX H100 8-GPU baseboard, from the recorded `nvidia-smi -q` of driver 535.161.08
# (tests/fixtures/nvidia-smi/nvidia-smi-q-8xH100-535.161.08.txt, leptonai/gpud). That driver
# prints temperature limits relative to T.Limit: T.Limit = current + "GPU T.Limit Temp" = 85 C,
# shutdown at -8 C -> 93 C, slowdown at -2 C -> 87 C, max operating at 0 C -> 85 C. HBM3 max
# operating temperature 95 C as older drivers print it for H100 SXM (not in the recording).
H100_SXM_80GB = DeviceProfile(
    key="h100-sxm-80gb",
    name="NVIDIA H100 80GB HBM3",
    memory_total_bytes=81559 * MIB,
    # "FB Memory Usage ... Reserved: 551 MiB" in the same 535.161.08 recording (every GPU); the real
    # H100 of tests/fixtures/nvml-real/ (driver 580.159.04) prints 480 MiB.
    memory_reserved_bytes=551 * MIB,
    sm_clock_max_mhz=1980,
    memory_clock_max_mhz=2619,
    sm_clock_idle_mhz=86,
    power_limit_mw=700_000,
    power_idle_mw=67_740,
    power_busy_mw=650_000,
    temperature_idle_celsius=30,
    temperature_busy_celsius=62,
    memory_temperature_idle_celsius=39,
    memory_temperature_busy_celsius=58,
    shutdown_temperature_celsius=93,
    slowdown_temperature_celsius=87,
    gpu_max_temperature_celsius=85,
    memory_max_temperature_celsius=95,
    nvlink_count=18,  # NVIDIA H100 Tensor Core GPU datasheet: 18 NVLink 4 links, 900 GB/s
    vbios_version="96.00.74.00.0D",
    driver_version="535.161.08",
    cuda_driver_version=12020,
    pcie_bus_ids=("00000000:19:00.0", "00000000:3B:00.0", "00000000:4C:00.0", "00000000:5D:00.0",
                  "00000000:9B:00.0", "00000000:BB:00.0", "00000000:CB:00.0", "00000000:DB:00.0"),
    pcie_max_bytes_per_second=64_000_000_000,  # PCIe Gen5 x16, per direction
    gpm_supported=True,
    mig_profiles=H100_80GB_MIG,
    # Same recording: "Image Version: G520.0200.00.05" (line 36; the 580 recording of another H100,
    # tests/fixtures/nvml-real/nvidia-smi-q.txt:47, the same); "PCIe Generation Max 5 / Link Width Max
    # 16x" (lines 64, 70); "Fabric State: Completed, Status: Success" (lines 209-211). That driver
    # prints only State and Status, where driver 580 also prints CliqueId, ClusterUUID and the health
    # conditions (nvml-real/nvidia-smi-q.txt:243-253): the fake's 535 answers the v1 call (no health
    # mask) and lacks nvmlDeviceGetGpuFabricInfoV (which came with a later driver, R550: recalled).
    inforom_image_version="G520.0200.00.05",
    nvswitch_fabric=True,
    functions_missing=frozenset({"nvmlDeviceGetGpuFabricInfoV"}),
)

# HGX H200 8-GPU. Measured on a real H200 SXM (board 692-2G520-0282-001, vbios 96.00.A5.00.1A) under
# driver 580.159.04 / CUDA 13.0 (tests/fixtures/nvml-real-h200/, 2026-11-27, checked by
# tests/agent/nvml/test_fake_vs_real.py): name, 143771 MiB, the 615 MiB reserve, 1980/3201 MHz
# maxima, 345 MHz idle, 700 W limit, the thermal limits (T.Limit 87 C: slowdown 89, shutdown 95,
# memory 95), idle draw and temperatures, and the draw and temperatures after 75 s of a bf16
# training loop. NVIDIA H200 Tensor Core GPU datasheet: 18 NVLink 4 links (900 GB/s; the recorded
# VM showed none). The PCI bus ids of the eight slots are not from a recording.
H200_SXM_141GB = DeviceProfile(
    key="h200-sxm-141gb",
    name="NVIDIA H200",
    memory_total_bytes=143771 * MIB,
    memory_reserved_bytes=644_939_776,  # NVML v2's reserve (nvidia-smi -q rounds it up: "616 MiB")
    sm_clock_max_mhz=1980,
    memory_clock_max_mhz=3201,
    sm_clock_idle_mhz=345,
    power_limit_mw=700_000,
    power_idle_mw=83_200,
    # At 96-100% utilization the real board draws 685-694 W, SwPowerCap holding it under 700 W
    # (its SM clock at 1.38-1.46 GHz); the fake's draw is linear in utilization and uncapped.
    power_busy_mw=692_000,
    temperature_idle_celsius=37,
    temperature_busy_celsius=61,
    memory_temperature_idle_celsius=39,
    memory_temperature_busy_celsius=54,
    shutdown_temperature_celsius=95,
    slowdown_temperature_celsius=89,
    gpu_max_temperature_celsius=87,
    memory_max_temperature_celsius=95,
    nvlink_count=18,
    vbios_version="96.00.A5.00.1A",
    driver_version="580.159.04",
    cuda_driver_version=13000,
    pcie_bus_ids=("00000000:18:00.0", "00000000:2A:00.0", "00000000:3A:00.0", "00000000:5D:00.0",
                  "00000000:9A:00.0", "00000000:AB:00.0", "00000000:BA:00.0", "00000000:DB:00.0"),
    pcie_max_bytes_per_second=64_000_000_000,
    gpm_supported=True,
    # The recording: "Image Version: G520.0282.02.02" (nvml-real-h200/nvidia-smi-q.txt:47), PCIe Gen5
    # x16 (lines 76-84), "GPU Recovery Action: None" (line 62). Its VM had no NVSwitch ("Fabric State:
    # N/A", line 244); an HGX H200 baseboard has four NVSwitches (NVIDIA HGX H200 datasheet), so
    # Fabric Manager registers each GPU as on the HGX H100.
    inforom_image_version="G520.0282.02.02",
    nvswitch_fabric=True,
    recovery_action_supported=True,
)

# HGX A100 8-GPU: NVIDIA A100 Tensor Core GPU datasheet (80 GB HBM2e, 400 W TDP, 1410 MHz boost,
# NVLink 600 GB/s = 12 links, which the recorded `nvidia-smi nvlink --status` of an A100-SXM4-80GB
# also shows: 12 links x 25 GB/s). HBM2e memory clock 1593 MHz; temperature limits as A100 SXM
# nodes print them (shutdown 92 C, slowdown 89 C, max operating 85 C, memory 95 C).
A100_SXM_80GB = DeviceProfile(
    key="a100-sxm-80gb",
    name="NVIDIA A100-SXM4-80GB",
    memory_total_bytes=81920 * MIB,
    memory_reserved_bytes=551 * MIB,  # no recording of an A100 at hand: the H100's at driver 535
    sm_clock_max_mhz=1410,
    memory_clock_max_mhz=1593,
    sm_clock_idle_mhz=210,
    power_limit_mw=400_000,
    power_idle_mw=60_000,
    power_busy_mw=370_000,
    temperature_idle_celsius=32,
    temperature_busy_celsius=65,
    memory_temperature_idle_celsius=36,
    memory_temperature_busy_celsius=62,
    shutdown_temperature_celsius=92,
    slowdown_temperature_celsius=89,
    gpu_max_temperature_celsius=85,
    memory_max_temperature_celsius=95,
    nvlink_count=12,
    vbios_version="92.00.45.00.06",
    driver_version="535.161.08",
    cuda_driver_version=12020,
    pcie_bus_ids=("00000000:07:00.0", "00000000:0F:00.0", "00000000:47:00.0", "00000000:4E:00.0",
                  "00000000:87:00.0", "00000000:90:00.0", "00000000:B7:00.0", "00000000:BD:00.0"),
    pcie_max_bytes_per_second=32_000_000_000,  # PCIe Gen4 x16, per direction
    mig_profiles=A100_80GB_MIG,
    # Not recorded here: an A100 image version as nvidia-smi prints them (G506...). Ampere's NVSwitch
    # fabric predates NVML's fabric info (nvml.h: "For Hopper or newer fully supported devices"):
    # state NOT_SUPPORTED; driver 535 as the H100 profile's (no V call, no recovery action field).
    inforom_image_version="G506.0200.00.04",
    pcie_link_generation_max=4,
    functions_missing=frozenset({"nvmlDeviceGetGpuFabricInfoV"}),
)

# DGX-1 / HGX-1 V100: NVIDIA Tesla V100 datasheet (32 GB HBM2, 300 W, 1530 MHz boost, 6 NVLink 2
# links). Volta still retires pages instead of remapping rows (NVIDIA "Dynamic Page Retirement"
# documentation), so this is the profile where the retired-pages queries answer and the remapped
# rows query does not.
V100_SXM2_32GB = DeviceProfile(
    key="v100-sxm2-32gb",
    name="Tesla V100-SXM2-32GB",
    memory_total_bytes=32510 * MIB,
    memory_reserved_bytes=551 * MIB,  # no recording of a V100 at hand: the H100's at driver 535
    sm_clock_max_mhz=1530,
    memory_clock_max_mhz=877,
    sm_clock_idle_mhz=135,
    power_limit_mw=300_000,
    power_idle_mw=42_000,
    power_busy_mw=280_000,
    temperature_idle_celsius=33,
    temperature_busy_celsius=66,
    memory_temperature_idle_celsius=34,
    memory_temperature_busy_celsius=60,
    shutdown_temperature_celsius=90,
    slowdown_temperature_celsius=87,
    gpu_max_temperature_celsius=83,
    memory_max_temperature_celsius=85,
    nvlink_count=6,
    vbios_version="88.00.80.00.01",
    driver_version="535.161.08",
    cuda_driver_version=12020,
    pcie_bus_ids=("00000000:06:00.0", "00000000:07:00.0", "00000000:0A:00.0", "00000000:0B:00.0",
                  "00000000:85:00.0", "00000000:86:00.0", "00000000:89:00.0", "00000000:8A:00.0"),
    pcie_max_bytes_per_second=16_000_000_000,  # PCIe Gen3 x16
    # MIG came with Ampere (NVIDIA MIG User Guide, "Supported GPUs"): Volta answers NotSupported.
    # (nvmlDeviceGetMaxMigDeviceCount answers 0 there instead: "zero if MIG is not supported or enabled").
    not_supported=frozenset({"nvmlDeviceGetFanSpeed", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetMigMode",
                             "nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetGpuFabricInfo"}),
    # Not recorded: an image version of the G503 family Volta boards print. PCIe Gen3 x16; the fabric
    # call answers NotSupported (the other pre-Hopper form; A100 answers state NOT_SUPPORTED).
    inforom_image_version="G503.0203.00.04",
    pcie_link_generation_max=3,
    functions_missing=frozenset({"nvmlDeviceGetGpuFabricInfoV"}),
)

PROFILES: dict[str, DeviceProfile] = {
    p.key: p for p in (H100_SXM_80GB, H200_SXM_141GB, A100_SXM_80GB, V100_SXM2_32GB)
}
