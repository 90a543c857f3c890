"""Model FLOPs and device peaks: the arithmetic of model FLOPs utilization (MFU).

MFU = tokens/s × model FLOPs per token / the device's peak FLOP/s. The model FLOPs count the
matmuls of a training step (forward and backward), whatever is recomputed or fused; the peak is the
vendor's dense (not 2:4 sparse) tensor-core figure for the precision the run computes in.
"""

from __future__ import annotations

import torch

from normlab.config import RunConfig

# Dense peak TFLOP/s by the start of torch.cuda.get_device_name's answer (after "NVIDIA "), from the
# vendors' data sheets: (bf16/fp16 tensor cores, tf32 tensor cores, fp32 without tensor cores).
# More specific names come first: the first one that the device's name starts with is taken.
PEAK_TFLOPS: dict[str, tuple[float, float, float]] = {
    "H100 PCIe": (756.0, 378.0, 51.2),
    "H100 NVL": (835.0, 418.0, 60.0),
    "H100": (989.4, 494.7, 66.9),  # SXM5 ("H100 80GB HBM3")
    "H200": (989.4, 494.7, 66.9),
    "GH200": (989.4, 494.7, 66.9),
    "A100": (312.0, 156.0, 19.5),
    "L40S": (362.1, 183.0, 91.6),
    "L40": (181.0, 90.5, 90.5),
    "L4": (121.0, 60.0, 30.3),
    "A10G": (70.0, 35.0, 31.2),
}


def model_flops_per_token(cfg: RunConfig) -> float:
    """6·N + 12·L·d·T (PaLM's estimate, Chowdhery et al. 2022, appendix B): N counts the matmul weights
    (qkv, attention proj, MLP fc and proj, the head), L blocks of width d, sequence length T."""
    d, L, T = cfg.model.d_model, cfg.depth, cfg.seq_len
    n_matmul = L * (4 + 2 * cfg.model.mlp_ratio) * d * d + d * (cfg.model.vocab_size or 256)
    return 6 * n_matmul + 12 * L * d * T


def peak_flops(device: torch.device, precision: str, tf32: bool) -> float | None:
    """The device's dense peak FLOP/s for `precision` (fp32 on TF32 tensor cores when `tf32`), or None
    where it is not known: the CPU, or a GPU missing from PEAK_TFLOPS."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).removeprefix("NVIDIA ").strip()
    for prefix, (half, tf32_peak, fp32) in PEAK_TFLOPS.items():
        if name.startswith(prefix):
            tflops = half if precision in ("bf16", "fp16") else tf32_peak if tf32 else fp32
            return tflops * 1e12
    return None
