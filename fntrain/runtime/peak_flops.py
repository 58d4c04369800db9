"""Peak dense bf16 matrix FLOP/s of one device, by device name: the denominator of MFU.

`peak_flops_for_name("NVIDIA H100 80GB HBM3")` is 989e12. The table is matched as a case-insensitive
substring of the name the device module reports (`torch.cuda.get_device_name`, ...), first match wins.
"""

from __future__ import annotations

__all__ = ["PEAK_FLOPS", "peak_flops_for_name"]

# Peak dense (no sparsity) bf16 matrix FLOP/s of one device, matched as a case-insensitive substring of
# the device name, first match wins (so "H200" is tested before "H20", "L40S" before "L40"). Sources:
# vendor datasheets (NVIDIA, AMD); Ascend values as used by VeOmni/verl (one device = one die).
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500e12),
    ("B200", 2250e12),
    ("B100", 1750e12),
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("H800 PCIe", 756e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L20", 119.5e12),
    ("L4", 121e12),
    ("A40", 149.7e12),
    ("A10", 125e12),
    ("RTX 6000 Ada", 364.2e12),
    ("RTX 5090", 209.5e12),
    ("RTX 4090", 165.2e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),  # fp16: no bf16 on Volta
    ("T4", 65e12),  # fp16
    ("MI355X", 2500e12),
    ("MI325X", 1307e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
    ("MI250", 362e12),
    ("910B", 354e12),  # Ascend 910B1..B4 ("Ascend910B2", "Ascend910B3", ...)
    ("910_93", 354e12),  # Ascend 910C, reported per die as "Ascend910_93xx"
    ("910C", 354e12),
)


def peak_flops_for_name(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s for a device name from `PEAK_FLOPS`, or None when it is not listed."""
    lowered = device_name.lower()
    for pattern, flops in PEAK_FLOPS:
        if pattern.lower() in lowered:
            return flops
    return None
