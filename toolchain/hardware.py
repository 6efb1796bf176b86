"""The CPU a measurement ran on, described once for reports and benchmarks.

Runtimes pick kernels by instruction set (OpenVINO's CPU plugin computes in bf16 and fuses MLPs where the CPU has
AMX or AVX-512 BF16; ONNX Runtime's int8 MatMulNBits path needs AVX-512 VNNI or AVX-VNNI), so a latency figure
means little without the CPU model and the extensions it has. Linux's /proc/cpuinfo is read; elsewhere only the
architecture and the core count are known.
"""

from __future__ import annotations

import os
import platform
from functools import cache

from toolchain.errors import InputError

# The extensions that change which kernels the runtimes run, in the order reports list them (Linux's flag names).
ISA_EXTENSIONS = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                  "amx_int8", "asimd", "asimddp", "i8mm", "bf16", "sve", "sve2")


@cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (x86 "flags", Arm "Features"); empty elsewhere."""
    info = _cpuinfo()
    return frozenset((info.get("flags") or info.get("Features") or "").split())


def describe_cpu() -> dict:
    """{"model", "vendor", "architecture", "logical_cores", "isa"}: the model name as the kernel reports it (a
    virtual machine may show a generic one), and which of ISA_EXTENSIONS the CPU has."""
    info = _cpuinfo()
    flags = cpu_flags()
    return {"model": info.get("model name") or info.get("Model") or platform.processor() or None,
            "vendor": info.get("vendor_id") or info.get("CPU implementer") or None,
            "architecture": platform.machine(), "logical_cores": os.cpu_count(),
            "isa": [name for name in ISA_EXTENSIONS if name in flags]}


def cpu_line(cpu: dict | None = None) -> str:
    """One line for a caption: 'Intel(R) Xeon(R) Processor (x86_64; avx512_vnni, amx_int8, ...), 2 logical cores';
    the parts a description lacks are left out."""
    cpu = cpu or describe_cpu()
    inside = "; ".join(part for part in (cpu.get("architecture"), ", ".join(cpu.get("isa") or [])) if part)
    line = " ".join(part for part in (cpu.get("model") or "", f"({inside})" if inside else "") if part)
    return line + (f", {cpu['logical_cores']} logical cores" if cpu.get("logical_cores") else "")


# x86 extensions with an int8 dot product (u8 x s8 -> s32) that MLAS's u8s8 GEMM, ORT's DynamicQuantizeMatMul, runs
# on: where a CPU has one, a prompt through it beats MatMulNBits' 4-bit kernels (passes/quantize/prefill_int8.py)
INT8_DOT_PRODUCT = ("avx512_vnni", "avx_vnni", "amx_int8")


def has_int8_dot_product() -> bool:
    return any(name in cpu_flags() for name in INT8_DOT_PRODUCT)


def memory_bytes() -> int:
    """Physical RAM of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


MEMORY_LIMIT_ENV = "DSTC_MEMORY_LIMIT_BYTES"


def available_memory_bytes() -> int:
    """The memory a new allocation may take now without swapping or the kernel's OOM killer: MemAvailable of
    /proc/meminfo (free memory plus the page cache and buffers the kernel can reclaim; physical RAM where there is
    no /proc). DSTC_MEMORY_LIMIT_BYTES, when set, is taken instead: a budget below it, or above it on a machine with
    swap, at the user's risk."""
    given = os.environ.get(MEMORY_LIMIT_ENV)
    if given:
        try:
            limit = int(given)
        except ValueError:
            limit = 0
        if limit < 1:
            raise InputError(f"{MEMORY_LIMIT_ENV} must be a positive number of bytes, not {given!r}")
        return limit
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return memory_bytes()
