"""Frameworks whose GPU allocators hold far more device memory than the program uses, and the settings that
make them hold only what they use (docs/gpu.md, "Frameworks that preallocate").

A GPU checkpoint copies every byte a process holds on its GPUs, used or not: JAX's default preallocation of
75 % of an H200 is ~105 GiB copied, written and restored at each capture, whatever the model needs.

- Detection (at each capture's SIZE phase): the framework from the libraries a process maps, its settings
  from its environment, what it holds from NVML. A process that holds about what its framework preallocates
  by default gets a note in the job's stderr naming the variable to set. What PyTorch's caching allocator
  keeps reserved beyond its tensors cannot be seen from outside: its note only says what is held.
- Defaults (at launch, `growth_defaults`): for a GPU task whose environment sets none of a framework's
  memory variables, XLA_PYTHON_CLIENT_PREALLOCATE=false and TF_FORCE_GPU_ALLOW_GROWTH=true are added
  (config `gpu_growth_defaults`, on by default; decision and costs in docs/gpu.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from slurmckpt.node import procfs
from slurmckpt.sizes import size_text

JAX_VARS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")
TF_VARS = ("TF_FORCE_GPU_ALLOW_GROWTH", "TF_GPU_ALLOCATOR")
GROWTH_DEFAULTS = {"XLA_PYTHON_CLIENT_PREALLOCATE": ("false", JAX_VARS),
                   "TF_FORCE_GPU_ALLOW_GROWTH": ("true", TF_VARS)}
JAX_DEFAULT_FRACTION = 0.75
TF_DEFAULT_FRACTION = 0.9           # TensorFlow maps nearly all free memory (what is left after the driver)
NEAR = 0.9                          # "holds about its preallocation": at least this share of it
SMALL = 1 << 30                     # below 1 GiB on a GPU nothing is worth a note

LIBRARIES = (("jax", ("xla_extension", "jaxlib", "libjax_common", "xla_cuda_plugin", "jax_cuda")),
             ("tensorflow", ("libtensorflow_framework", "_pywrap_tensorflow")),
             ("pytorch", ("libtorch_cuda", "libc10_cuda")),
             ("cupy", ("cupy_backends", "/cupy/")))


@dataclass(frozen=True)
class GpuHolding:
    """What one process holds on one GPU (NVML's bytes), for the allocator notes below."""
    pid: int
    uuid: str
    bytes: int
    total: int          # the GPU's memory


def framework_of(pid: int) -> str | None:
    """The first framework whose libraries `pid` maps (JAX before TensorFlow before PyTorch: a JAX process
    may map torch too, and the preallocation is the one that matters)."""
    try:
        paths = {parts[5] for parts in procfs.maps(pid) if len(parts) == 6}
    except OSError:
        return None
    for name, markers in LIBRARIES:
        if any(m in p for p in paths for m in markers):
            return name
    return None


def preallocation_note(held: GpuHolding, framework: str | None, env: Mapping[str, str]) -> str | None:
    """A line for the job's stderr when `held` looks like a framework's preallocation, else None."""
    if held.bytes < SMALL or framework is None or not held.total:
        return None
    share = held.bytes / held.total
    held_text = f"{size_text(held.bytes)} ({share:.0%} of the GPU's memory)"
    copied = "every capture copies, writes and restores all of it"
    if framework == "jax" and env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() not in ("false", "0"):
        fraction = _fraction(env.get("XLA_PYTHON_CLIENT_MEM_FRACTION"), JAX_DEFAULT_FRACTION)
        if env.get("XLA_PYTHON_CLIENT_ALLOCATOR") != "platform" and share >= fraction * NEAR:
            return (f"pid {held.pid} (JAX) holds {held_text} on {held.uuid}: JAX's preallocation "
                    f"(XLA_PYTHON_CLIENT_MEM_FRACTION={fraction:g}), not what the program uses; {copied}. "
                    "Set XLA_PYTHON_CLIENT_PREALLOCATE=false for the job to hold only what it uses")
    if framework == "tensorflow" and env.get("TF_FORCE_GPU_ALLOW_GROWTH", "").lower() != "true" \
            and env.get("TF_GPU_ALLOCATOR") != "cuda_malloc_async" and share >= TF_DEFAULT_FRACTION * NEAR:
        return (f"pid {held.pid} (TensorFlow) holds {held_text} on {held.uuid}: TensorFlow maps nearly all GPU memory "
                f"unless told otherwise; {copied}. Set TF_FORCE_GPU_ALLOW_GROWTH=true for the job")
    if framework == "pytorch" and share >= 0.5:
        return (f"pid {held.pid} (PyTorch) holds {held_text} on {held.uuid}: PyTorch's caching allocator keeps freed "
                f"blocks reserved, and {copied}; the program's own torch.cuda.memory_reserved() vs "
                "memory_allocated() tells how much is cache")
    return None


def notes(held: list[GpuHolding]) -> list[str]:
    """The notes for every process and GPU in `held` (framework read once per process)."""
    out, frameworks, envs = [], {}, {}
    for h in held:
        if h.pid not in frameworks:
            frameworks[h.pid] = framework_of(h.pid)
            envs[h.pid] = procfs.environ(h.pid)
        note = preallocation_note(h, frameworks[h.pid], envs[h.pid])
        if note:
            out.append(note)
    return out


def growth_defaults(env: Mapping[str, str]) -> dict[str, str]:
    """What to add to a GPU task's environment: each framework's on-demand setting, unless the job set any
    of that framework's memory variables itself (its choice stands)."""
    return {name: value for name, (value, related) in GROWTH_DEFAULTS.items()
            if not any(v in env for v in related)}


def _fraction(text: str | None, default: float) -> float:
    try:
        value = float(text) if text is not None else default
    except ValueError:
        return default
    return value if 0 < value <= 1 else default

