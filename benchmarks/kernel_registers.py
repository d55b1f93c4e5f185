"""Registers and spills of the fused kernels compiled for an H100/H200 (sm_90a), no GPU needed.

``env -u TRITON_INTERPRET python benchmarks/kernel_registers.py > OUT.txt``: for head sizes
and tiles the launcher uses, each product precision (DOT 0 ieee, 1 tf32, 2 bf16) and 1, 2,
3 and 6 measures per launch, Triton compiles ``rows`` (top-8 keys) and ``cols``
(``measures.tiled.compile_offline``) and the ptxas it ships reports registers per thread
and bytes of spill stores. Prints one line each: ``d{head} t{tile} dot{precision}
n{measures} {kernel} (registers, spill bytes)``. Each compile takes seconds on a CPU.
"""

from __future__ import annotations

import re
import subprocess
import tempfile

#: the default measures' kernel numbers, contribution first (see measures.tiled.MEASURES)
NUMBERS = [1, 0, 2, 4, 5, 6]


def ptxas_report(ptx: str, ptxas: str) -> tuple[int | None, int | None]:
    """(registers per thread, bytes of spill stores) that ``ptxas -v`` gives for sm_90a."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        run = subprocess.run(
            [ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", "/dev/null"],
            capture_output=True,
            text=True,
        )
    text = run.stderr + run.stdout
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    return (int(regs.group(1)) if regs else None, int(spill.group(1)) if spill else None)


def main() -> int:
    from triton.backends.nvidia.compiler import get_ptxas

    from contribution_weights.measures import triton_kernels as tk
    from contribution_weights.measures.tiled import compile_offline, slot_flags

    ptxas = get_ptxas(90).path
    kernels = tk.build()
    for d, tile in ((128, 32), (64, 64), (64, 32), (128, 16)):
        tiles = dict(BLOCK_M=tile, BLOCK_N=tile, BLOCK_D=d)
        for dot in (0, 1, 2):
            for n in (1, 2, 3, 6):
                flags = dict(
                    **slot_flags(NUMBERS[:n], tk.SLOTS),
                    SOFTCAP=False,
                    DOT=dot,
                    INTERPRET=False,
                    **tiles,
                )
                for kind, fn, extra in (
                    ("rows", kernels.rows, dict(TOPK=8, TOPK_PAD=8)),
                    ("cols", kernels.cols, {}),
                ):
                    ptx = compile_offline(fn, dict(**extra, **flags)).asm["ptx"]
                    print(
                        f"d{d} t{tile} dot{dot} n{n} {kind}", ptxas_report(ptx, ptxas), flush=True
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
