"""TorchEngine: the GPU probes' compute seam over torch, on CUDA where torch sees a GPU (bf16 or fp16
matmuls, device-to-device and peer copies, the device synchronised around every timed region) and
on the CPU elsewhere (float32, small sizes; every GPU index is the CPU), which is how tests and a
node without GPUs run the same probes.

torch is imported when an engine is built, never at import, so the agent runs without it. It
measures and returns figures; it judges nothing and reads no NVML (the probes do).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vigil.agent.probes.engine import AllocationError, LoadSampler

Clock = Callable[[], float]

# Square matmul sizes. 8192 bf16 on an H100: 2 * 8192^3 = 1.1 TFLOP a matmul, ~1.7 ms at the ~650
# dense TFLOP/s cuBLAS reaches, big enough that launch overhead vanishes and the board reaches its
# power limit; 256 float32 on the CPU is a ~1 ms matmul, so a CPU pass is quick.
CUDA_MATMUL_N = 8192
CPU_MATMUL_N = 256
# Matmuls issued between two synchronisations: on CUDA the queue stays full while the probe's
# sampler reads NVML (the GPU works through the batch meanwhile); torch on the CPU is synchronous.
CUDA_MATMUL_BATCH = 8
CPU_MATMUL_BATCH = 1
# Copies are repeated for at least this long (and at least _COPIES_MIN times): HBM copies of 1 GiB
# take ~0.7 ms on an H100 (3 TB/s), so 0.5 s averages hundreds of them.
CUDA_COPY_SECONDS = 0.5
CPU_COPY_SECONDS = 0.05
_COPIES_MIN = 3
# On the CPU the "device memory" buffers are capped here: a CPU pass stands in for a GPU's and must
# stay quick and small whatever ``probes.memory_bytes`` asks of a GPU.
CPU_MAX_BYTES = 16 << 20
# A loop whose clock never advances is a broken clock, not a fast device: stop rather than spin.
# A million is far above any real pass: an H100's bf16 8192^3 matmul takes ~1.6 ms, so the longest
# pass allowed (probes.burn_pass_seconds 600) is ~375,000 of them.
_ITERATIONS_MAX = 1_000_000
# Patterns written to every word of the pattern test, as 64-bit words (signed: torch.int64). All
# zeros and all ones find stuck bits; 0x55../0xAA.. find adjacent bits that couple; the address
# and its complement find address-line faults (a word written to the wrong place), as memtest86's
# "own address" test does.
WORD_BYTES = 8
_PATTERNS = (0x0, -1, 0x5555555555555555, -0x5555555555555556)  # 0x00.., 0xFF.., 0x55.., 0xAA..
_ADDRESS_CHUNK_WORDS = 1 << 24  # the address patterns are checked in chunks of 128 MiB


class TorchEngine:
    """The compute seam over torch. ``use_cuda`` None: CUDA when torch.cuda.is_available().
    ``nvml_uuid(index)`` names NVML's GPU ``index`` so that its CUDA device is found by UUID (CUDA
    orders devices fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID; NVML by PCI bus id); without
    it, or where torch gives no UUID, NVML index i is CUDA device i. ``clock`` times every region."""

    def __init__(self, *, use_cuda: bool | None = None, clock: Clock = time.perf_counter,
                 nvml_uuid: Callable[[int], str] | None = None, matmul_n: int | None = None) -> None:
        import torch  # lazily: the agent runs without torch; build_engine catches the ImportError

        self._torch: Any = torch
        self._cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        if self._cuda and not torch.cuda.is_available():
            raise RuntimeError("TorchEngine(use_cuda=True) but torch sees no CUDA device")
        self._clock = clock
        self._nvml_uuid = nvml_uuid
        self._cuda_index: dict[int, int] | None = None
        self._n = matmul_n or (CUDA_MATMUL_N if self._cuda else CPU_MATMUL_N)
        if self._cuda:
            self._dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        else:
            self._dtype = torch.float32

    @property
    def kind(self) -> str:
        return "cuda" if self._cuda else "cpu"

    @property
    def concurrent(self) -> bool:
        return self._cuda  # one CUDA device per GPU; on the CPU every GPU is the same cores

    # --- devices -------------------------------------------------------------------------------

    def _device(self, index: int) -> Any:
        torch = self._torch
        if not self._cuda:
            return torch.device("cpu")
        return torch.device("cuda", self._map_cuda(index))

    def _map_cuda(self, index: int) -> int:
        if self._cuda_index is None:
            self._cuda_index = {}
            if self._nvml_uuid is not None:
                torch = self._torch
                by_uuid: dict[str, int] = {}
                for i in range(torch.cuda.device_count()):
                    uuid = getattr(torch.cuda.get_device_properties(i), "uuid", None)
                    if uuid is not None:
                        by_uuid[str(uuid).lower().removeprefix("gpu-")] = i
                for nvml_index in range(torch.cuda.device_count()):
                    try:
                        key = self._nvml_uuid(nvml_index).lower().removeprefix("gpu-")
                    except Exception:  # noqa: BLE001 - an unnamed GPU keeps the identity mapping
                        continue
                    if key in by_uuid:
                        self._cuda_index[nvml_index] = by_uuid[key]
        return self._cuda_index.get(index, index)

    def _sync(self, *devices: Any) -> None:
        if self._cuda:
            for device in devices:
                self._torch.cuda.synchronize(device)

    def _allocate(self, factory: Callable[[], Any]) -> Any:
        torch = self._torch
        try:
            return factory()
        except torch.OutOfMemoryError as exc:
            raise AllocationError(str(exc).splitlines()[0] if str(exc) else "out of memory") from exc
        except RuntimeError as exc:  # the CPU allocator: "DefaultCPUAllocator: can't allocate memory"
            if "alloc" in str(exc).lower():
                raise AllocationError(str(exc).splitlines()[0]) from exc
            raise

    def _bytes(self, nbytes: int) -> int:
        return nbytes if self._cuda else min(nbytes, CPU_MAX_BYTES)

    def _elapsed(self, start: float, count: int) -> float:
        if count > _ITERATIONS_MAX:
            raise RuntimeError("the engine's clock does not advance")
        return self._clock() - start

    # --- the burn ------------------------------------------------------------------------------

    def matmul_tflops(self, device: int, seconds: float, sample: LoadSampler | None = None) -> float:
        torch = self._torch
        dev = self._device(device)
        n = self._n
        a = self._allocate(lambda: torch.randn(n, n, device=dev, dtype=self._dtype))
        b = self._allocate(lambda: torch.randn(n, n, device=dev, dtype=self._dtype))
        c = self._allocate(lambda: torch.empty(n, n, device=dev, dtype=self._dtype))
        torch.matmul(a, b, out=c)  # warm-up: cuBLAS picks its kernel, the clocks ramp, untimed
        self._sync(dev)
        batch = CUDA_MATMUL_BATCH if self._cuda else CPU_MATMUL_BATCH
        count = 0
        start = self._clock()
        while True:
            for _ in range(batch):
                torch.matmul(a, b, out=c)
            count += batch
            if sample is not None:
                sample()  # on CUDA the batch is still running: NVML sees the loaded GPU
            self._sync(dev)
            elapsed = self._elapsed(start, count)
            if elapsed >= seconds:
                break
        return 2.0 * n ** 3 * count / elapsed / 1e12 if elapsed > 0 else 0.0

    # --- memory --------------------------------------------------------------------------------

    def _timed_copies(self, dst: Any, src: Any, devices: tuple[Any, ...], bytes_per_copy: float) -> float:
        dst.copy_(src)  # warm-up, untimed
        self._sync(*devices)
        least = CUDA_COPY_SECONDS if self._cuda else CPU_COPY_SECONDS
        count = 0
        start = self._clock()
        while True:
            dst.copy_(src)
            count += 1
            self._sync(*devices)
            elapsed = self._elapsed(start, count)
            if count >= _COPIES_MIN and elapsed >= least:
                break
        return bytes_per_copy * count / elapsed / 1e9 if elapsed > 0 else 0.0

    def copy_gb_per_s(self, device: int, nbytes: int) -> float:
        torch = self._torch
        dev = self._device(device)
        size = max(self._bytes(nbytes) // 2, 1)  # source and destination share the buffer size
        src = self._allocate(lambda: torch.ones(size, dtype=torch.uint8, device=dev))
        dst = self._allocate(lambda: torch.empty(size, dtype=torch.uint8, device=dev))
        return self._timed_copies(dst, src, (dev,), 2.0 * size)  # each copy reads and writes ``size``

    def pattern_errors(self, device: int, nbytes: int) -> int:
        torch = self._torch
        dev = self._device(device)
        words = max(self._bytes(nbytes) // WORD_BYTES, 1)
        buf = self._allocate(lambda: torch.empty(words, dtype=torch.int64, device=dev))
        wrong = 0
        for pattern in _PATTERNS:
            buf.fill_(pattern)
            self._sync(dev)
            wrong += int((buf != pattern).sum().item())
        for invert in (False, True):  # the word's own index, then its complement
            for lo in range(0, words, _ADDRESS_CHUNK_WORDS):
                hi = min(lo + _ADDRESS_CHUNK_WORDS, words)
                address = torch.arange(lo, hi, dtype=torch.int64, device=dev)
                buf[lo:hi] = torch.bitwise_not(address) if invert else address
            self._sync(dev)
            for lo in range(0, words, _ADDRESS_CHUNK_WORDS):
                hi = min(lo + _ADDRESS_CHUNK_WORDS, words)
                address = torch.arange(lo, hi, dtype=torch.int64, device=dev)
                expected = torch.bitwise_not(address) if invert else address
                wrong += int((buf[lo:hi] != expected).sum().item())
        return wrong

    def p2p_gb_per_s(self, src: int, dst: int, nbytes: int) -> float:
        torch = self._torch
        a_dev, b_dev = self._device(src), self._device(dst)
        size = max(self._bytes(nbytes), 1)
        a = self._allocate(lambda: torch.ones(size, dtype=torch.uint8, device=a_dev))
        b = self._allocate(lambda: torch.empty(size, dtype=torch.uint8, device=b_dev))
        # torch copies between CUDA devices peer to peer where peer access is possible (NVLink or
        # PCIe P2P), else through the host; the bandwidth shows which.
        return self._timed_copies(b, a, (a_dev, b_dev), float(size))
